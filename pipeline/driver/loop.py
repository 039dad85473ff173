"""The training loop and the job: `TrainLoop` steps (batch -> train -> publish -> hooks) and
`run(cfg, host)` composes the roles into the whole job.

One step, async mode (`run.mode=async`, AsyncPublish):
    batch(v-1) -> [carry_over=save: every generator ends its stage; partials resume on v]
    -> train -> buffer.finish_step(v) (admission for v opens) -> sync.start(v) (returns once packed)
    -> the next step's batch wait and compute overlap the delivery of v.
Sync mode (`run.mode=sync`, SyncPublish, the baseline): the buffer runs with Δ=0 and max_staleness=0,
    batch(v-1) -> train -> sync.push(v) (every generator serves v) -> buffer.finish_step(v).
Admission for v opens only once v is served, so every sample of a step is generated on the
weights it is trained against and nothing is dropped. Either way the buffer learns v before any
generator serves it, and it hands out one batch per version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from pipeline.checkpoint import prepare_resume, read_marker
from pipeline.config import Config
from pipeline.control import Control
from pipeline.driver.calls import EndOfData, RunError, call_within
from pipeline.driver.checkpointing import Checkpointing
from pipeline.driver.health import batch_health
from pipeline.driver.hooks import Hooks, buffer_metrics, step_hooks
from pipeline.driver.job import Job
from pipeline.driver.metrics import MetricsSink, Progress, plot_summary
from pipeline.driver.shutdown import shut_down
from pipeline.trainer.errors import TooManySkippedSteps, skipped_step_error
from pipeline.types import Batch

log = logging.getLogger(__name__)

STOP_LOOPS_S = 60.0
"""How long the run's end waits for the supervisor and the control loop to stop once training ended."""


class AsyncPublish:
    """Announce v to the buffer, then start its push; returns once the trainer may step again (the
    delivery overlaps the next step; WeightSync.start first waits for the push of v-1). The buffer's
    stats after finish_step.

    Example:
        buf = await AsyncPublish(job)(v, metrics["reward/mean"])   # v admitted, its push under way
    """

    def __init__(self, job: Job):
        self.job = job

    async def __call__(self, version: int, mean_reward: float) -> dict:
        buf = await finish_step(self.job, version, mean_reward)
        await self.job.settle()  # an eval of the served weights beside this step ends before they change
        await self.job.sync.start(version)
        return buf


class SyncPublish:
    """Push v and wait until every generator serves it, then announce it: admission for v opens
    only on v's weights. The buffer's stats after finish_step.

    Example:
        buf = await SyncPublish(job)(v, metrics["reward/mean"])    # every generator serves v
    """

    def __init__(self, job: Job):
        self.job = job

    async def __call__(self, version: int, mean_reward: float) -> dict:
        await self.job.settle()  # an eval of the served weights beside this step ends before they change
        await self.job.sync.push(version)
        return await finish_step(self.job, version, mean_reward)


async def finish_step(job: Job, version: int, mean_reward: float) -> dict:
    """Announce the trainer's version to the buffer (admission for it opens) and feed Δ; buffer stats."""
    return await call_within("buffer.finish_step", job.buffer.finish_step.call_one(version, mean_reward))


def publish_for(job: Job) -> AsyncPublish | SyncPublish:
    return SyncPublish(job) if job.cfg.run.mode == "sync" else AsyncPublish(job)


