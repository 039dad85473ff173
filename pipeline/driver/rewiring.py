"""What a restart does around a slot, per kind: the Supervisor's one algorithm calls `take_out`
before it stops the slot and `bring_back` after; each returns the fields it adds to faults.jsonl.

    wiring = RestartWiring(job)
    out = await wiring.take_out(slot)        # generator: out of the push group, its leased groups requeued
    await slot.stop()
    out |= await wiring.bring_back(slot)     # generator: respawned on the trainer's latest weights
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path
from typing import Any

from actors.generator import stream_prefix
from pipeline.driver.calls import call_within
from pipeline.driver.fleet import MeshSlot


class RestartWiring:
    """Contract, generator i (incarnation k failed, k+1 comes):
      take_out    WeightSync.detach(i) (a push in flight ignores it), then the buffer requeues the
                  groups leased to (i, k)                              -> requeued_groups
      bring_back  the trainer exports its weights, generator i starts on them as their version,
                  joins the weight sync at the next push boundary (WeightSync.rejoin, which makes it
                  live), drops (i, k)'s reward-model streams, is handed the current reward model and
                  starts generating                                     -> version
    The reward model: take_out does nothing (its handle goes with MeshSlot.stop; the generators'
    scores in flight wait for the successor within reward_model.timeout_s and are then sent whole);
    bring_back spawns it and hands it to every live generator (one that fails to take it is reported
    as failed).

    Example:
        sup = Supervisor(cfg, job.fleet, RestartWiring(job))
    """

    def __init__(self, job: Any):
        self.job = job

    async def take_out(self, slot: MeshSlot) -> dict:
        job = self.job
        if job.fleet.is_side(slot):
            slot.live = False  # no generator spawned meanwhile is handed it
            return {}
        i = job.fleet.generators.index(slot)
        job.sync.detach(i)  # which takes it out of the live handles (and of a collective group)
        requeued = await call_within("buffer.release_generator",
                                     job.buffer.release_generator.call_one((i, slot.incarnation - 1)))
        job.requeued_groups += requeued
        return {"requeued_groups": requeued}

    async def bring_back(self, slot: MeshSlot) -> dict:
        job = self.job
        if job.fleet.is_side(slot):
            h = await job.fleet.spawn_side(slot)
            live = job.fleet.live_generators()
            name = job.fleet.attach_call(slot)
            res = await asyncio.gather(*[asyncio.wait_for(getattr(s.handle, name).call_one(h), 60)
                                         for _, s in live], return_exceptions=True)
            for (i, s), inc, r in zip(live, [s.incarnation for _, s in live], res):
                if isinstance(r, BaseException):
                    job.supervisor.report(i, f"attaching the restarted {slot.label} failed: {r}", inc)
            return {}
        i = job.fleet.generators.index(slot)
        path = Path(job.cfg.run.out_dir) / "respawn" / slot.name
        version = await job.trainer.export_hf(str(path))
        gen = await job.fleet.spawn_generator(i, str(path), version)
        await job.sync.rejoin(i, gen)
        for side in job.fleet.sides():  # the predecessor's streams go; this one uses the current side meshes
            h = job.fleet.side_handle(side)
            if h is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(h.release_prefix.call_one(stream_prefix(i, slot.incarnation - 1)), 10)
        await job.fleet.attach_sides(i, gen)
        await call_within(f"generator{i}.start_generation", gen.start_generation.call_one(job.buffer))
        shutil.rmtree(path, ignore_errors=True)
        return {"version": version}
