"""WeightSync: the one object that owns the order of a weight push, for every transport and schedule.

    sync = WeightSync(trainer, generators, cfg)     # trainer: actors.trainer.Trainer; generators: actor handles
    await sync.attach(host)                         # a sender per trainer rank, a receiver per generator
    await sync.start(v)                             # returns once the trainer's snapshot of v is packed
    ...                                             # the next train step may run here
    seconds = await sync.wait()                     # every generator serves v (or the push's error)
    seconds = await sync.push(v)                    # start + wait

A push of version v has two phases per generator:

    stage  the transport brings v into the generator's staging; generation goes on meanwhile
    apply  the generator's on_update strategy (keep / abort / drain) around the vLLM load
    verify (weight_sync.verify, on the pushes it names) the checksums of what the generator's engine
           serves, read back in its worker, against those of the trainer's packed snapshot

Ordering contract:
  * trainer.push_weights (every rank packs its own shards, transfer started) happens first and is awaited
    by `start`: after it the optimizer may overwrite the live weights.
  * Every generator stages v concurrently. For the pull transports (rdma, shm) that may start any
    time after the pack. For `collective` it must: the broadcast needs the sender and every receiver
    inside the call at once, and the sender's side is already running when `start` returns, so
    staging them together is what makes send and receive overlap. Every receiver holding v means
    the sender's side is done too; a failure on the sender's side fails the receivers' stage (or,
    at the latest, the trainer's next push_weights, which awaits the previous transfer).
  * apply follows once every stage is done: one generator at a time when `generator.rolling` (the
    others keep generating), else all at once. A generator that does not report v afterwards fails
    the push: a generator silently serving stale weights is the worst bug this system can have.
  * verify follows each generator's apply (under rolling, before the next generator's apply); the
    trainer's reference checksums are taken from the packed slot of v while the stage runs, which
    the next pack leaves alone (it writes the other slot). A mismatch fails that generator's part
    of the push like a failed load (SyncError naming the generator, the version and the tensors).
    The first push of a run, when verify is on, corrupts every generator's served weights inside
    its apply's pause, before the load: its verify then proves the load rewrote every served byte.
  * Delta (weight_sync.delta, delta.py): rdma receivers read the delta only if their staged copy
    holds its base, else the full bytes; a collective broadcast is one choice for all, so `start`
    asks for full when any live generator does not serve the version pushed last (a replacement, a
    failed push, a resume). A receiver that fails to apply a delta holds no valid copy after it.
  * At most one push is in flight: `start(v+1)` first awaits the push of v, since the trainer's
    slot of v-1 is overwritten by v+1 and a receiver must never read a slot being rewritten.
  * Every call is bounded: the transfer by weight_sync.timeout_s, apply by that plus
    generator.request_timeout_s (drain waits for in-flight requests). A failed push raises
    RunError from `wait` (or from the next `start`), naming the generator and the version.

Example:
    sync = WeightSync(trainer, gens, cfg)
    await sync.attach("127.0.0.1")
    for step in range(steps):
        batch = await buffer.get_batch(...)
        await trainer.train_step(batch)             # version v = step + 1
        await sync.start(v)                          # overlaps the next iteration's batch wait and step
    await sync.wait()
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, MutableSequence

from pipeline.config import Config
from pipeline.weightsync.checksum import Checksum
from pipeline.weightsync.verify import VerifyError, check

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A weight push failed or timed out; the message names the generator, the phase and the version."""


async def _bounded(what: str, aw, timeout_s: float):
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except asyncio.TimeoutError:
        raise SyncError(f"{what} did not finish within {timeout_s:.0f}s") from None


