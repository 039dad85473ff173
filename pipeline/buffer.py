"""ReplayBufferCore: admission, GRPO grouping, version rejection and OPPO deferral (no Monarch).

Life of a prompt group (G = group_size, B = batch_groups, η = max_staleness, v = trainer version):

    admit(item) -> PromptGroup     in flight: the generators sample it G times
    add(rollout) x G               complete: advantages computed, queued FIFO by completion
    take_batch() -> Batch          trained: the first B complete groups, padded per pipeline.types
    end_step(mean_reward)          Δ for the next step (pipeline.overcommit.DeltaController)

Groups are trained or dropped whole: the GRPO baseline is the group mean, so a group missing a
sample would have a biased baseline, and a batch always holds exactly B·G samples. Drop reasons:
"stale" (some sample is older than η; with retry_stale its prompt is admitted again as a new
group, before new prompts, so no prompt of a finite dataset is lost to staleness),
"zero_signal" (equal rewards while dynamic sampling is on: `zero_signal_mode` below),
"failed" (release() by a generator), "skipped_step" (skip_batch(): the trainer skipped the step
of the last batch taken).

Dynamic sampling: `zero_signal_mode` is what a group with equal task rewards (before DAPO's overlong
shaping: DAPO filters on accuracy) gets when it finishes, "keep" (trained, at advantage 0 unless the
shaping spreads its rewards) or "drop". buffer.zero_signal=keep|drop fixes it; auto starts at keep
and the driver switches it with set_zero_signal() after its pre-flight probe; groups that
finished before the switch are not revisited. The mode is part of state_dict(), so a resumed auto run
keeps its choice.

Difficulty: every finished group's rewards go to `self.difficulty` (pipeline/difficulty.py, the
online difficulty filter), which the actor asks before it admits a prompt drawn from the stream; its
state is part of state_dict(). Stale retries and requeued groups are not asked (never judged).

Accounting, leases and checkpoints (pipeline/buffer_ledger.py): admitted = trained + dropped + held
samples, in sample slots, across generator kills and restarts. Bad rollouts are rejected
(RolloutRejected, counted by reason) and change nothing else.

Admission: can_admit() holds iff, after one more group,

    trained_groups + held_groups <= (η + v + 1) · B      the AReaL staleness bound
    held_groups <= B + Δ                                 OPPO over-commitment

Dropped groups give their slot back. That keeps η = 0 live: once the trainer is at v+1, samples a
lagging generator still makes at v are stale and dropped, and their slots are re-admitted until it
serves v+1; a buffer that counted drops against the bound (or evicted them without refunding)
would wait forever. Between take_batch at v and set_trainer_version(v+1) the bound allows at most
η·B held groups, so with η = 0 nothing is admitted in that gap, where only weights the next step
rejects could generate it. In steady state the bound caps useful over-commitment at Δ <= η·B;
stats() reports the Δ admission lets through as `delta_effective` and counts the steps where the
controller's Δ exceeded it as `delta_capped_steps`.

Staleness = v − min(model token versions); a sample without model tokens is fresh (environment
tokens of a multi-turn rollout, version -1, carry no policy version and are not trained on). It is checked
when the version changes and when a sample arrives. It never decreases, so dropping a group as soon
as it exceeds η gives the same result as dropping it at batch time, and frees its slot sooner.
Samples still arriving for a group dropped in flight are ignored and counted as `late_rollouts`.

Contract with the controller: one batch per trainer version (the bound weighs trained groups
against v·B), and set_trainer_version(v+1) before any generator serves weights v+1; a token
version above the buffer's version is rejected as from the future. A batch whose step the trainer
skipped (the version did not advance) goes back with skip_batch(), which books its groups as
dropped instead of trained: otherwise they would count against v·B and, with η = 0, admission
would stay closed for good.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Iterable

import torch

from pipeline.advantages import Overlong, group_advantages, rollout_shaping
from pipeline.buffer_ledger import BufferLedger, HeldGroup, Lessee
from pipeline.config import BufferConfig
from pipeline.difficulty import DifficultyFilter
from pipeline.overcommit import DeltaController
from pipeline.types import Batch, PromptGroup, PromptItem, Rollout

__all__ = ["ReplayBufferCore", "RolloutRejected", "Lessee"]


class RolloutRejected(ValueError):
    """A rollout the buffer refused; `reason` is the counter it was booked under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"rollout rejected ({reason}): {detail}")
        self.reason, self.detail = reason, detail

    def __reduce__(self):  # crosses actor boundaries; the default pickles only the message
        return type(self), (self.reason, self.detail)


