"""ReplayBufferActor: the Monarch face of pipeline.buffer.ReplayBufferCore plus the prompt source.

Protocol (generators pull work and push samples; the trainer pulls batches):

    buf = procs.spawn("buffer", ReplayBufferActor, cfg, pad)   # pad: the checkpoint's (Job.special.pad)
    info = await buf.setup.call_one()                # first: its placement (buffer.cpus) -> apply()'s report
    group = await buf.admit.call_one(0.5, (g, k))    # PromptGroup leased to generator g, incarnation k
    n = await buf.release_generator.call_one((g, k)) # it died: its groups are requeued
    await buf.add.call_one(rollout)                  # raises (ActorError) on a bad rollout
    await buf.release.call_one(group_id)             # a generator gave up on a group
    batch = await buf.get_batch.call_one(v, 60.0)    # waits for B complete groups at version v;
                                                     # None: end of data (below)
    await buf.skip_batch.call_one(batch.group_ids)   # the trainer skipped its step: groups dropped
    stats = await buf.finish_step.call_one(v + 1, mean_reward)   # new version, Δ update -> stats()
    stats = await buf.stats.call_one()
    await buf.set_zero_signal.call_one("drop")       # buffer.zero_signal=auto: dynamic sampling on from now

`get_batch` and `admit(wait_s > 0)` are concurrent endpoints that wait on one asyncio.Condition,
so `add` and `finish_step` keep being served while they wait; every state change notifies it.
The prompt is drawn from the stream only once admission is granted, so the stream position in
state_dict() is exactly the prompts handed out.

End of data: with run.epochs > 0 the stream of a finite task ends. From then on admit hands out only
requeued groups (a dead generator's), and get_batch returns None once nothing is in flight and the
complete groups left are fewer than a batch: every full batch the admitted prompts make is trained,
the remainder (under B groups, logged) is not, like a data loader's drop_last. A group dropped as
stale has its prompt admitted again before new ones (buffer.retry_stale), so the stream counts as
ended only once no retry waits; groups dropped as zero signal or failed are not generated again. stats() and finish_step() report the stream position
as `data_epoch` (epochs drawn, fractional once the epoch length is known).

Difficulty filter: the one stream serves every generator and every finished group reaches this
actor, so the filter (core.difficulty, pipeline/difficulty.py) is central: a prompt drawn is admitted
only if the filter lets it through, else the next is drawn (set-aside prompts are passed over, so an
epoch is still one pass over every prompt; the filter bounds the skips in a row, so a draw never spins).
"""

from __future__ import annotations

import asyncio
import logging
import time

from monarch.actor import concurrent_endpoint, endpoint

from actors.base import PipelineActor
from actors.endpoints import reply_droppable
from pipeline.advantages import overlong_shaping
from pipeline.buffer import ReplayBufferCore
from pipeline.config import Config
from pipeline.placement import apply, buffer_placement
from pipeline.tasks import PromptStream, load_task
from pipeline.types import Batch, PromptGroup, Rollout

__all__ = ["ReplayBufferActor"]

log = logging.getLogger(__name__)