class TrainLoop:
    """Contract: one batch per version: `train_once` asks the buffer for the batch of the version the
    trainer is at, trains it (version + 1) and only then may the next batch be asked for; `step` then
    publishes (the strategy decides whether the push overlaps the next step), and `run` gives each
    step to the hooks (which may wait for the push in flight: eval, checkpoints). Nothing else advances
    job.version. A step the trainer skips (non-finite loss or gradient, no loss tokens) gives its batch
    back to the buffer, booked as dropped so that admission reopens, and the next batch is tried;
    after trainer.max_skipped_steps skips in a row the run stops. EndOfData once the prompts ran out.

    Example:
        loop = TrainLoop(job, AsyncPublish(job), hooks)
        summary = await loop.run(first_step=1)
    """

    def __init__(self, job: Job, publish: AsyncPublish | SyncPublish, hooks: Hooks):
        self.job, self.publish, self.hooks = job, publish, hooks

    async def run(self, first_step: int = 1) -> dict:
        """Steps first_step..run.steps (or to the end of data, a hook's early stop, or a control stop); the
        summary's loop fields ("ended": steps, data, control or the hook's reason)."""
        job, last, ended = self.job, first_step - 1, "steps"
        try:
            await self.hooks.start(first_step)
            for step in range(first_step, job.cfg.run.steps + 1):
                try:
                    batch, metrics = await self.step()
                except EndOfData as e:  # run.epochs reached: a normal end (a final eval, then the summary)
                    log.info("end of data after step %d: %s", last, e)
                    ended = "data"
                    break
                last = step
                await self.hooks.after_step(step, metrics, batch)
                if (stop := self.hooks.stopping()) is not None:  # a hook ends the run early (no_signal)
                    ended = stop
                    break
                if job.stop_requested:  # pipeline.control stop: a normal end, before run.steps
                    log.warning("stopped after step %d by pipeline.control (run.steps=%d)", step, job.cfg.run.steps)
                    ended = "control"
                    break
            await job.sync.wait()
            done = await self.hooks.finish(last, ended)
        except BaseException:  # an eval beside training is cancelled; the rows it held are written as they are
            await job.drop_pinned()
            self.hooks.flush()
            raise
        return {"steps": last - first_step + 1, "ended": ended, "version": job.version, **done,
                "eval_curve": job.eval_curve}

    async def step(self) -> tuple[Batch, dict]:
        """One RL step: the batch, train, publish; the trained batch and the step's metrics."""
        batch, metrics = await self.train_once()
        metrics.update(buffer_metrics(await self.publish(self.job.version, metrics["reward/mean"])))
        return batch, metrics

    async def train_once(self) -> tuple[Batch, dict]:
        """Wait for a batch, take one optimizer step: version + 1 on the trainer (not yet published)."""
        job, cfg = self.job, self.job.cfg
        t0 = time.monotonic()
        while True:
            batch = await call_within("buffer.get_batch",
                                      job.buffer.get_batch.call_one(job.version, cfg.buffer.batch_timeout_s),
                                      cfg.buffer.batch_timeout_s + 30)
            if batch is None:
                raise EndOfData(f"the prompt stream ended (run.epochs={cfg.run.epochs}) and no full batch is left")
            t1 = time.monotonic()
            if cfg.generator.carry_over == "save":  # CoPRIS stage end: in-flight rollouts become partials
                await self._on_generators(lambda g: asyncio.wait_for(g.end_stage.call_one("save", True),
                                                                     cfg.generator.request_timeout_s))
            try:
                metrics = await job.trainer.train_step(batch)
                break
            except Exception as e:  # from the actor: Monarch's ActorError, the trainer's error in .exception
                inner = getattr(e, "exception", e)
                if isinstance(inner, TooManySkippedSteps):
                    raise RunError(str(inner)) from e
                why = skipped_step_error(e)
                if why is None:
                    raise
            log.warning("step at version %d skipped, its batch goes back to the buffer as dropped: %s",
                        job.version, why)
            await call_within("buffer.skip_batch", job.buffer.skip_batch.call_one(batch.group_ids))
            if cfg.generator.carry_over == "save":  # the stages ended for an update that is not coming
                await call_within("start_generation",
                                  self._on_generators(lambda g: g.start_generation.call_one(job.buffer)))
        job.version += 1
        metrics["trainer/skipped_steps"] = metrics.pop("skipped_steps")
        stale = batch.staleness().float()
        t2 = time.monotonic()
        metrics.update({
            "reward/mean": float(batch.rewards.mean()), "staleness/mean": float(stale.mean()),
            "staleness/max": float(stale.max()), "version/trainer": job.version, "time/batch_wait_s": t1 - t0,
            "time/train_s": t2 - t1, "trainer/idle_frac": (t1 - t0) / max(t2 - t0, 1e-9),
            "batch/tokens": batch.num_tokens, **batch_health(batch),
        })
        return batch, metrics

    async def _on_generators(self, call) -> None:
        """`call` on every live generator; a generator dying meanwhile is the supervisor's business."""
        await asyncio.gather(*[call(s.handle) for _, s in self.job.fleet.live_generators()], return_exceptions=True)


