"""Step hooks: what runs after each train step, in order, each one a small object; the ones that
are off are null objects, so the loop has no `if enabled` branches.

    hooks = step_hooks(job, sink, progress, checkpointing, first_step)
    await hooks.start(first_step)                # eval at step 0 (a fresh run)
    await hooks.after_step(step, metrics, batch) # measure -> eval -> checkpoint -> rollout log -> record
    hooks.stopping()                             # 'no_signal' once a hook ends the run early, else None
    summary = await hooks.finish(last, ended)    # final eval at an early end; the summary's fields
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from pipeline.driver.calls import call_within
from pipeline.driver.health import CollapseWatch
from pipeline.driver.learning_signal import Probe, RunFacts, SignalWatch, StepSignal, dynamic_sampling, preflight
from pipeline.driver.metrics import reward_metrics, trained_samples
from pipeline.types import Batch

log = logging.getLogger(__name__)


class Hook:
    """The null hook: every phase does nothing. `after_step` may add entries to `metrics`, which
    the Record hook (last) writes, and may set `stop` (how the run ended, e.g. 'no_signal'): the
    loop ends after that step, every hook having seen it."""

    stop: str | None = None

    async def start(self, first_step: int, row0: dict) -> None:
        """Before the first step; a fresh run's step-0 figures go into `row0`, one metrics row."""

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        pass

    async def finish(self, last: int, ended: str) -> dict:
        return {}


class Measure(Hook):
    """Throughput, the collapse watch, and the fleet's metrics: the generators' stats as of the
    supervisor's last probe (`slot.stats`, no call per step; at most a probe period old), except at
    run.steps, whose row, the run's totals as a person reads them, asks every generator once; the
    versions they serve (the weight sync's record of each apply, else the version a generator was
    spawned with); restarts."""

    def __init__(self, job: Any):
        cfg = job.cfg
        self.job = job
        self.last_step = cfg.run.steps
        self.watch = CollapseWatch(cfg.run.collapse_entropy, cfg.run.collapse_length, cfg.run.collapse_patience)
        self.t_start = time.monotonic()
        self.samples = self.tokens = 0

    async def start(self, first_step: int, row0: dict) -> None:
        if not self.samples:  # after the step-0 eval (Hooks.start runs it last), unless steps came first
            self.t_start = time.monotonic()  # (run.eval_overlap: step 1 may train beside that eval)

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        job, cfg = self.job, self.job.cfg
        if (msg := self.watch.update(step, metrics)) is not None:
            log.warning(msg)
        self.samples += int(metrics.get("samples", cfg.buffer.batch_groups * cfg.buffer.group_size))
        self.tokens += int(metrics["batch/tokens"])
        elapsed = time.monotonic() - self.t_start
        if step == self.last_step:
            await job.fleet.refresh_stats(cfg.generator.health_timeout_s)
        live = job.fleet.live_generators()
        gens = [s.stats for _, s in live if s.stats is not None]
        probe_s = max((s.probe_max_s for s in job.fleet.slots()), default=0.0)
        for s in job.fleet.slots():
            s.probe_max_s = 0.0
        served = min((job.sync.served.get(i, s.version) for i, s in live), default=job.version)
        metrics.update({
            "throughput/samples_per_s": self.samples / elapsed, "throughput/trained_tokens_per_s": self.tokens / elapsed,
            "throughput/gen_tokens_per_s": sum(g["tokens_per_s"] for g in gens),
            # every token the live generators sampled for training (rejected, dropped and carried ones included)
            "throughput/gen_tokens_total": float(sum(g["tokens"] for g in gens)),
            "throughput/gen_tokens_per_trained_sample": sum(g["tokens"] for g in gens) / max(self.samples, 1),
            "sync/latency_s": job.sync.last.get("total_s", float("nan")),
            "sync/verified_pushes": float(job.sync.verified_pushes),
            "sync/update_pause_s": sum(g["pause_s_mean"] for g in gens) / len(gens) if gens else float("nan"),
            **sync_bytes(job.sync.last),
            "version/generator": served, "version/lag": job.version - served,
            "carry/samples": float(sum(g["carried_samples"] for g in gens)),
            "carry/tokens": float(sum(g["carried_tokens"] for g in gens)),
            "carry/reprefill_tokens": float(sum(g["reprefill_tokens"] for g in gens)),
            "health/probe_s_max": probe_s,  # the slowest health probe since the last step (generator.hang_timeout_s)
            "faults/restarts": float(sum(s.incarnation for s in job.fleet.generators)),
            "faults/requeued_groups": float(job.requeued_groups), "generators/live": float(len(live)),
            **rejected_metrics(gens), **reward_metrics(gens, job),
        })

    async def finish(self, last: int, ended: str) -> dict:
        elapsed = max(time.monotonic() - self.t_start, 1e-9)
        return {"elapsed_s": elapsed, "collapsed_steps": self.watch.steps_collapsed,
                "samples_per_s": self.samples / elapsed, "tokens_per_s": self.tokens / elapsed}


