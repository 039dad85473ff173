"""Supervisor: notices a failed generator or reward model and restarts it while the run goes on.

    sup = Supervisor(cfg, fleet, wiring)     # wiring: what a restart does around the slot (RestartWiring)
    sup.install_fault_hook()                 # Monarch's fault reports go to its queue
    sync = WeightSync(trainer, fleet.handles, cfg, on_failure=sup.report)
    await sup.run()                          # beside the train loop; raises RunError to end the run

Failures come in through ONE queue of (slot, incarnation, cause), fed by:
  * Monarch's fault hook: a dead mesh, mapped to its slot by the slot's own mesh name
    (`MeshSlot.incarnation_of`); any other mesh's failure (trainer, buffer) is fatal;
  * the weight sync's failure callback (a member that failed its part of a push; None: the push);
  * a long-held `watch` call per generator, which returns the failure text when it breaks;
  * a slow probe (every PROBE_PERIOD_S with nothing else to do) for what reports nothing: a hung
    actor (no answer for PROC_HANG_FACTOR x generator.hang_timeout_s, each probe waiting at most that long; with
    hang_timeout_s=0, no answer within generator.health_timeout_s three times in a row) and, on one
    host, a dead proc. A hung engine inside a live actor is the actor's own to find (its liveness
    check, pipeline/generator/engine.py): it breaks and its watch reports it. Its answers are cached on the slot (`slot.stats`): the train loop's per-generator
    metrics read them instead of asking every generator at every step.
A report about an incarnation other than the slot's current one is stale and dropped. Every slot
is restarted by the same algorithm (`_restart`): count it against its budget (generator.max_restarts,
reward_model.max_restarts; past it the run ends), take it out, stop it (MeshSlot.stop), bring a new
incarnation back, record it in out_dir/faults.jsonl (kind "restart"). Only a member of the pool
is restarted: a generator that is joining or leaving it (pipeline/driver/pool.py) is the pool's, and
a generator added while the run goes on is watched, probed and budgeted like the first ones.
A restart runs in the background: the other
generators keep generating, and a restart that fails is a new failure of that slot.

Example:
    sup = Supervisor(cfg, fleet, wiring)
    loops = {asyncio.create_task(train()), asyncio.create_task(sup.run())}
    done, pending = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import monarch.actor

from pipeline import cleanup
from pipeline.config import Config
from pipeline.driver.calls import RunError
from pipeline.driver.fleet import Fleet, MeshSlot
from pipeline.generator.rewards import reject_rate_problem

log = logging.getLogger(__name__)

PROBE_PERIOD_S = 2.0
HUNG_AFTER = 3  # probe timeouts in a row
PROC_HANG_FACTOR = 5
"""A whole generator proc is hung once the health probe went unanswered for this many x
generator.hang_timeout_s (30 s by default). Looser than the engine's own progress bound: the probe is
an actor call answered by the proc's event loop, which a loaded machine starves. The probe does not
queue behind the generator's long endpoints (an eval, a stage end): those are serial endpoints,
actors/endpoints.py."""


class Supervisor:
    """See the module docstring. `wiring` is the per-kind part of a restart (RestartWiring:
    take_out / bring_back); `report` may be called from the loop's thread only (the fault hook hops
    threads with call_soon_threadsafe)."""

    def __init__(self, cfg: Config, fleet: Fleet, wiring: Any):
        self.cfg, self.fleet, self.wiring = cfg, fleet, wiring
        self.failures: asyncio.Queue = asyncio.Queue()  # (slot or None for fatal, incarnation, cause)
        self._restarting: dict[str, asyncio.Task] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self._slow: dict[str, int] = {}  # probe timeouts in a row, by slot name
        self._unanswered: dict[str, float] = {}  # when the first of those probes was sent, by slot name

    def budget(self, slot: MeshSlot) -> tuple[int, str]:
        if slot is self.fleet.reward_model:
            return self.cfg.reward_model.max_restarts, "reward_model.max_restarts"
        if slot is self.fleet.teacher:
            return self.cfg.teacher.max_restarts, "teacher.max_restarts"
        return self.cfg.generator.max_restarts, "generator.max_restarts"

    # ------------------------------------------------------------------ the queue's feeds

    def report(self, i: int | MeshSlot | None, cause: str | BaseException, incarnation: int | None = None) -> None:
        """A failure of generator i (or a slot; None: fatal) as of `incarnation` (default: its current one)."""
        slot = self.fleet.generators[i] if isinstance(i, int) else i
        inc = incarnation if incarnation is not None else slot.incarnation if slot is not None else 0
        self.failures.put_nowait((slot, inc, str(cause)))

    def install_fault_hook(self) -> None:
        """Monarch reports a dead mesh to the client's fault hook, whose default exits the process.
        A slot's failure is ours to handle (restart); any other mesh's failure ends the run."""
        loop = asyncio.get_running_loop()

        def hook(failure) -> None:
            if failure.mesh_name.startswith("logger-"):  # a dead proc's logger mesh goes with it
                return
            slot, inc = None, None
            for s in self.fleet.slots():
                if (inc := s.incarnation_of(failure.mesh_name)) is not None:
                    slot = s
                    break
            try:
                if slot is not None:
                    loop.call_soon_threadsafe(self.report, slot, failure.report(), inc)
                else:
                    loop.call_soon_threadsafe(self.report, None, failure.report())
            except RuntimeError:  # this run's loop is closed: a mesh of a run that has ended
                log.warning("a mesh failed after its run ended: %s", failure.report())

        monarch.actor.unhandled_fault_hook = hook

    def watch(self, slot: MeshSlot) -> None:
        """Hold a `watch` call on the slot's generator: it answers (the failure text) when it breaks."""
        inc, handle = slot.incarnation, slot.handle

        async def held() -> None:
            try:
                cause = await handle.watch.call_one()
            except Exception as e:  # its actor died: Monarch's fault hook says so too
                cause = f"{type(e).__name__}: {e}"
            self.report(slot, cause or "its watch call ended", inc)

        self.unwatch(slot)
        self._watches[slot.name] = asyncio.create_task(held(), name=f"watch-{slot.mesh_name}")

    def restarting(self, slot: MeshSlot) -> bool:
        return slot.name in self._restarting

    def unwatch(self, slot: MeshSlot) -> None:
        task = self._watches.pop(slot.name, None)
        if task is not None:
            task.cancel()

    async def probe(self) -> dict[MeshSlot, str]:
        """Ask every live slot for its stats (cached on the slot): a dead actor fails at once, a
        dead engine reports an error, a slow one times out (HUNG_AFTER in a row count as hung)."""
        g = self.cfg.generator
        t = min(g.health_timeout_s, g.hang_timeout_s) if g.hang_timeout_s > 0 else g.health_timeout_s
        now = time.monotonic()
        failed, asked = {}, []
        for slot in self.fleet.slots():
            if not slot.live:
                continue
            if (why := slot.proc_dead()) is not None:
                failed[slot] = why
            else:
                asked.append(slot)
        async def timed(slot: MeshSlot) -> dict:
            t0 = time.monotonic()
            try:
                return await asyncio.wait_for(slot.handle.stats.call_one(), t)
            finally:
                slot.probe_max_s = max(slot.probe_max_s, time.monotonic() - t0)

        res = await asyncio.gather(*[timed(s) for s in asked], return_exceptions=True)
        for slot, r in zip(asked, res):
            if isinstance(r, asyncio.TimeoutError):
                self._slow[slot.name] = self._slow.get(slot.name, 0) + 1
                since = self._unanswered.setdefault(slot.name, now)
                if g.hang_timeout_s > 0 and time.monotonic() - since >= PROC_HANG_FACTOR * g.hang_timeout_s:
                    failed[slot] = (f"hung: its proc left the health probe unanswered for "
                                    f"{time.monotonic() - since:.1f}s ({PROC_HANG_FACTOR} x generator.hang_timeout_s)")
                elif g.hang_timeout_s <= 0 and self._slow[slot.name] >= HUNG_AFTER:
                    failed[slot] = f"no health answer within {t:.0f}s three times in a row (generator.health_timeout_s)"
                continue
            self._slow.pop(slot.name, None)
            self._unanswered.pop(slot.name, None)
            if isinstance(r, BaseException):
                failed[slot] = f"{type(r).__name__}: {r}"
                continue
            slot.stats = r
            if r.get("error"):
                failed[slot] = r["error"]
            elif not self.fleet.is_side(slot) and (
                    why := reject_rate_problem(r, self.cfg.task.max_reject_frac)) is not None:
                raise RunError(f"{slot.label}: {why}")  # the task's fault: a restart would not help
        return failed

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Runs beside the train loop until cancelled; raises RunError on a fatal failure or a slot
        past its restart budget."""
        for _, slot in self.fleet.live_generators():
            self.watch(slot)
        try:
            while True:
                try:
                    slot, inc, cause = await asyncio.wait_for(self.failures.get(), PROBE_PERIOD_S)
                    failed = [(slot, inc, cause)]
                except asyncio.TimeoutError:
                    failed = [(s, s.incarnation, c) for s, c in (await self.probe()).items()]
                for slot, inc, cause in failed:
                    if slot is None:
                        await asyncio.sleep(0.5)  # a killed proc's segments are unmapped once it is reaped
                        if gone := cleanup.sweep_dead_weight_sync():
                            log.warning("removed the weight-sync segments the failed mesh left: %s", " ".join(gone))
                        raise RunError(f"a trainer or buffer mesh failed: {cause}")
                    if inc == slot.incarnation and slot.name not in self._restarting and slot.membership == "member":
                        self._start_restart(slot, cause)  # a joining or leaving generator is the pool's
        finally:
            tasks = [*self._restarting.values(), *self._watches.values()]
            self._restarting.clear()
            self._watches.clear()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_restart(self, slot: MeshSlot, cause: str) -> None:
        limit, key = self.budget(slot)
        if slot.incarnation >= limit:
            raise RunError(f"{slot.label} failed and has used its {limit} restarts ({key}): {cause}")
        self._slow.pop(slot.name, None)
        self._unanswered.pop(slot.name, None)
        slot.incarnation += 1  # from here on, reports about the old incarnation are stale
        task = asyncio.create_task(self._restart(slot, cause), name=f"restart-{slot.name}")
        self._restarting[slot.name] = task

        def done(t: asyncio.Task) -> None:
            if self._restarting.get(slot.name) is t:
                del self._restarting[slot.name]
            if not t.cancelled() and t.exception() is not None:  # try again, within the budget
                self.report(slot, f"restart failed: {t.exception()}")

        task.add_done_callback(done)

    async def _restart(self, slot: MeshSlot, cause: str) -> None:
        """The one restart algorithm: see the module docstring."""
        detected, t0 = time.time(), time.monotonic()
        log.warning("%s failed (%s); restart %d of %d", slot.label, cause[:300], slot.incarnation,
                    self.budget(slot)[0])
        self.unwatch(slot)
        out = await self.wiring.take_out(slot)
        await slot.stop()
        out |= await self.wiring.bring_back(slot)
        if not self.fleet.is_side(slot):
            self.watch(slot)
        key = {slot.name: True} if self.fleet.is_side(slot) else {"generator": self.fleet.generators.index(slot)}
        event = {"kind": "restart", **key, "restart": slot.incarnation, "cause": cause[:500], "detected_at": detected,
                 "recovered_at": time.time(), "recovery_s": time.monotonic() - t0, **out}
        with open(Path(self.cfg.run.out_dir) / "faults.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        if "version" in out:
            log.warning("%s back in %.1fs at version %d (%d groups requeued)", slot.label, event["recovery_s"],
                        out["version"], out["requeued_groups"])
        else:
            log.warning("%s back in %.1fs", slot.label, event["recovery_s"])
