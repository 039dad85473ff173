"""Checkpointing: save at a step, save a last checkpoint after a failure, resume (format:
pipeline/checkpoint.py).

    ckpt = Checkpointing(job)
    step = await ckpt.resume(path)              # before generation starts
    path = await ckpt.save(step)                # at a step boundary, once the push in flight landed
    await ckpt.save_last(err)                   # after a failure or an interrupt; never raises
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from pipeline.checkpoint import load_controller_state, rng_state, save_controller_state, set_rng_state
from pipeline.driver.calls import RunError, call_within

log = logging.getLogger(__name__)

LAST_CHECKPOINT_TIMEOUT_S = 120.0  # after a failure; after an interrupt (Ctrl-C, a signal) a quarter of it


class Checkpointing:
    """Contract: a checkpoint is written only at a step boundary, with no push in flight (`save`
    waits for it) and never while a step runs (the caller stops its loops before `save_last`). Every
    trainer rank (possibly on other hosts) saves into a new step_N.tmp-* directory, then this process
    adds its state (version, the buffer, the eval curve, its RNG); the directory becomes step_N only
    once all of it is written. A failed save is removed; a cancelled one is left (trainer ranks may
    still be writing into it) for the next start to sweep. `save_last` is bounded
    (LAST_CHECKPOINT_TIMEOUT_S, a quarter of it after an interrupt) and logs instead of raising, so
    the run's own error is the one that propagates. `resume` restores everything before generation
    starts and pushes the checkpoint's weights to the generators as its version.

    Example:
        ckpt = Checkpointing(job)
        first_step = await ckpt.resume(cfg.run.resume) + 1 if cfg.run.resume else 1
        ...
        metrics["checkpoint"] = str(await ckpt.save(step))
    """

    def __init__(self, job: Any):
        self.job = job
        self.saved_step = -1  # the step of this run's newest checkpoint (or the one it resumed from)

    async def save(self, step: int) -> Path:
        job = self.job
        await job.sync.wait()
        buf = await call_within("buffer.state_dict", job.buffer.state_dict.call_one())
        return await self._write(step, buf)

    async def _write(self, step: int, buf: dict) -> Path:
        job = self.job
        tmp = job.checkpoints.begin(step)
        try:
            await job.trainer.save(str(tmp), {"step": step})
            save_controller_state(tmp, {"step": step, "version": job.version, "buffer": buf,
                                        "eval_curve": list(job.eval_curve), "rng": rng_state()})
            path = job.checkpoints.commit(tmp, step, job.version)
        except Exception:
            job.checkpoints.abort(tmp)
            raise
        self.saved_step = step
        return path

    async def save_last(self, err: BaseException) -> Path | None:
        """After a failure or an interrupt (`err`): a checkpoint at the trainer's version, if
        checkpoints are on, the trainer still answers and every batch the buffer handed out was
        trained (a step cut short between the two would leave a checkpoint whose buffer is a batch
        ahead of its trainer). None when there is none."""
        if not self.job.cfg.run.checkpoint_every or self.job.sync is None:  # off, or the meshes never came up
            return None
        timeout = LAST_CHECKPOINT_TIMEOUT_S if isinstance(err, Exception) else LAST_CHECKPOINT_TIMEOUT_S / 4
        try:
            return await asyncio.wait_for(self._save_last(), timeout)
        except asyncio.TimeoutError:
            log.error("no last checkpoint: not written within %.0fs", timeout)
        except Exception as e:
            log.error("no last checkpoint: %s: %s", type(e).__name__, e)
        return None

    async def _save_last(self) -> Path | None:
        job = self.job
        buf = await job.buffer.state_dict.call_one()
        version = await job.trainer.version()
        if version == self.saved_step:
            log.info("no last checkpoint needed: step_%d is saved", version)
            return None
        if version == 0 or buf["buffer"]["batches"] != version:
            log.warning("no last checkpoint: trainer at version %d, the buffer handed out %d batches (%s)", version,
                        buf["buffer"]["batches"], "nothing trained" if version == 0 else "a step was cut short")
            return None
        job.version = version  # a train step may have finished after its caller was cancelled
        path = await self._write(version, buf)
        log.warning("saved a last checkpoint %s: continue with run.resume=latest", path)
        return path

    async def resume(self, path: str) -> int:
        """Restore checkpoint `path`: trainer, buffer (its complete groups are trained next, its
        in-flight ones requeued), prompt position, this process's RNG and eval curve; the generators
        get its weights as its version. Returns its step."""
        job = self.job
        state = load_controller_state(path)
        await job.trainer.load(path)
        job.version = await job.trainer.version()
        if job.version != state["version"]:
            raise RunError(f"checkpoint {path}: trainer version {job.version} != saved {state['version']}")
        await call_within("buffer.load_state_dict", job.buffer.load_state_dict.call_one(state["buffer"]))
        set_rng_state(state["rng"])
        job.eval_curve[:] = state["eval_curve"]
        self.saved_step = state["step"]
        if job.version:
            await job.sync.push(job.version)
        held = state["buffer"]["buffer"]
        log.info("resumed from %s at step %d (version %d): %d complete groups to train, %d requeued", path,
                 state["step"], job.version, len(held["complete"]), len(held["in_flight"]))
        return int(state["step"])