class Eval(Hook):
    """Held-out eval at step 0 of a fresh run, every run.eval_every steps, at run.steps, and after
    the last step of a run that ran out of data; each first waits for the push in flight, so the
    weights evaluated are the ones just trained. Appends to job.eval_curve (kept in checkpoints).
    With run.eval_overlap an eval before run.steps is pinned (Job.pin): the next step trains beside
    it, its push waits for it, and its figures join the step's row, which Record holds till then."""

    def __init__(self, job: Any, sink: Any, first_step: int):
        self.job, self.sink = job, sink
        self.every, self.last_step = job.cfg.run.eval_every, job.cfg.run.steps
        self.first_step = first_step
        self.overlap = job.cfg.run.eval_overlap

    async def _eval(self, step: int) -> dict:
        await self.job.sync.wait()
        t0 = time.monotonic()
        ev = await self.job.evaluation.evaluate()
        ev["eval/time_s"] = time.monotonic() - t0  # the generator's time on it, which rollouts wait out
        self.job.eval_curve.append((step, ev["eval/reward"], ev["eval/reward_greedy"]))
        return ev

    async def start(self, first_step: int, row0: dict) -> None:
        if first_step == 1:
            row0.update(await self._eval(0))

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        if step == self.last_step or (step % self.every == 0 and not self.overlap):
            metrics.update(await self._eval(step))
        elif step % self.every == 0:
            self.job.pin(self._into(step, metrics))

    async def _into(self, step: int, metrics: dict) -> None:
        metrics.update(await self._eval(step))

    async def finish(self, last: int, ended: str) -> dict:
        curve = self.job.eval_curve
        if ended != "steps" and last >= self.first_step and not (curve and curve[-1][0] == last):
            # the final model (the loop evaluates at run.steps, which an end of data or an early stop
            # comes before): its own row
            self.sink.log(last, await self._eval(last))
        return {}