# ---------------------------------------------------------------------- the job


async def run(cfg: Config, host: Any = None, roles: Any = None) -> dict:
    """The whole job: start, resume, the train loop and the supervisor side by side (the first to
    end stops the other; the train loop's end is the run's), export, summary.json. Returns the
    summary; raises RunError naming the loop that failed. On a failure or an interrupt a last
    checkpoint is written first (Checkpointing.save_last); shutdown always runs."""
    if cfg.run.resume == "latest":  # the CLI resolves it (pipeline/run.py); a Config built in code may not have
        cfg = prepare_resume(cfg)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    resume_step = read_marker(cfg.run.resume)["step"] if cfg.run.resume else None
    sink = MetricsSink(out, resume_step, cfg.run.wandb, dataclasses.asdict(cfg))  # resumed: rows past it dropped
    progress = None
    job = Job(cfg, host, supervised=True, roles=roles)
    checkpointing = Checkpointing(job)
    job.checkpoints.sweep()
    loops: set[asyncio.Task] = set()
    try:
        await job.start()
        first_step = (await checkpointing.resume(cfg.run.resume)) + 1 if cfg.run.resume else 1
        await job.start_generation()
        progress = Progress(cfg.run.steps - first_step + 1, cfg.run.progress, desc=f"rl[{cfg.run.mode}]")
        loop = TrainLoop(job, publish_for(job), step_hooks(job, sink, progress, checkpointing, first_step))
        loops = {asyncio.create_task(loop.run(first_step), name="train"),
                 asyncio.create_task(job.supervisor.run(), name="supervisor"),
                 asyncio.create_task(Control(job).run(), name="control")}  # python -m pipeline.control
        done, pending = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        if pending:  # bounded: a pool change in flight (a generator joining) may take long to unwind
            _, stuck = await asyncio.wait(pending, timeout=STOP_LOOPS_S)
            for t in stuck:
                log.warning("the %s loop did not stop within %.0fs of the training's end; the run ends without "
                            "waiting for it", t.get_name(), STOP_LOOPS_S)
        first = done.pop()
        if first.get_name() != "train":
            first.result()  # raises the supervisor's error
            raise RunError(f"the {first.get_name()} loop ended before training finished")
        summary = first.result()
        ckpt = out / "hf_checkpoint"
        await job.trainer.export_hf(str(ckpt))
        summary["checkpoint"] = str(ckpt)
        if cfg.trainer.lora.rank and cfg.trainer.lora.export_merged:  # adapters in ckpt/adapter; merged beside
            summary["checkpoint_merged"] = str(out / "hf_checkpoint_merged")
            await job.trainer.export_hf(summary["checkpoint_merged"], True)
        summary["stats"] = await job.stats()
        summary["restarts"] = [s.incarnation for s in job.fleet.generators]
        summary["generators"] = [i for i, _ in job.fleet.active_generators()]  # the pool at the end
        summary["pushes"] = {"started": job.sync.pushes, "verified": job.sync.verified_pushes}
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary
    except BaseException as err:
        for t in loops:  # nothing may train or take a batch while the last checkpoint is written
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await checkpointing.save_last(err)  # never raises: the run's own error follows
        raise
    finally:  # nothing here raises over the run's own outcome: a failed step is logged
        if progress is not None:
            _quietly("closing the progress bar", progress.close)
        _quietly("closing the metrics sink", sink.close)
        await shut_down(job)
        if sink.path.exists() and sink.path.stat().st_size:
            _quietly("the summary plot", plot_summary, sink.path, out / "summary.png",
                     f"{cfg.task.name} ({cfg.run.mode})")


def _quietly(what: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("%s failed", what)
