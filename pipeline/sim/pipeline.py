"""simulate(cfg, costs, workload): the whole pipeline on a simulated clock, around the real buffer.

The replay buffer is `pipeline.buffer.ReplayBufferCore` itself (admission, staleness drops and
retries, carry-over of complete groups, the OPPO Δ controller of pipeline/overcommit.py): the
simulator only decides *when* things reach it. The rest follows the real roles:

    generators   pipeline.sim.generator.SimGenerator, pulling groups the way ReplayBufferActor.admit
                 hands them out (requeued, then retried stale prompts, then new prompts)
    trainer      TrainLoop: wait for B complete groups -> [carry_over=save: stage ends] -> train
                 (TrainerCosts.step_s) -> publish -> controller overhead -> next
    contention   while the train call runs and a generator is busy, each goes slower by its
                 ContentionCosts factor (cores shared); the train call's work is a fluid like decoding
    publish      async (AsyncPublish): finish_step(v), then the push starts (it first waits for the
                 push of v-1: one in flight), the trainer waits for the pack only;
                 sync (SyncPublish): push, wait until every generator serves v, then finish_step(v);
                 the buffer runs with Δ=0, max_staleness=0 and on_update=drain (sync_mode_config)
    push         pack (trainer) -> transfer to every generator at once -> apply: one generator at a
                 time with generator.rolling, else all together; each apply is SimGenerator.update

Configurations it does not model raise UnmodelledConfig naming the key (see `check_modelled`).

Example:
    res = simulate(load_config("configs/tiny.yaml", ["run.steps=12"]), load_costs(p), workload_from_spec("task", cfg))
    res.summary()["tokens_per_s"]
"""

from __future__ import annotations

import heapq
import math
import random
from itertools import count

from pipeline.advantages import overlong_shaping
from pipeline.buffer import ReplayBufferCore
from pipeline.config import Config, sync_mode_config
from pipeline.sim.costs import Costs
from pipeline.sim.generator import SimGenerator, SimSample
from pipeline.sim.report import SimResult, StepRow
from pipeline.sim.workload import RewardCurve, Workload
from pipeline.types import Rollout

__all__ = ["simulate", "check_modelled", "sim_config", "UnmodelledConfig"]


class UnmodelledConfig(ValueError):
    """The configuration asks for something the simulator does not model; names the key."""


def check_modelled(cfg: Config) -> None:
    """UnmodelledConfig naming the first key whose value the simulator cannot model."""
    checks = [
        ("task.env", getattr(cfg.task, "env", ""), lambda v: not v, "multi-turn environments (tool calls) are not modelled"),
        ("reward_model.path", cfg.reward_model.path, lambda v: not v, "reward-model scoring is not modelled"),
        # auto is modelled as keep: its choice needs the held-out probe, which the cost model does not run
        ("buffer.zero_signal", cfg.buffer.zero_signal, lambda v: v in ("keep", "auto"),
         "'drop' needs each group's reward spread, which the cost model does not have"),
        ("trainer.lora.rank", cfg.trainer.lora.rank, lambda v: v == 0, "LoRA pushes and steps have no cost entries"),
        ("run.epochs", cfg.run.epochs, lambda v: v == 0, "finite datasets (run.epochs > 0) are not modelled"),
    ]
    for key, value, ok, why in checks:
        if not ok(value):
            raise UnmodelledConfig(f"{key}={value!r}: {why}")


def sim_config(cfg: Config) -> Config:
    """The config the run uses: run.mode=sync applies pipeline.config.sync_mode_config, as the driver does."""
    return sync_mode_config(cfg) if cfg.run.mode == "sync" else cfg


class _Push:
    """One weight push in flight at most: transfer to all, then apply (rolling: one at a time)."""

    def __init__(self, sim: "_Sim"):
        self.sim, self.busy, self.started_at, self.last_s = sim, False, 0.0, math.nan
        self._then: list = []  # what waits for this push to end (WeightSync.start of the next version)

    def then(self, fn) -> None:
        """Call fn(t) once the push in flight has ended."""
        self._then.append(fn)

    def start(self, now: float, version: int, on_done) -> None:
        self.busy, self.started_at, self.on_done = True, now, on_done
        self.sim.at(now + self.sim.costs.push.transfer_s(), lambda t: self._apply(t, version))

    def _apply(self, t: float, version: int) -> None:
        gens, load_s = self.sim.gens, self.sim.costs.push.load_s()
        if self.sim.cfg.generator.rolling and len(gens) > 1:
            def one(i: int, t: float) -> None:
                if i == len(gens):
                    return self._done(t)
                gens[i].update(t, version, load_s, lambda t2: one(i + 1, t2))
            one(0, t)
        else:
            left = [len(gens)]

            def each(t2: float) -> None:
                left[0] -= 1
                if left[0] == 0:
                    self._done(t2)
            for g in gens:
                g.update(t, version, load_s, each)

    def _done(self, t: float) -> None:
        self.busy, self.last_s = False, t - self.started_at
        cb, self.on_done = self.on_done, None
        cb(t)
        waiting, self._then = self._then, []
        for fn in waiting:
            fn(t)