class SignalAlarm(Hook):
    """The pre-flight line and the zero-signal alarm (pipeline/driver/learning_signal.py).

    start (a fresh run with held-out prompts, after the step-0 eval): the held-out probe of groups of
    buffer.group_size (the auto warm start's last one, else one now on run.preflight_prompts prompts),
    its line logged (a warning when fewer than half of the groups would carry a signal) and its figures
    written as step 0's `preflight/*` (with the warm start's `warm_start/*`). It also settles
    buffer.zero_signal=auto (learning_signal.dynamic_sampling): with dynamic sampling chosen the buffer
    drops groups without a spread from then on (set_zero_signal; groups that finished during the
    step-0 eval and probe were kept). The choice is step 0's `preflight/dynamic_sampling`
    (with a probe) and the summary's `zero_signal`; without a probe auto stays keep, said at info
    level; a resumed run keeps its checkpoint's mode.

    after_step: the step's share of groups without a reward spread (`signal/flat_share`) feeds
    SignalWatch, which warns once after run.no_signal_patience steps in a row and sets `stop`
    ('no_signal') after run.stop_without_signal."""

    def __init__(self, job: Any, sink: Any):
        run = job.cfg.run
        self.job, self.sink = job, sink
        self.watch = SignalWatch(run.no_signal_share, run.no_signal_patience, run.stop_without_signal)
        self.dropped: float | None = None  # the buffer's zero-signal drops at the previous step
        self.preflight: str | None = None
        self.stopped: str | None = None
        on, why = dynamic_sampling(None, RunFacts.of(job.cfg, 0))
        self.choice = {"setting": job.cfg.buffer.zero_signal, "dynamic_sampling": on, "why": why}

    async def start(self, first_step: int, row0: dict) -> None:
        job, cfg = self.job, self.job.cfg
        g, warm, auto = cfg.buffer.group_size, job.warm, cfg.buffer.zero_signal == "auto"
        facts = RunFacts.of(cfg, warm.steps if warm is not None else 0)
        if first_step != 1:
            if auto:  # the buffer's checkpoint holds the mode the fresh run chose
                mode = (await call_within("buffer.stats", job.buffer.stats.call_one(), 60))["zero_signal_mode"]
                self.choice = {"setting": "auto", "dynamic_sampling": mode == "drop",
                               "why": "buffer.zero_signal=auto on a resume: the checkpoint's choice"}
                log.info("buffer.zero_signal=auto: a resumed run keeps its checkpoint's choice, dynamic sampling %s",
                         "on" if mode == "drop" else "off")
            return
        if g < 2 or not (cfg.run.eval_every and cfg.task.eval_prompts):
            if auto:
                log.info("pre-flight: no held-out probe (%s): buffer.zero_signal=auto keeps groups without a reward "
                         "spread (dynamic sampling off)", "buffer.group_size=1" if g < 2 else
                         f"run.eval_every={cfg.run.eval_every}, task.eval_prompts={cfg.task.eval_prompts}")
            return
        if warm is not None and warm.after is not None:
            probe, timed = warm.after, {}
        else:
            # the Eval hook (started first: Hooks.start runs them in reverse) has just evaluated these
            # weights: its sampled pass is the probe's first requests
            t0 = time.monotonic()
            probe = Probe.of(await job.evaluation.probe(g, True, job.cfg.run.preflight_prompts), g)
            timed = {"preflight/time_s": time.monotonic() - t0}
        self.preflight, bad = preflight(probe, facts)
        (log.warning if bad else log.info)(self.preflight)
        on, why = dynamic_sampling(probe, facts)
        if on and auto:
            await call_within("buffer.set_zero_signal", job.buffer.set_zero_signal.call_one("drop"), 60)
        self.choice = {"setting": cfg.buffer.zero_signal, "dynamic_sampling": on, "why": why}
        row0.update(probe.metrics("preflight") | timed | {"preflight/dynamic_sampling": float(on)}
                    | (warm.metrics() if warm is not None else {}))

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        groups: dict[int, list[float]] = {}
        for gid, r in zip(batch.group_ids, batch.rewards.tolist()):
            groups.setdefault(gid, []).append(r)
        dropped = metrics.get("buffer/zero_signal_dropped", 0.0)
        new_drops = int(dropped - self.dropped) if self.dropped is not None else 0
        self.dropped = dropped
        sig = StepSignal.of(metrics, [rs[0] for rs in groups.values() if max(rs) - min(rs) <= 1e-9], len(groups),
                            new_drops, float((batch.rewards >= 1.0).float().mean()))
        metrics["signal/flat_share"] = sig.flat_share
        event = self.watch.update(step, sig)
        if event is not None:
            log.warning(event[1])
            if event[0] == "stop":
                self.stop, self.stopped = "no_signal", event[1]

    async def finish(self, last: int, ended: str) -> dict:
        warm = self.job.warm
        return {"preflight": self.preflight, "no_signal": self.stopped, "signal_watch": self.watch.summary(),
                "zero_signal": self.choice,
                "warm_start": warm.summary() if warm is not None else None}