def _staleness(r: Rollout, version: int) -> int:
    """Trainer version minus the oldest model token's version (environment tokens have none)."""
    oldest = r.min_version
    return 0 if oldest is None else version - oldest


class ReplayBufferCore(BufferLedger):
    def __init__(self, cfg: BufferConfig, pad_id: int, overlong: tuple = (0, 0, 1.0)):
        """`overlong` = Overlong(generator.max_new_tokens, trainer.overlong_buffer, trainer.overlong_penalty,
        task.max_total_tokens or 0), or its first three: the rewards that go into the group advantages get
        `rollout_shaping` (buffer 0: off), and a batch's `max_len` is the rollout's budget (total, else turn)."""
        if cfg.zero_signal == "drop" and cfg.group_size == 1:
            raise ValueError("buffer: zero_signal='drop' with group_size=1 drops every group "
                             "(one sample never has a reward spread); use zero_signal='keep'")
        self.cfg, self.pad_id = cfg, pad_id
        self.zero_signal_mode = "drop" if cfg.zero_signal == "drop" else "keep"  # auto starts at keep
        self.overlong = Overlong(*overlong)
        self.overlong_shaped = 0  # samples whose reward the overlong penalty lowered
        self.delta_ctl = DeltaController(cfg)
        # the evidence is in samples: a flat group of 2 says less than one of 16
        self.difficulty = DifficultyFilter(-(-cfg.set_aside_samples // cfg.group_size), cfg.retry_after)
        self.version = 0
        self._next_id = 0
        self._in_flight: dict[int, HeldGroup] = {}
        self._complete: dict[int, HeldGroup] = {}  # insertion order is completion order (FIFO)
        self._late: dict[int, set[int]] = {}  # dropped in flight: sample indices still expected
        self.admitted_groups = self.trained_groups = self.batches = 0
        self.dropped_groups: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.late_rollouts = self.zero_signal_groups = self.deferred_groups = 0
        self.wasted_tokens = 0  # completion tokens of samples never trained on (dropped groups, late rollouts)
        self._lease: dict[int, Lessee | None] = {}  # in-flight group -> who generates it
        self._revoked: set[Lessee] = set()  # lessees declared dead
        self._requeued: deque[int] = deque()  # in-flight groups whose generator died, to hand out again
        self.requeued_groups = 0
        self._retry: deque[PromptItem] = deque()  # prompts of groups dropped as stale, to admit again
        self.retried_prompts = 0
        self.staleness_hist: Counter[int] = Counter()
        self.wait_s_total = self.wait_s_last = 0.0
        self.delta_capped_steps = 0  # steps whose Δ exceeded what the staleness bound admits
        self._last_batch: dict | None = None  # what take_batch booked, so skip_batch can undo it

    # ---- admission ---------------------------------------------------------------------------
    @property
    def held_groups(self) -> int:
        return len(self._in_flight) + len(self._complete)

    @property
    def in_flight_groups(self) -> int:
        """Held groups not complete yet (requeued ones included): what may still become a batch."""
        return len(self._in_flight)

    def admission_limit(self) -> int:
        """Most groups that may be held right now (the smaller of the two admission bounds)."""
        c = self.cfg
        stale_cap = (c.max_staleness + self.version + 1) * c.batch_groups - self.trained_groups
        return min(stale_cap, c.batch_groups + self.delta_ctl.delta)

    def delta_effective(self) -> int:
        """The Δ admission actually lets through for the next batch: min(Δ, admission_limit − B) at
        the start of that batch's step (version max(v, batches), trained = batches·B), floored at 0.
        In steady state that is min(Δ, η·B): a larger Δ is inert, reported as `delta_capped_steps`."""
        c = self.cfg
        lag = max(self.version - self.batches, 0)  # versions that got no batch from this buffer
        return max(0, min(self.delta_ctl.delta, (c.max_staleness + lag) * c.batch_groups))

    def can_admit(self) -> bool:
        return self.held_groups + 1 <= self.admission_limit()

    def admit(self, item: PromptItem, lessee: Lessee = (0, 0)) -> PromptGroup:
        """A new group, leased to `lessee` (which generates all G samples)."""
        if not self.can_admit():
            raise RuntimeError(f"buffer: cannot admit, {self.held_groups} groups held and the limit is "
                               f"{self.admission_limit()} at version {self.version}; check can_admit()")
        g = PromptGroup(group_id=self._next_id, item=item, group_size=self.cfg.group_size,
                        admitted_version=self.version)
        self._next_id += 1
        self.admitted_groups += 1
        self._in_flight[g.group_id] = HeldGroup(g)
        self._lease[g.group_id] = lessee
        return g

    def has_retry(self) -> bool:
        return bool(self._retry)

    def admit_retry(self, lessee: Lessee) -> PromptGroup:
        """A new group for the oldest prompt whose group was dropped as stale (buffer.retry_stale);
        the caller checks can_admit() and has_retry() first."""
        self.retried_prompts += 1
        return self.admit(self._retry.popleft(), lessee)

    # ---- rollouts ----------------------------------------------------------------------------
    def add(self, rollout: Rollout, lessee: Lessee | None = None) -> None:
        """Store one sample from `lessee`; raises RolloutRejected (a ValueError) and changes nothing
        if it is bad. A sample under a revoked lease is ignored (counted late)."""
        gid, idx = rollout.group_id, rollout.sample_idx
        if self._foreign(gid, lessee, rollout.generator_id):
            self.late_rollouts += 1
            self.wasted_tokens += rollout.num_model_tokens
            return
        problem = self._problem(rollout)
        if problem is not None:
            self.rejected[problem[0]] += 1
            raise RolloutRejected(*problem)
        if gid in self._late:
            self.late_rollouts += 1
            self.wasted_tokens += rollout.num_model_tokens
            self._late[gid].discard(idx)
            if not self._late[gid]:
                del self._late[gid]
            return
        g = self._in_flight[gid]
        g.samples[idx] = rollout
        if _staleness(rollout, self.version) > self.cfg.max_staleness:
            self._drop(g, "stale")
        elif len(g.samples) == self.cfg.group_size:
            self._finish(g)

    def _problem(self, r: Rollout) -> tuple[str, str] | None:
        where = f"group={r.group_id} sample={r.sample_idx}"
        n = len(r.completion_tokens)
        if len(r.logprobs) != n or len(r.versions) != n:
            return "length_mismatch", (f"{where}: completion_tokens ({n}), logprobs ({len(r.logprobs)}) "
                                       f"and versions ({len(r.versions)}) differ in length")
        if not math.isfinite(r.reward):
            return "nan_reward", f"{where}: reward is {r.reward}"
        try:
            r.validate()
        except ValueError as e:
            return "invalid", str(e)
        if r.max_version is not None and r.max_version > self.version:
            return "future_version", (f"{where}: token version {r.max_version} is newer than the "
                                      f"trainer version {self.version}")
        if r.group_id in self._late and r.sample_idx in self._late[r.group_id]:
            return None
        g = self._in_flight.get(r.group_id)
        if g is None:
            state = "never admitted" if not 0 <= r.group_id < self._next_id else "no longer in flight"
            return "unknown_group", f"{where}: group {r.group_id} is {state}"
        if not 0 <= r.sample_idx < self.cfg.group_size:
            return "bad_sample_idx", f"{where}: sample_idx outside 0..{self.cfg.group_size - 1}"
        if r.sample_idx in g.samples:
            return "duplicate_sample", f"{where}: this sample was already added"
        return None

    def _finish(self, g: HeldGroup) -> None:
        del self._in_flight[g.group.group_id]
        self._lease.pop(g.group.group_id, None)
        rewards = [g.samples[i].reward for i in range(self.cfg.group_size)]
        self.difficulty.observe(g.group.item.prompt, rewards, self.version)
        # dynamic sampling reads the task's rewards (DAPO filters on accuracy), before any length shaping
        if max(rewards) == min(rewards):
            self.zero_signal_groups += 1
            if self.zero_signal_mode == "drop":
                self.dropped_groups["zero_signal"] += 1
                self.wasted_tokens += sum(r.num_model_tokens for r in g.samples.values())
                return
        o = self.overlong
        if o.buffer > 0:  # DAPO's overlong shaping, a turn over the prompt's own budget when it has one
            budget = min(g.group.item.max_new_tokens or o.turn, o.turn)
            shaping = [rollout_shaping(g.samples[i], budget, o) for i in range(self.cfg.group_size)]
            self.overlong_shaped += sum(1 for x in shaping if x < 0)
            rewards = [r + x for r, x in zip(rewards, shaping)]
        if max(rewards) == min(rewards):
            g.advantages = [0.0] * len(rewards)
        else:
            g.advantages = group_advantages(rewards, self.cfg.normalize_std)
        self._complete[g.group.group_id] = g

    def _drop(self, g: HeldGroup, reason: str) -> None:
        gid = g.group.group_id
        self.wasted_tokens += sum(r.num_model_tokens for r in g.samples.values())
        self._lease.pop(gid, None)
        if gid in self._requeued:
            self._requeued.remove(gid)
        if self._in_flight.pop(gid, None) is not None:
            missing = set(range(self.cfg.group_size)) - g.samples.keys()
            if missing:
                self._late[gid] = missing
        else:
            del self._complete[gid]
        self.dropped_groups[reason] += 1
        if reason == "stale" and self.cfg.retry_stale:  # never trained on: its prompt is not lost
            self._retry.append(g.group.item)

    def set_zero_signal(self, mode: str) -> None:
        """Dynamic sampling on ("drop") or off ("keep") for the groups that finish from now on
        (buffer.zero_signal=auto; see the module docstring). ValueError for another mode, for a
        mode other than an explicit buffer.zero_signal, and for "drop" with group_size 1 (every
        group would be dropped)."""
        if mode not in ("keep", "drop"):
            raise ValueError(f"buffer: set_zero_signal({mode!r}); allowed: 'keep', 'drop'")
        if self.cfg.zero_signal != "auto" and mode != self.cfg.zero_signal:
            raise ValueError(f"buffer: set_zero_signal({mode!r}) under buffer.zero_signal={self.cfg.zero_signal!r}; "
                             "only 'auto' is switched at runtime")
        if mode == "drop" and self.cfg.group_size == 1:
            raise ValueError("buffer: set_zero_signal('drop') with group_size=1 drops every group "
                             "(one sample never has a reward spread)")
        self.zero_signal_mode = mode

    # ---- versions and batches ----------------------------------------------------------------
    def set_trainer_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"buffer: trainer version went back from {self.version} to {version}")
        self.version = version
        for g in [*self._in_flight.values(), *self._complete.values()]:
            if any(_staleness(r, version) > self.cfg.max_staleness for r in g.samples.values()):
                self._drop(g, "stale")

    def ready(self) -> bool:
        """B complete groups are held; all held samples are within max_staleness (see above)."""
        return len(self._complete) >= self.cfg.batch_groups

    def take_batch(self) -> Batch:
        """The first B groups to complete, as one right-padded Batch for the current version."""
        B, G = self.cfg.batch_groups, self.cfg.group_size
        if not self.ready():
            raise RuntimeError(f"buffer: take_batch with {len(self._complete)} of {B} groups complete "
                               f"({len(self._in_flight)} in flight); check ready()")
        groups = [self._complete.pop(gid) for gid in list(self._complete)[:B]]
        samples = [(g.samples[i], g.advantages[i], g.group.group_id) for g in groups for i in range(G)]
        T = max(len(r.prompt_tokens) + len(r.completion_tokens) for r, _, _ in samples)
        N = len(samples)
        input_ids = torch.full((N, T), self.pad_id, dtype=torch.int64)
        loss_mask = torch.zeros((N, T), dtype=torch.float32)
        logprobs = torch.zeros((N, T), dtype=torch.float32)
        versions = torch.full((N, T), -1, dtype=torch.int64)
        with_teacher = [r.teacher_logprobs is not None for r, _, _ in samples]
        if any(with_teacher) and not all(with_teacher):
            raise RuntimeError("buffer: a batch mixes rollouts with and without teacher log-probs")
        teacher = torch.zeros((N, T), dtype=torch.float32) if all(with_teacher) else None
        for i, (r, _, _) in enumerate(samples):
            p, c = len(r.prompt_tokens), len(r.completion_tokens)
            input_ids[i, :p + c] = torch.tensor(r.prompt_tokens + r.completion_tokens, dtype=torch.int64)
            if c:  # environment tokens (version -1, multi-turn) stay out of the loss
                versions[i, p:p + c] = torch.tensor(r.versions, dtype=torch.int64)
                loss_mask[i, p:p + c] = (versions[i, p:p + c] >= 0).float()
                logprobs[i, p:p + c] = torch.tensor(r.logprobs, dtype=torch.float32)
                if teacher is not None:
                    teacher[i, p:p + c] = torch.tensor(r.teacher_logprobs, dtype=torch.float32)
            self.staleness_hist[_staleness(r, self.version)] += 1
        self.trained_groups += B
        self.batches += 1
        self.deferred_groups += self.held_groups  # carried over into the next step, not dropped
        self._last_batch = {"ids": sorted(g.group.group_id for g in groups), "deferred": self.held_groups,
                            "tokens": sum(r.num_model_tokens for r, _, _ in samples),
                            "staleness": Counter(_staleness(r, self.version) for r, _, _ in samples)}
        return Batch(input_ids=input_ids, loss_mask=loss_mask, behaviour_logprobs=logprobs,
                     versions=versions, advantages=torch.tensor([a for _, a, _ in samples], dtype=torch.float32),
                     rewards=torch.tensor([r.reward for r, _, _ in samples], dtype=torch.float32),
                     group_ids=tuple(gid for _, _, gid in samples), trainer_version=self.version,
                     truncated=torch.tensor([r.finish_reason == "length" for r, _, _ in samples], dtype=torch.bool),
                     teacher_logprobs=teacher, max_len=self.overlong.total or self.overlong.turn)

    def skip_batch(self, group_ids: Iterable[int]) -> int:
        """The trainer skipped the step of the last batch taken (non-finite loss or gradient, no loss
        tokens): book its groups as dropped ("skipped_step", their tokens wasted) instead of trained,
        and undo the batch's other counts. The identity holds, and since trained_groups falls back,
        the staleness bound gives their B slots back at the unchanged version. `group_ids` must name
        that batch (Batch.group_ids); each batch can be given back once. Returns the groups dropped."""
        ids, last = sorted(set(group_ids)), self._last_batch
        if last is None or ids != last["ids"]:
            raise ValueError(f"buffer: skip_batch of groups {ids}, but the last batch taken and not given back "
                             f"is {last['ids'] if last else 'none'}")
        self._last_batch = None
        self.trained_groups -= len(ids)
        self.batches -= 1
        self.deferred_groups -= last["deferred"]
        self.staleness_hist -= last["staleness"]
        self.dropped_groups["skipped_step"] += len(ids)
        self.wasted_tokens += last["tokens"]
        return len(ids)

    def end_step(self, mean_reward: float) -> int:
        """Feed the step's mean reward to the Δ controller; returns Δ for the next step (and counts
        the step in `delta_capped_steps` if the staleness bound will not let all of it through)."""
        delta = self.delta_ctl.update(mean_reward)
        if delta > self.delta_effective():
            self.delta_capped_steps += 1
        return delta

    def record_wait(self, seconds: float) -> None:
        """Time the trainer spent waiting for the batch it just took (measured by the caller)."""
        self.wait_s_last = seconds
        self.wait_s_total += seconds