class WeightSync:
    """See the module docstring. `generators[i]` is generator i's actor handle, None while it is out
    (dead, restarting): the caller's live list, read (not copied) and written only by `detach` and
    `rejoin`. `served[i]` is the version generator i reported after its last apply. With
    `on_failure` set, a generator that fails its part of a push is taken out (`on_failure(i, error)`
    tells its supervisor; `on_failure(None, error)`: the push failed) and the push goes on for the
    others; without it, any failure fails the push."""

    def __init__(self, trainer: Any, generators: MutableSequence[Any], cfg: Config,
                 on_failure: Callable[[int | None, BaseException], None] | None = None) -> None:
        self.trainer, self.generators, self.cfg = trainer, generators, cfg
        self.on_failure = on_failure
        self._host = "127.0.0.1"
        self._handle = None
        self._rewire = False  # collective: a member left, so the group must be rebuilt before the next push
        self._parts: dict[int, asyncio.Task] = {}  # each member's part of the push in flight
        self._lock = asyncio.Lock()  # start / attach / rejoin never interleave
        self._task: asyncio.Task | None = None
        self.served: dict[int, int] = {}
        self.pushes = 0  # pushes started by this object: weight_sync.verify counts them
        self.verified_pushes = 0  # pushes whose every member's served weights matched the trainer's
        self._pushed: int | None = None  # the version last packed: the base of the next delta
        self.last: dict[str, float] = {}
        """Timing of the last finished push: total_s, pack_s, stage_s, apply_s, and verify_s when
        it was verified (seconds, the slowest generator's read-back); rdma, collective: bytes moved
        to every generator, full_bytes (a full push's), delta_receivers (generators sent a delta)."""

    @property
    def kind(self) -> str:
        return self.cfg.weight_sync.transport

    @property
    def pushed(self) -> int:
        """The version last packed (0 before any push: the generators start on version 0's weights)."""
        return self._pushed if self._pushed is not None else 0

    def live(self) -> list[tuple[int, Any]]:
        return [(i, g) for i, g in enumerate(self.generators) if g is not None]

    async def attach(self, host: str = "127.0.0.1") -> None:
        """Build a sender on every trainer rank and a receiver on every live generator. `host`: the
        address generators reach trainer rank 0's host at (collective). Calling it again rewires."""
        async with self._lock:
            self._host = host
            await self._attach()

    async def _settled(self) -> None:
        """Wait until no push is in flight, leaving its outcome (an error) to the next start/wait."""
        if self._task is not None:
            await asyncio.wait({self._task})

    async def _attach(self) -> None:
        await self._settled()
        live = self.live()
        # collective: one process group over the live generators, ranked by position; the pull
        # transports address generators by index, so a replacement reuses its predecessor's rank
        n = len(live) if self.kind == "collective" else len(self.generators)
        self._handle = await self.trainer.sync_handle(max(n, 1), self._host, self.cfg.weight_sync)
        ranks = range(len(live)) if self.kind == "collective" else [i for i, _ in live]
        await _bounded("attach weights", asyncio.gather(
            *[g.attach_weights.call_one(self._handle, r) for (_, g), r in zip(live, ranks)]), self.cfg.weight_sync.timeout_s)
        self._rewire = False

    def detach(self, i: int) -> None:
        """Take generator i out of every later push (it died); a push in flight ignores its failure."""
        self.served.pop(i, None)
        if self.generators[i] is not None:
            self.generators[i] = None
            self._rewire = self.kind == "collective"
        part = self._parts.get(i)
        if part is not None and part is not asyncio.current_task():
            part.cancel()  # a dead generator's stage or apply may never answer

    async def leave(self, i: int) -> None:
        """Generator i leaves the push group for good at the next push boundary (the pool removes it):
        the push in flight, which may be applying on it, ends first; later pushes skip it."""
        async with self._lock:
            await self._settled()
            self.detach(i)

    async def rejoin(self, i: int, gen: Any) -> None:
        """Generator i's replacement (or a generator that joins the pool) joins at the next push
        boundary (it serves an older version until the next push reaches it). A pull transport's
        sender is built for a number of receivers: an index past it rebuilds the sender for all."""
        async with self._lock:
            await self._settled()
            self.generators[i] = gen
            try:
                if self.kind == "collective" or i >= self._handle.num_receivers:
                    await self._attach()
                else:
                    await _bounded(f"generator{i}.attach_weights", gen.attach_weights.call_one(self._handle, i),
                                   self.cfg.weight_sync.timeout_s)
            except BaseException:
                self.generators[i] = None
                raise

    async def start(self, version: int) -> None:
        """Pack v on the trainer and start delivering it; returns once the trainer may step again."""
        async with self._lock:
            await self.wait()
            if self._rewire:
                await self._attach()
            t0 = time.monotonic()
            await self.trainer.push_weights(self._full())
            self._pushed = version
            packed = time.monotonic()
            self.pushes += 1
            verify = None
            if self.cfg.weight_sync.verified(self.pushes):
                verify = _Verify(asyncio.ensure_future(self.trainer.weight_checksums(version)),
                                 corrupt_first=self.pushes == 1)
            self._task = asyncio.create_task(self._deliver(version, t0, packed, verify),
                                             name=f"weight-push-v{version}")

    def _full(self) -> bool:
        """Collective with weight_sync.delta: a live generator lacks the base, so push full."""
        if self.kind != "collective" or not self.cfg.weight_sync.delta:
            return False
        return any(self.served.get(i) != self._pushed for i, _ in self.live())

    async def wait(self) -> float:
        """Wait for the push in flight (if any); raises its error. Seconds end to end of the last push.
        Cancelling a waiter does not cancel the push (`cancel` does)."""
        task = self._task
        if task is not None:
            try:
                await asyncio.shield(task)
            finally:
                if self._task is task and task.done():
                    self._task = None
        return self.last.get("total_s", float("nan"))

    async def push(self, version: int) -> float:
        await self.start(version)
        return await self.wait()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _deliver(self, version: int, t0: float, packed: float, verify: "_Verify | None") -> None:
        try:
            await self._deliver_to(version, t0, packed, verify)
        except Exception as e:
            if self.on_failure is not None:  # the supervisor ends the run now, with this error
                self.on_failure(None, e)
            raise
        finally:
            if verify is not None:
                verify.close()

    async def _deliver_to(self, version: int, t0: float, packed: float, verify: "_Verify | None") -> None:
        ws, g = self.cfg.weight_sync, self.cfg.generator
        members, pulls = self.live(), {}
        ok = await _bounded(f"weight push v{version}: stage over {self.kind}", asyncio.gather(
            *[self._member(i, gen, self._stage(i, gen, version, pulls)) for i, gen in members]), ws.timeout_s + 30)
        members = [m for m, good in zip(members, ok) if good]
        staged = time.monotonic()
        apply_timeout = ws.timeout_s + g.request_timeout_s
        if g.rolling:
            ok = []
            for i, gen in members:
                if self.generators[i] is gen:  # not taken out meanwhile
                    ok.append(await self._member(i, gen, self._apply(i, gen, version, apply_timeout, verify)))
        else:
            ok = await asyncio.gather(*[self._member(i, gen, self._apply(i, gen, version, apply_timeout, verify))
                                        for i, gen in members])
        done = time.monotonic()
        self.last = {"total_s": done - t0, "pack_s": packed - t0, "stage_s": staged - packed, "apply_s": done - staged}
        if pulls and all("bytes" in p for p in pulls.values()):  # rdma, collective: what crossed the wire
            self.last.update({"bytes": sum(p["bytes"] for p in pulls.values()),
                              "full_bytes": sum(p["full_bytes"] for p in pulls.values()),
                              "delta_receivers": float(sum(p.get("delta_ranks", 0) > 0 for p in pulls.values()))})
        if verify is not None:
            self.last["verify_s"] = verify.seconds
            if all(ok) and ok:
                self.verified_pushes += 1
                log.info("weight version %d verified bit for bit on %d generator(s): %d tensors each (%.3fs)",
                         version, len(ok), verify.tensors, verify.seconds)

    async def _member(self, i: int, gen: Any, aw) -> bool:
        """One generator's part of a push: True if it succeeded; a failure takes the generator out
        (and goes to its supervisor) when there is one, else fails the push. `detach(i)` cancels it."""
        part = self._parts[i] = asyncio.ensure_future(aw)
        try:
            await asyncio.shield(part)
            return True
        except asyncio.CancelledError:
            if not part.cancelled():  # this push was cancelled, not just member i
                part.cancel()
                raise
            return False
        except Exception as e:
            if self.on_failure is None:
                raise
            if self.generators[i] is gen:  # a report about a replaced generator is stale
                self.detach(i)
                self.on_failure(i, e)
            return False
        finally:
            if self._parts.get(i) is part:
                del self._parts[i]

    async def _stage(self, i: int, gen: Any, version: int, pulls: dict[int, dict]) -> None:
        """Stage `version` on generator i; its pull's report (bytes moved, ...) goes in pulls[i]."""
        try:  # bounded per member, so one hung generator is taken out instead of failing the push
            pulls[i] = await _bounded(f"generator{i}.stage_weights({version})", gen.stage_weights.call_one(version),
                                      self.cfg.weight_sync.timeout_s + 5)
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"generator{i}: staging weight version {version} over {self.kind} failed: {e}") from e

    async def _apply(self, i: int, gen: Any, version: int, timeout_s: float, verify: "_Verify | None") -> None:
        on_update = self.cfg.generator.on_update
        corrupt = verify is not None and verify.corrupt_first
        try:
            served = await _bounded(f"generator{i}.apply_weights({version})",
                                    gen.apply_weights.call_one(version, on_update, corrupt), timeout_s)
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"generator{i}: loading weight version {version} failed: {e}") from e
        if served != version:
            raise SyncError(f"generator{i} serves version {served} after apply_weights({version})")
        if verify is not None:
            await self._verify(i, gen, version, verify)
        if self.generators[i] is gen:
            self.served[i] = version

    async def _verify(self, i: int, gen: Any, version: int, verify: "_Verify") -> None:
        """Generator i's served weights against the trainer's packed snapshot of `version`."""
        t0 = time.monotonic()
        timeout_s = self.cfg.weight_sync.timeout_s
        try:
            ref = await _bounded(f"trainer.weight_checksums({version})", asyncio.shield(verify.reference), timeout_s)
            tensors, parts = await _bounded(f"generator{i}.served_checksums()", gen.served_checksums.call_one(),
                                            timeout_s)
        except SyncError:
            raise
        except Exception as e:
            raise SyncError(f"generator{i}: verifying weight version {version} failed: {e}") from e
        reference = {k: Checksum.from_wire(v) for k, v in ref.items()}
        try:
            n = check(reference, ({k: Checksum.from_wire(v) for k, v in tensors.items()}, parts), i, version)
        except VerifyError as e:
            raise SyncError(str(e)) from e
        verify.tensors, verify.seconds = n, max(verify.seconds, time.monotonic() - t0)


class _Verify:
    """One verified push: the trainer's reference checksums (a task, started with the push), whether
    its apply corrupts first (the start-up check), and what the members' checks found."""

    def __init__(self, reference: asyncio.Future, corrupt_first: bool) -> None:
        self.reference, self.corrupt_first = reference, corrupt_first
        self.tensors, self.seconds = 0, 0.0

    def close(self) -> None:
        """The push is over: stop computing the reference, or take its error (already reported by
        every member that needed it)."""
        if not self.reference.done():
            self.reference.cancel()
        elif not self.reference.cancelled():
            self.reference.exception()