class Checkpoint(Hook):
    """A checkpoint every run.checkpoint_every steps (Checkpointing.save waits for the push in flight,
    and the step's eval, if one runs beside training, ends first: the checkpoint's eval curve has it)."""

    def __init__(self, checkpointing: Any, every: int, job: Any):
        self.checkpointing, self.every, self.job = checkpointing, every, job

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        if step % self.every == 0:
            await self.job.settle()
            metrics["checkpoint"] = str(await self.checkpointing.save(step))


class RolloutLog(Hook):
    """run.log_rollouts of each trained batch's samples, decoded, to the sink (rollouts.jsonl)."""

    def __init__(self, job: Any, sink: Any, k: int):
        self.job, self.sink, self.k = job, sink, k

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        self.sink.log_rollouts(step, trained_samples(batch, self.job.decode, self.k, self.job.special.pad))


class Record(Hook):
    """Last: the step's metrics to the sink (metrics.jsonl, TensorBoard, W&B) and the progress bar.
    A row is held while held-out work is pinned (Job.pin: an eval beside training adds its figures to
    the row when it ends), then written in step order; `flush` writes what is held as it is."""

    def __init__(self, sink: Any, progress: Any, job: Any = None):
        self.sink, self.progress, self.job = sink, progress, job
        self.held: list[tuple[int, dict, float]] = []  # (step, row, when it was held)

    def hold(self, step: int, row: dict) -> None:
        self.held.append((step, row, time.monotonic()))

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        self.hold(step, metrics)
        pinned = self.job.pinned if self.job is not None else None
        if pinned is None or pinned.done():
            self.flush()

    def flush(self) -> None:
        """Writes the held rows in order, each timed when it was complete: held, and the pinned
        work it waited for ended (its eval's end, not the later step that released it)."""
        end = self.job.pinned_end if self.job is not None else 0.0
        for step, row, t in self.held:
            if row:  # a step-0 row without figures (a resumed run) is not written
                self.sink.log(step, row, at=max(t, end))  # a row held past its pinned work's end: that end
            if step:
                self.progress.update(row)
        self.held.clear()

    async def finish(self, last: int, ended: str) -> dict:
        if self.job is not None:
            await self.job.settle()
        self.flush()
        return {}


class Hooks:
    """Hooks run in list order, each phase of each hook awaited before the next: a hook sees the
    metrics the earlier ones added. `start` and `finish` run them last first, so that the clock of
    Measure (first) starts after the step-0 eval and stops after the final one, as the run's throughput
    has always been measured. `finish` merges their summary fields.

    Example:
        hooks = Hooks([Measure(job), Hook(), Hook(), Hook(), Record(sink, progress)])
        await hooks.after_step(1, metrics, batch)
    """

    def __init__(self, hooks: list[Hook], sink: Any = None, pin: Any = None):
        self.hooks, self.sink, self.pin = hooks, sink, pin

    async def start(self, first_step: int) -> None:
        """Runs every hook's start; their step-0 figures (a fresh run's eval, the pre-flight probe,
        the warm start's) are written as one row, so metrics.jsonl keeps one row per step. With `pin`
        (Job.pin, run.eval_overlap) the starts run beside the first step, pinned, and Record (last)
        holds the row until they end."""
        row0: dict = {}

        async def starts() -> None:
            for h in reversed(self.hooks):
                await h.start(first_step, row0)

        record = self.hooks[-1] if self.hooks and isinstance(self.hooks[-1], Record) else None
        if self.pin is not None and record is not None:
            record.hold(0, row0)
            self.pin(starts())
            return
        await starts()
        if row0 and self.sink is not None:
            self.sink.log(0, row0)

    def flush(self) -> None:
        """The rows Record holds, written as they are (the run is ending early)."""
        if self.hooks and isinstance(self.hooks[-1], Record):
            self.hooks[-1].flush()

    async def after_step(self, step: int, metrics: dict, batch: Batch) -> None:
        for h in self.hooks:
            await h.after_step(step, metrics, batch)

    async def finish(self, last: int, ended: str) -> dict:
        out: dict = {}
        for h in reversed(self.hooks):
            out |= await h.finish(last, ended)
        return out

    def stopping(self) -> str | None:
        """How the run is to end now (the first hook's `stop`), or None to go on."""
        return next((h.stop for h in self.hooks if h.stop is not None), None)


