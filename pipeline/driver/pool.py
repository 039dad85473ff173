"""Pool: the generators of a run grow and shrink while it goes on, by the machinery a restart uses.

    pool = Pool(job)                          # job.pool (pipeline/driver/job.py)
    await pool.add(2)                         # -> [2, 3]: two generators joined on the trainer's weights
    await pool.remove(1)                      # -> its event: drained (or aborted), groups requeued, stopped
    pool.status()                             # every generator: state, incarnation, version, host, pid

Add, per generator (RestartWiring.bring_back's path, on a new slot): a MeshSlot with the next index
(an index is never reused, so lessees, reward-model stream ids, placement.json and faults.jsonl name
one generator each) on the host `join_host` picks, with the first share of generator.cpus /
generator.devices no member holds (`join_placement`). The trainer exports its weights and the
generator starts serving them as their version, with the side meshes (Fleet.spawn_generator); with
weight_sync.verify on, what its engine serves is checked bit for bit against the export before it
takes a request. It starts generating (if the run is generating) and, once its first tokens came
back (the version they carry is recorded: the spawned one, as no push reaches it before it joins the
push group), joins the push group at the next push boundary (WeightSync.rejoin); in a supervised run
it is watched. Only then is it a member: the supervisor restarts, probes and budgets it like the
first ones (Supervisor restarts members only). A generator that fails to join is stopped, its groups
requeued, and the add raises.

Remove, generator i: refused (PoolError) for an index that is not a member, one being restarted, or
the last member. Otherwise it leaves the push group at the next push boundary (WeightSync.leave),
then leaves by generator.on_update: keep and drain stop its admission and let its requests in flight
finish and be sent (bounded by generator.request_timeout_s; a push's keep cannot carry a request to
another engine, so keep drains too), abort stops at once; the buffer requeues the groups still leased
to it (release_generator: whole, before any new prompt), and its slot stops (MeshSlot.stop). Nothing
counts as a failure: its restart budget is untouched.

Both write an event to out_dir/faults.jsonl (kind "added" / "removed", beside the supervisor's
"restart"). Admission needs nothing: the buffer's bounds ((η + v + 1)·B and B + Δ) count groups, not
generators, and every generator pulls work (admit) as it frees a slot, so the pool's size changes
only how fast the groups come. Pool operations run one at a time (a lock), beside the train loop.

Example:
    job = Job(cfg, supervised=True); await job.start(); await job.start_generation()
    new = await job.add_generators(1)
    await job.remove_generator(new[0])
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError
from pipeline.driver.calls import RunError, call_within
from pipeline.driver.fleet import MeshSlot
from pipeline.placement import Placement, generator_placements
from pipeline.weightsync.checksum import Checksum, of_tensor
from pipeline.weightsync.verify import check

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.2  # the generator has no drain endpoint; its stats answer at once


class PoolError(RunError):
    """A pool change that cannot be made (the message says why); the run goes on."""


def join_host(fleet: Any) -> int:
    """The host of a generator that joins: the generator host with the fewest generators (one host:
    host 0). The one place that decides it, so a per-role host layout adapts it here."""
    if fleet.roles is None:  # (roles: pipeline/cluster/roles.py)
        return 0
    return fleet.roles.add_generator([s.host for s in fleet.generators if s.membership in ("member", "joining")])


def join_placement(cfg: Any, fleet: Any, i: int, host: int) -> Placement:
    """Generator i's placement on `host`: the first share k (of generator.cpus / generator.devices,
    split as pipeline/placement.py splits them, as if the host ran max(its generators at start, k + 1)
    generators) that shares no core or GPU with a member on that host. ConfigError when none does."""
    used = {x for j, s in fleet.active_generators() if s.host == host and j < len(fleet.placements)
            for x in fleet.placements[j].gpus or fleet.placements[j].cpus}
    at_start = sum(1 for j in range(cfg.generator.num_generators) if fleet.generators[j].host == host)
    mesh = fleet.host_mesh
    hosts = mesh.sizes.get("hosts", 1) if mesh is not None else 1
    apart = fleet.roles is not None and fleet.roles.apart  # no trainer rank on the generators' hosts
    per_host = 0 if apart else cfg.trainer.num_ranks // hosts
    k = 0
    while True:
        try:
            p = generator_placements(cfg, [host] * max(at_start, k + 1), per_host)[k]
        except ConfigError:
            raise ConfigError(f"config: generator{i} cannot join host {host}: no share of generator.cpus="
                              f"{cfg.generator.cpus!r} / generator.devices={cfg.generator.devices!r} is free of "
                              "the other generators' (remove one first, or give them more)") from None
        if not used.intersection(p.gpus or p.cpus):
            return dataclasses.replace(p, role=f"generator{i}")
        k += 1


def export_checksums(path: Path) -> dict[str, Checksum]:
    """The checksum of every tensor of an HF export (what a joining generator must serve)."""
    from safetensors.torch import load_file

    out: dict[str, Checksum] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: of_tensor(v) for k, v in load_file(str(f)).items()})
    return out


class Pool:
    """See the module docstring. `job`: the Job (trainer, buffer, fleet, sync, supervisor)."""

    def __init__(self, job: Any):
        self.job = job
        self._lock = asyncio.Lock()

    def members(self) -> list[int]:
        return [i for i, _ in self.job.fleet.active_generators()]

    def status(self) -> dict:
        """The pool as the control command shows it."""
        job = self.job
        gens = {}
        for i, s in enumerate(job.fleet.generators):
            if s.membership == "removed":
                continue
            state = "restarting" if s.membership == "member" and job.supervisor.restarting(s) else s.membership
            gens[f"generator{i}"] = {"state": state, "live": s.live, "incarnation": s.incarnation, "host": s.host,
                                     "version": job.sync.served.get(i, s.version) if job.sync else s.version,
                                     "pid": s.pids[0][0] if s.pids else None}
        return {"members": len(self.members()), "trainer_version": job.version, "generators": gens}

    def _event(self, event: dict) -> None:
        out = Path(self.job.cfg.run.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "faults.jsonl", "a") as f:
            f.write(json.dumps({**event, "at": time.time()}) + "\n")

    # ------------------------------------------------------------------ add

    async def add(self, n: int) -> list[int]:
        """n generators join (concurrently); their indices once all are members."""
        if n < 1:
            raise PoolError(f"add_generators: n={n}; allowed: n >= 1")
        job = self.job
        if not job.supervised and job.version > job.sync.pushed:  # a Session pushes by hand
            raise PoolError(f"add_generators: the trainer's version {job.version} is not pushed yet (the last "
                            f"push was version {job.sync.pushed}): push it first (Session.sync()), so that a "
                            "generator that starts on it is not sent it again")
        async with self._lock:
            fleet, cfg = job.fleet, job.cfg
            new = []
            for _ in range(n):
                h = join_host(fleet)
                new.append(fleet.new_generator(h, join_placement(cfg, fleet, len(fleet.generators), h)))
            res = await asyncio.gather(*[self._join(i) for i in new], return_exceptions=True)
            bad = [(i, r) for i, r in zip(new, res) if isinstance(r, BaseException)]
            if bad:
                raise PoolError("; ".join(f"generator{i} could not join: {type(r).__name__}: {r}" for i, r in bad))
            return new

    async def _join(self, i: int) -> None:
        job = self.job
        slot = job.fleet.generators[i]
        t0 = time.monotonic()
        path = Path(job.cfg.run.out_dir) / "respawn" / slot.name
        try:
            version = await job.trainer.export_hf(str(path))
            gen = await job.fleet.spawn_generator(i, str(path), version)
            verified = await self._verify(i, gen, path, version)
            first = None
            if job.generating:
                await call_within(f"generator{i}.start_generation", gen.start_generation.call_one(job.buffer))
                if job.supervised:  # a Session may hold admission closed (nobody trains): no wait there
                    first = await self._first_tokens(i, gen)
            await self._pushed(version)
            await job.sync.rejoin(i, gen)  # live from here on
        except BaseException as e:
            await self._drop(slot, i)
            self._event({"kind": "add_failed", "generator": i, "cause": f"{type(e).__name__}: {e}"[:500]})
            raise
        finally:
            shutil.rmtree(path, ignore_errors=True)
        slot.membership = "member"
        if job.supervised:
            job.supervisor.watch(slot)
        event = {"kind": "added", "generator": i, "host": slot.host, "version": version, "verified": verified,
                 "first_token_version": first,
                 "pid": slot.pids[0][0] if slot.pids else None, "join_s": time.monotonic() - t0,
                 "members": len(self.members())}
        self._event(event)
        log.warning("generator%d joined on host %d serving version %d%s in %.1fs; %d generators", i, slot.host,
                    version, " (verified)" if verified else "", event["join_s"], event["members"])

    async def _pushed(self, version: int) -> None:
        """Wait (generator.start_timeout_s) until the push of `version` has started: the export may
        catch the trainer between its step and that push, and a receiver refuses a version it has."""
        bound = self.job.cfg.generator.start_timeout_s
        deadline = time.monotonic() + bound
        while self.job.sync.pushed < version:
            if time.monotonic() > deadline:
                raise PoolError(f"the push of version {version} did not start within {bound:.0f}s "
                                "(generator.start_timeout_s)")
            await asyncio.sleep(DRAIN_POLL_S)

    async def _first_tokens(self, i: int, gen: Any) -> int | None:
        """The version its first tokens carry, once it returned some (no push reaches it before it
        rejoins, so that is the version it was spawned on); None if none came within
        generator.request_timeout_s (admission closed meanwhile): it joins the pushes all the same."""
        g = self.job.cfg.generator
        deadline = time.monotonic() + g.request_timeout_s
        while time.monotonic() < deadline:
            stats = await call_within(f"generator{i}.stats", gen.stats.call_one(), g.health_timeout_s)
            if stats.get("first_token_version") is not None:
                return stats["first_token_version"]
            await asyncio.sleep(DRAIN_POLL_S)
        return None

    async def _verify(self, i: int, gen: Any, path: Path, version: int) -> bool:
        """With weight_sync.verify on (and no LoRA, whose export is not what the engine serves whole):
        what generator i serves against the export it started on, bit for bit; SyncError-like
        VerifyError naming the tensors if not."""
        cfg = self.job.cfg
        if not cfg.weight_sync.verify_every or cfg.trainer.lora.rank:
            return False
        ref = await asyncio.to_thread(export_checksums, path)
        tensors, parts = await call_within(f"generator{i}.served_checksums", gen.served_checksums.call_one(),
                                           cfg.weight_sync.timeout_s)
        check(ref, ({k: Checksum.from_wire(v) for k, v in tensors.items()}, parts), i, version)
        return True

    # ------------------------------------------------------------------ remove

    async def remove(self, i: int) -> dict:
        """Generator i leaves the pool (module docstring); returns its "removed" event."""
        async with self._lock:
            job = self.job
            gens = job.fleet.generators
            if not 0 <= i < len(gens) or gens[i].membership != "member":
                raise PoolError(f"remove_generator: generator{i} is not in the pool (members: "
                                f"{', '.join(f'generator{j}' for j in self.members())})")
            slot = gens[i]
            if job.supervisor.restarting(slot):
                raise PoolError(f"remove_generator: generator{i} is being restarted; try again once it is back")
            if len(self.members()) == 1:
                raise PoolError(f"remove_generator: generator{i} is the last generator of the run; a run needs one")
            t0 = time.monotonic()
            slot.membership = "leaving"  # from here on its failures are not the supervisor's
            job.supervisor.unwatch(slot)
            await job.sync.leave(i)
            mode = job.cfg.generator.on_update
            drained = stats = None
            if mode in ("keep", "drain") and slot.handle is not None:
                drained, stats = await self._drain(i, slot)
            requeued = await self._drop(slot, i)
            stats = stats or slot.stats or {}
            event = {"kind": "removed", "generator": i, "mode": mode, "drained": drained, "requeued_groups": requeued,
                     "tokens": stats.get("tokens"), "rollouts": stats.get("rollouts"),
                     "first_token_version": stats.get("first_token_version"), "version": stats.get("version"),
                     "leave_s": time.monotonic() - t0, "members": len(self.members())}
            self._event(event)
            log.warning("generator%d left the pool (%s: %s, %d groups requeued) in %.1fs; %d generators", i, mode,
                        "drained" if drained else "aborted" if drained is None else "drain cut short", requeued,
                        event["leave_s"], event["members"])
            return event

    async def _drain(self, i: int, slot: MeshSlot) -> tuple[bool, dict | None]:
        """Stop its admission and wait (generator.request_timeout_s) until nothing is in flight or
        being sent; (drained in time, its last stats)."""
        g = self.job.cfg.generator
        deadline = time.monotonic() + g.request_timeout_s
        stats = None
        try:
            await call_within(f"generator{i}.end_stage", slot.handle.end_stage.call_one("keep"), g.request_timeout_s)
            while time.monotonic() < deadline:
                stats = await call_within(f"generator{i}.stats", slot.handle.stats.call_one(), g.health_timeout_s)
                if not stats["in_flight"] and not stats["sending"]:
                    return True, stats
                await asyncio.sleep(DRAIN_POLL_S)
        except Exception as e:  # a leaving generator that breaks is stopped all the same
            log.warning("generator%d: drain failed (%s); stopping it", i, e)
        return False, stats

    async def _drop(self, slot: MeshSlot, i: int) -> int:
        """Out of the push group, its leased groups requeued, stopped, out of placement.json; the
        number of groups requeued."""
        job = self.job
        job.sync.detach(i)
        requeued = 0
        try:
            requeued = await call_within("buffer.release_generator",
                                         job.buffer.release_generator.call_one((i, slot.incarnation)))
        finally:
            job.requeued_groups += requeued
            await slot.stop()
            job.fleet.forget(slot)
        return requeued