class ReplayBufferActor(PipelineActor):
    def __init__(self, cfg: Config, pad_id: int):
        super().__init__(cfg.run.log_level)
        self.cfg = cfg
        task = load_task(cfg.task.name, cfg.task)
        self.core = ReplayBufferCore(cfg.buffer, pad_id, overlong_shaping(cfg, multi_turn=task.env is not None))
        self.prompts = PromptStream(task, cfg.task.seed, epochs=cfg.run.epochs)
        self.exhausted = False  # the stream ended (run.epochs): no new prompts
        self.changed = asyncio.Condition()

    @endpoint
    async def setup(self) -> dict:
        """Pin this proc to buffer.cpus (pipeline/placement.py); returns what it runs on."""
        return apply(buffer_placement(self.cfg))

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _has_work(self) -> bool:
        return self.core.has_requeued() or (self.core.can_admit() and (self.core.has_retry() or not self.exhausted))

    def _end_of_data(self) -> bool:
        """No batch can come any more: the stream ended, nothing is in flight or waiting to be
        retried, and fewer than B are complete."""
        return (self.exhausted and self.core.in_flight_groups == 0 and not self.core.has_retry()
                and not self.core.ready())

    def _stats(self) -> dict:
        return {**self.core.stats(), "data_epoch": self.prompts.progress(), "data_exhausted": self.exhausted}

    @reply_droppable(concurrent=True)  # a generator stopped while it waits: its reply is dropped
    async def admit(self, wait_s: float = 0.0, lessee: tuple[int, int] = (0, 0)) -> PromptGroup | None:
        """Next prompt group for `lessee` = (generator id, incarnation) (a requeued group first), or
        None if admission stays closed for `wait_s` seconds or the lessee was released meanwhile."""
        if not self._has_work() and wait_s > 0:
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait_for(self._has_work), wait_s)
                except asyncio.TimeoutError:
                    return None
        if self.core.revoked(lessee):
            return None
        if self.core.has_requeued():
            return self.core.take_requeued(lessee)
        if not self.core.can_admit():
            return None
        if self.core.has_retry():  # a prompt whose group went stale comes before new ones
            return self.core.admit_retry(lessee)
        if self.exhausted:
            return None
        item = self.core.difficulty.draw(self.prompts, self.core.version)
        if item is None:
            self.exhausted = True
            log.info("buffer: the prompt stream ended after %g epochs (run.epochs); %d groups in flight, %d complete",
                     self.prompts.progress(), self.core.in_flight_groups, self.core.stats()["complete_groups"])
            await self._notify()  # a get_batch waiting for the end of data
            return None
        return self.core.admit(item, lessee)

    @endpoint
    async def release_generator(self, lessee: tuple[int, int]) -> int:
        """The generator incarnation `lessee` died: its in-flight groups are generated again; how many."""
        n = self.core.release_generator(lessee)
        await self._notify()
        return n

    @reply_droppable
    async def add(self, rollout: Rollout, lessee: tuple[int, int] | None = None) -> None:
        self.core.add(rollout, lessee)
        await self._notify()

    @reply_droppable
    async def release(self, group_id: int, lessee: tuple[int, int] | None = None) -> bool:
        released = self.core.release(group_id, lessee)
        await self._notify()
        return released

    @concurrent_endpoint
    async def get_batch(self, trainer_version: int, timeout_s: float | None = None) -> Batch | None:
        """The next B groups for `trainer_version`, or None at the end of data (module docstring);
        TimeoutError after `timeout_s` (default buffer.batch_timeout_s) naming how far the buffer got."""
        timeout_s = self.cfg.buffer.batch_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        async with self.changed:
            self.core.set_trainer_version(trainer_version)
            self.changed.notify_all()  # the version bump may have freed admission slots
            try:
                await asyncio.wait_for(self.changed.wait_for(lambda: self.core.ready() or self._end_of_data()),
                                       timeout_s)
            except asyncio.TimeoutError:
                s = self.core.stats()
                raise TimeoutError(
                    f"replay buffer: no batch for version {trainer_version} after {timeout_s:.1f}s: "
                    f"{s['complete_groups']} of {self.cfg.buffer.batch_groups} groups ready, "
                    f"{s['in_flight_groups']} in flight, admission limit {s['admission_limit']}, "
                    f"dropped {s['dropped_groups']}") from None
            if not self.core.ready():
                left = self.core.stats()["complete_groups"]
                (log.warning if left else log.info)(
                    "buffer: end of data at version %d: %d complete groups, fewer than a batch of %d, are not "
                    "trained", trainer_version, left, self.cfg.buffer.batch_groups)
                return None
            batch = self.core.take_batch()
            self.core.record_wait(time.monotonic() - t0)
            self.changed.notify_all()  # taking B groups opens admission
        return batch

    @endpoint
    async def skip_batch(self, group_ids: tuple[int, ...]) -> int:
        """The trainer skipped the step of the last batch (its version did not advance): its groups
        are booked as dropped ("skipped_step"), which opens their admission slots again."""
        n = self.core.skip_batch(group_ids)
        await self._notify()
        return n

    @endpoint
    async def finish_step(self, version: int, mean_reward: float) -> dict:
        """The trainer reached `version` (stale groups drop, admission for it opens) and the step's
        mean reward moves Δ; returns stats(). One call per step."""
        self.core.set_trainer_version(version)
        self.core.end_step(mean_reward)
        await self._notify()
        return self._stats()

    @endpoint
    async def stats(self) -> dict:
        return self._stats()

    @endpoint
    async def set_zero_signal(self, mode: str) -> str:
        """Dynamic sampling on ("drop") or off ("keep") for groups that finish from now on
        (buffer.zero_signal=auto, ReplayBufferCore.set_zero_signal; raises on a mode the config
        does not allow); returns the mode now in force."""
        self.core.set_zero_signal(mode)
        return self.core.zero_signal_mode

    @endpoint
    async def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict(), "buffer": self.core.state_dict()}

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.core.load_state_dict(state["buffer"])
        self.prompts.load_state_dict(state["prompts"])
        await self._notify()