def step_hooks(job: Any, sink: Any, progress: Any, checkpointing: Any, first_step: int) -> Hooks:
    """The job's hooks as configured: the pre-flight line and zero-signal alarm (always), eval
    (run.eval_every with task.eval_prompts), checkpoints (run.checkpoint_every), the rollout log
    (run.log_rollouts), each a null Hook when off."""
    run = job.cfg.run
    evals = bool(run.eval_every and job.cfg.task.eval_prompts)
    return Hooks([
        Measure(job),
        SignalAlarm(job, sink),
        Eval(job, sink, first_step) if evals else Hook(),
        Checkpoint(checkpointing, run.checkpoint_every, job) if run.checkpoint_every else Hook(),
        RolloutLog(job, sink, run.log_rollouts) if run.log_rollouts else Hook(),
        Record(sink, progress, job),
    ], sink, job.pin if evals and run.eval_overlap else None)


def sync_bytes(last: dict) -> dict[str, float]:
    """What the last push moved (rdma, collective; NaN for shm, which moves none): sync/bytes to every
    generator, sync/delta_fraction of a full push's bytes, sync/delta_receivers (weight_sync.delta)."""
    nan = float("nan")
    full = last.get("full_bytes", 0.0)
    return {"sync/bytes": last.get("bytes", nan), "sync/delta_fraction": last["bytes"] / full if full else nan,
            "sync/delta_receivers": last.get("delta_receivers", nan)}


def rejected_metrics(gens: list[dict]) -> dict[str, float]:
    """`rejected/<reason>`: samples (rewards) and prompts rejected so far, summed over the generators'
    stats; `rejected/recent_frac`: the highest recent rejected fraction (task.max_reject_frac bounds it)."""
    total: Counter = Counter()
    for g in gens:
        total.update(g["rejected"])
        total.update(g["failed"])
    return {**{f"rejected/{k}": float(v) for k, v in sorted(total.items())},
            "rejected/recent_frac": max((g["recent_rejected_frac"] for g in gens), default=0.0)}


DIFFICULTY_METRICS = ("prompts_set_aside", "prompts_retried", "prompts_aside", "prompts_skipped", "signal_share",
                      "filter_saturated")
"""The difficulty filter's stats (pipeline/difficulty.py) logged per step as buffer/<name>."""


def buffer_metrics(buf: dict) -> dict[str, float]:
    """The buffer's per-step metrics: Δ, drops and wasted tokens, the difficulty filter's counts
    (every mode reports them)."""
    return {"buffer/delta": float(buf["delta"]), "buffer/dropped_samples": float(buf["dropped_samples"]),
            "buffer/wasted_tokens": float(buf["wasted_tokens"]), "buffer/held_samples": float(buf["held_samples"]),
            "buffer/zero_signal_groups": float(buf["zero_signal_groups"]),
            "buffer/zero_signal_dropped": float(buf["dropped_groups"].get("zero_signal", 0)),
            "buffer/dynamic_sampling": float(buf["zero_signal_mode"] == "drop"),
            "data/epoch": float(buf["data_epoch"]),
            **{f"buffer/{k}": float("nan") if buf[k] is None else float(buf[k]) for k in DIFFICULTY_METRICS}}
