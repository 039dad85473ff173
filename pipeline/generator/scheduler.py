"""StageScheduler: keeps N' (generator.concurrency) trajectories in flight during a stage (CoPRIS).

States (`state`):
    IDLE     no stage: never begun, or ended with carry_over=keep (in-flight trajectories run to
             their end and are sent; nothing new starts)
    RUNNING  a stage: the admission loop keeps up to N' groups' samples admitted ahead (`pending`),
             and every freed slot starts the next trajectory at once, carried partials first
    SAVED    ended with carry_over=save: in-flight requests are aborted and every trajectory
             returns as a partial (`carried`: tokens, logprobs, versions, environment), resumed
             first by the next stage
Transitions: begin: IDLE|SAVED -> RUNNING; end(keep): RUNNING -> IDLE; end(save): RUNNING -> SAVED.
A stage begins only when someone calls `begin` (the facade, GeneratorCore); nothing here starts one.

Contract:
  * A slot is taken in `_start` and freed in exactly one place, `_free`, when the trajectory's
    generation ends however it ends (finished, saved, failed, cancelled); `_free` starts the next one
    before anything awaits, so the in-flight count stays at N' while work remains, even when a whole
    wave finishes together. Rewarding and sending happen after the slot is freed.
  * Nothing sleeps: the admission loop waits on an event (`_wake`) set when a slot frees or the
    pending queue runs low, and `end(save)` waits on another (`_empty`) set when the last slot frees.
  * `end` is bounded by its timeout (the admission loop's last call, then the aborted requests'
    return); a failed or late end trips the generator's Fault.
  * Groups given back at the source (Episodes.dead) are skipped when their samples come up.

Example:
    sched = StageScheduler(cfg.generator, 0, engine, episodes, stats, fault)
    sched.begin(source)                          # N' in flight from source.admit()
    info = await sched.end("save", timeout_s)    # {"carried": 3, "running": 0, "pending": 4}
    sched.begin(source)                          # the 3 partials resume first
    await sched.end("keep", timeout_s)           # the in-flight ones finish and are sent
    await sched.close()
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque

from pipeline.config import GeneratorConfig
from pipeline.generator.engine import Engine, Fault
from pipeline.generator.episode import SAVED, Episodes
from pipeline.generator.rewards import RolloutStats
from pipeline.generator.trajectory import RequestError, Trajectory, WorkSource

__all__ = ["StageScheduler", "StageState"]


class StageState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    SAVED = "saved"


class StageScheduler:
    """See the module docstring. `source` is the current (or last) stage's work source."""

    def __init__(self, g: GeneratorConfig, generator_id: int, engine: Engine, episodes: Episodes,
                 stats: RolloutStats, fault: Fault):
        self.g, self.gid, self.engine, self.episodes = g, generator_id, engine, episodes
        self.stats, self.fault = stats, fault
        self.state = StageState.IDLE
        self.source: WorkSource | None = None
        self.active: dict[str, Trajectory] = {}  # holding a slot: in the engine, at the gate, in an environment
        self.pending: deque[Trajectory] = deque()  # admitted samples not started yet
        self.carried: deque[Trajectory] = deque()  # partials saved at a stage end; resumed first
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()  # the admission loop: fetch a group, or stop
        self._empty = asyncio.Event()  # no slot held
        self._empty.set()
        self._loop_task: asyncio.Task | None = None
        fault.on_trip(self._wake.set)  # a broken generator admits nothing more

    @property
    def running(self) -> bool:
        return self.state is StageState.RUNNING

    @property
    def saving(self) -> bool:
        return self.state is StageState.SAVED

    def counts(self) -> dict:
        return {"carried": len(self.carried), "running": len(self.active), "pending": len(self.pending)}

    def begin(self, source: WorkSource) -> None:
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError(f"generator {self.gid}: a stage is already running; call end_stage first")
        self.source, self.state = source, StageState.RUNNING
        self._loop_task = asyncio.create_task(self._admit_loop())

    async def end(self, carry_over: str, timeout_s: float) -> dict:
        """End the running stage: admit nothing more; with carry_over=save, cut every trajectory in
        flight into a partial and return once none holds a slot."""
        if carry_over not in ("keep", "save"):
            raise ValueError(f"end_stage: carry_over={carry_over!r}; allowed: 'keep', 'save'")
        # save: every trajectory returns SAVED at its next gate passage, and the requests in the engine
        # are cut at once, not after the admission loop's last call (up to generator.admit_wait_s, in
        # which short requests would finish and leave nothing to carry)
        self.state = StageState.SAVED if carry_over == "save" else StageState.IDLE
        self._wake.set()
        try:
            if carry_over == "save" and self.active:
                await self.engine.abort_requests()
            if self._loop_task is not None:
                await asyncio.wait_for(asyncio.shield(self._loop_task), timeout_s)
            if carry_over == "save":
                try:
                    await asyncio.wait_for(self._empty.wait(), timeout_s)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"generator {self.gid}: {len(self.active)} requests did not stop "
                                       f"within {timeout_s:.0f}s of end_stage") from None
        except Exception as e:  # a generator left idle and not broken would never be noticed
            self.fault.trip(RuntimeError(f"end_stage failed: {type(e).__name__}: {e}"))
            raise
        return self.counts()

    async def _admit_loop(self) -> None:
        """Keep up to N' samples admitted ahead, so a finished request is replaced at once (no await
        between a finish and the next submission)."""
        try:
            while self.running and not self.fault.tripped:
                self._refill()
                if len(self.pending) >= self.g.concurrency or self.carried:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                group = await self.source.admit(self.g.admit_wait_s)
                if group is None:
                    continue
                self.stats.groups += 1
                try:
                    self.pending.extend(self.episodes.trajectories(group))
                except RequestError as e:  # a bad prompt fails its group alone
                    await self.episodes.fail_group(group.group_id, e, f"group {group.group_id}", self)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.fault.trip(RuntimeError(f"admission loop failed: {type(e).__name__}: {e}"))

    def _refill(self) -> None:
        while self.running and len(self.active) < self.g.concurrency:
            queue = self.carried or self.pending
            if not queue:
                break
            traj = queue.popleft()
            if not self.episodes.dead(traj.group.group_id):
                self._start(traj)
        if len(self.pending) < self.g.concurrency:
            self._wake.set()  # the admission loop fetches the next group

    def _start(self, traj: Trajectory) -> None:
        if not self.active:
            self.stats.running(True)
            self._empty.clear()
        self.active[traj.key] = traj
        task = asyncio.create_task(self._drive(traj))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _free(self, traj: Trajectory) -> None:
        """The one place a slot is freed; the next trajectory starts here."""
        del self.active[traj.key]
        if not self.active:
            self.stats.running(False)
            self._empty.set()
        self._refill()

    async def _drive(self, traj: Trajectory) -> None:
        """One trajectory in its slot; then, the slot freed, carry it over or send it."""
        finish = None
        try:
            try:
                finish = await self.episodes.generate(traj, self)
            finally:
                self._free(traj)
            if finish == SAVED:
                self.carried.append(traj)
                self.stats.carried_samples += 1
                self.stats.carried_tokens += len(traj.tokens)
            else:
                await self.episodes.deliver(traj, finish, self)  # settles its own faults
        except Exception as e:  # from generate: a bad request, a failed environment, or worse
            await self.episodes.failed(traj, e, self)
        finally:
            self.episodes.forget(traj)
            if finish != SAVED and traj.env is not None:  # its episode is over (a carried one goes on)
                await self.episodes.close_env(traj)

    async def close(self) -> None:
        """Stop admitting and cancel every trajectory and the admission loop (shutdown)."""
        self.state = StageState.IDLE  # a cancelled trajectory's freed slot must not start another
        pending = [*self._tasks, *([self._loop_task] if self._loop_task else [])]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