class _Sim:
    """One simulated run: the clock (an event heap plus each generator's next change), the trainer's
    state machine and the hand-off between generators and the buffer. Token counts are real;
    rollouts given to the buffer carry at most ~256 tokens each (`scale` real tokens per token), so
    the buffer's wasted_tokens is reported times `scale` (exact when max_new_tokens <= 256)."""

    def __init__(self, cfg: Config, costs: Costs, workload: Workload, reward: RewardCurve, seed: int):
        self.cfg, self.costs, self.workload, self.reward = cfg, costs, workload, reward
        self.rng = random.Random(seed)
        self.buf = ReplayBufferCore(cfg.buffer, pad_id=0, overlong=overlong_shaping(cfg))
        self.gens = [SimGenerator(i, cfg.generator, costs.generator) for i in range(cfg.generator.num_generators)]
        # rollouts carry at most ~256 tokens each so that batches stay small; real token counts are kept here
        self.scale = max(1, math.ceil(cfg.generator.max_new_tokens / 256))
        self.real_tokens: dict[int, int] = {}  # group id -> completion tokens of its samples delivered
        self.shapes: dict[int, tuple[int, tuple[int, ...]]] = {}  # group id -> (prompt tokens, lengths)
        self.now = 0.0
        self._events: list = []
        self._seq = count()
        self.push = _Push(self)
        self.exhausted = False
        self.rows: list[StepRow] = []
        self.trainer_state = "wait"
        self.wait_since = 0.0
        self.train_left = 0.0  # > 0: the train call runs (contends with busy generators)
        self.train_row: StepRow | None = None
        self.train_from = 0.0

    def at(self, t: float, fn) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    # ---- generators <-> buffer --------------------------------------------------------------
    def admit(self) -> None:
        """Hand out groups as ReplayBufferActor.admit does (retried stale prompts before new ones),
        the least loaded generator first, then let every generator start what fits."""
        G = self.cfg.buffer.group_size
        for gen in sorted(self.gens, key=SimGenerator.load):
            while gen.wants_group() and self.buf.can_admit() and not (self.exhausted and not self.buf.has_retry()):
                lessee = (gen.gid, 0)
                if self.buf.has_retry():
                    group = self.buf.admit_retry(lessee)
                else:
                    item = self.workload.next_item()
                    if item is None:
                        self.exhausted = True
                        break
                    group = self.buf.admit(item, lessee)
                plen, lengths = self.shapes[group.group_id] = self.workload.shape(group.item)
                samples = [SimSample(group.group_id, i, plen, lengths[i], 0.0, lessee) for i in range(G)]
                if self.costs.generator.admit_s > 0:  # the group reaches the generator one round trip later
                    gen.admitting = True
                    self.at(self.now + self.costs.generator.admit_s, lambda t, g=gen, ss=samples: self._arrive(g, ss))
                else:
                    gen.enqueue(samples)
        for gen in self.gens:
            gen.refill(self.now)

    def _arrive(self, gen: SimGenerator, samples: list[SimSample]) -> None:
        gen.admitting = False
        gen.enqueue(samples)

    def deliver(self, gen: SimGenerator, s: SimSample) -> None:
        m = max(1, math.ceil(s.length / self.scale))
        v0 = s.v_first if s.v_first is not None else gen.version
        versions = (v0,) + (gen.version,) * (m - 1)
        r = Rollout(group_id=s.group_id, sample_idx=s.idx, prompt="", prompt_tokens=(1,), completion="",
                    completion_tokens=(2,) * m, logprobs=(-1.0,) * m, versions=versions, finish_reason="length",
                    reward=self.reward.sample(v0, self.rng), generator_id=gen.gid, reprefill_tokens=s.reprefill)
        self.real_tokens[s.group_id] = self.real_tokens.get(s.group_id, 0) + s.length
        self.buf.add(r, s.lessee)

    # ---- the trainer ------------------------------------------------------------------------
    def trainer_poll(self) -> None:
        if self.trainer_state != "wait" or not self.buf.ready():
            return
        self.buf.set_trainer_version(self.buf.version)
        batch = self.buf.take_batch()
        wait = self.now - self.wait_since
        self.buf.record_wait(wait)
        ids = sorted(set(batch.group_ids))
        tokens = sum(self.real_tokens.pop(g) for g in ids)
        shapes = [self.shapes.pop(g) for g in ids]
        prompt_tok = sum(p for p, _ in shapes) * self.cfg.buffer.group_size
        N = batch.input_ids.shape[0]
        longest = max(p + max(ls) for p, ls in shapes)
        work = N * longest if self.costs.trainer.padding == "max" else tokens + prompt_tok
        if self.cfg.generator.carry_over == "save":
            for g in self.gens:
                g.end_stage_save()
        train_s = self.costs.trainer.step_s(work, self.cfg.trainer.epochs)
        stale = batch.staleness().float()
        row = StepRow(step=len(self.rows) + 1, batch_wait_s=wait, train_s=train_s, samples=N, tokens=tokens,
                      staleness_mean=float(stale.mean()), reward=float(batch.rewards.mean()))
        self.trainer_state = "train"
        self.train_left, self.train_row, self.train_from = train_s, row, self.now  # seconds of work alone

    def _trained(self, t: float, row: StepRow) -> None:
        v = self.buf.version + 1
        if self.cfg.run.mode == "sync":
            self._pack(t, v, row, after=lambda t2: self._push_then_finish(t2, v, row))
        else:
            self._finish_step(v, row)
            if self.push.busy:  # WeightSync.start waits for the push of v-1
                self.push.then(lambda t2: self._pack(t2, v, row, after=self._hooks(row)))
            else:
                self._pack(t, v, row, after=self._hooks(row))

    def _pack(self, t: float, v: int, row: StepRow, after) -> None:
        def packed(t2: float) -> None:
            if self.cfg.run.mode == "sync":
                after(t2)
            else:
                self.push.start(t2, v, lambda t3: setattr(row, "sync_s", self.push.last_s))
                after(t2)
        self.at(t + self.costs.push.pack_s(), packed)

    def _push_then_finish(self, t: float, v: int, row: StepRow) -> None:
        def served(t2: float) -> None:
            row.sync_s = self.push.last_s
            self._finish_step(v, row)
            self._hooks(row)(t2)
        self.push.start(t, v, served)

    def _finish_step(self, v: int, row: StepRow) -> None:
        self.buf.set_trainer_version(v)
        row.delta = self.buf.end_step(row.reward)

    def _hooks(self, row: StepRow):
        def run(t: float) -> None:
            def done(t2: float) -> None:
                st = self.buf.stats()
                row.time_s = t2
                row.dropped_samples = st["dropped_samples"]
                row.wasted_tokens = st["wasted_tokens"] * self.scale
                self.rows.append(row)
                self.trainer_state = "wait"
                self.wait_since = t2
            self.at(t + self.costs.controller.step_overhead_s, done)
        return run

    # ---- the clock --------------------------------------------------------------------------
    def run(self, steps: int) -> SimResult:
        self.admit()
        while len(self.rows) < steps:
            self.trainer_poll()
            # contention: each side's rate for the interval to come, from whether the other is busy now;
            # every change of either state is an event, so the rates hold until t
            training = self.train_row is not None
            t_slow = self.costs.contention.trainer_slowdown(any(g.busy() for g in self.gens))
            for g in self.gens:
                g.slow = self.costs.contention.generator_slowdown(training)
            cands = [g.next_event(self.now) for g in self.gens]
            t_gen = min((c for c in cands if c is not None), default=math.inf)
            t_ev = self._events[0][0] if self._events else math.inf
            t_train = self.now + self.train_left * t_slow if training else math.inf
            t = min(t_gen, t_ev, t_train)
            if t == math.inf:
                if self.exhausted:
                    break
                raise RuntimeError(f"simulation stalled at t={self.now:.3f}s, step {len(self.rows) + 1}: "
                                   f"trainer {self.trainer_state}, buffer {_brief(self.buf.stats())}")
            for g in self.gens:
                for s in g.advance(self.now, t):
                    self.deliver(g, s)
            if training:
                self.train_left = 0.0 if t >= t_train else self.train_left - (t - self.now) / t_slow
            self.now = t
            if training and self.train_left <= 0.0:
                row, self.train_row = self.train_row, None
                row.train_s = t - self.train_from  # as long as it took, contention included
                self._trained(t, row)
            while self._events and self._events[0][0] <= t:
                _, _, fn = heapq.heappop(self._events)
                fn(t)
            self.admit()
        return SimResult(self.cfg, self.rows, self.now, [g.busy_s for g in self.gens], self.buf.stats(),
                         [g.reprefill_tokens for g in self.gens], self.workload.describe)


def _brief(st: dict) -> dict:
    return {k: st[k] for k in ("version", "held_groups", "in_flight_groups", "complete_groups", "admission_limit",
                               "dropped_groups", "delta")}


def simulate(cfg: Config, costs: Costs, workload: Workload, reward: RewardCurve | None = None,
             steps: int | None = None, seed: int = 0) -> SimResult:
    """Simulate `steps` (default run.steps) steps of `cfg` (after sync_config for run.mode=sync)."""
    check_modelled(cfg)
    cfg = sim_config(cfg)
    sim = _Sim(cfg, costs, workload, reward or RewardCurve("flat", start=0.0, noise=0.05), seed)
    return sim.run(steps if steps is not None else cfg.run.steps)
