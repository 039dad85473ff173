"""Is there a learning signal? GRPO learns only from groups whose rewards differ: a group whose
samples all got the same reward has advantage 0 for every sample, so it adds nothing to the
gradient. Pure rules on reward lists and metric rows (no actors), read by the warm start
(pipeline/driver/warm_start.py), the pre-flight line and the zero-signal alarm (pipeline/driver/hooks.py).

    p = Probe.of(per_prompt_rewards, group_size=8)    # held-out: pass@8, mean reward, share with a spread
    facts = RunFacts.of(cfg, warm_steps=0)            # buffer.zero_signal, a teacher, run.steps, ...
    on, why = dynamic_sampling(p, facts)              # buffer.zero_signal=auto: drop flat groups?
    preflight(p, facts)                               # "pre-flight: held-out pass@8 = 0.03, ...: most groups ..."
    rule = WarmStartRule.of(cfg.run)
    why = rule.decide(steps=20, probe=p, losses=[1.9, 1.2])   # a reason to stop, or None: go on
    watch = SignalWatch(share=0.9, patience=20, stop_after=100)
    event = watch.update(step, StepSignal.of(metrics, flat_values, batch_groups, dropped_flat))
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from math import comb
from typing import Any

NONE_SOLVED_KNOBS = ("a longer warm start (run.warm_start_steps=auto with a higher run.warm_start_max_steps, "
                     "or more steps), a higher generator.temperature, a larger buffer.group_size (more tries per "
                     "prompt), or easier prompts")
ALL_SOLVED_KNOBS = ("harder prompts (the difficulty filter, buffer.set_aside_samples, sets solved ones aside "
                    "for a while, but cannot make new ones), or buffer.zero_signal=drop (groups without a spread "
                    "are dropped and replaced); a shorter warm start if the demonstrations taught the answers")
COLLAPSE_KNOBS = ("trainer.entropy_target (adaptive entropy bonus), trainer.kl_coef up, trainer.lr down, "
                  "a higher generator.temperature")
SIGNAL_SHARE = 0.5
"""Below this share of held-out groups with a reward spread the pre-flight line warns and
buffer.zero_signal=auto turns dynamic sampling on (down to DROP_FLOOR)."""
DROP_FLOOR = 0.1
"""buffer.zero_signal=auto keeps below this share: dynamic sampling would drop nearly every group, a
batch of B groups with a spread would take more than 10·B sampled, and at 0 none would ever fill
(the run would end on buffer.batch_timeout_s, not on the zero-signal alarm that names the cause)."""
SHORT_RUN = 20
"""A run of fewer steps (or of fewer than run.no_signal_patience) may end before the zero-signal alarm fires."""
TEACHER_LEVER = "a teacher (trainer.recipe=opd or opd+grpo with teacher.hf_dir=<dir>)"
SELF_DISTILL_LEVER = ("self-distillation with the dataset's answer column (one of those recipes with "
                      "teacher.hf_dir=self teacher.context='The correct final answer is {answer}.')")
WARM_START_LEVER = ("a warm start (run.warm_start_steps=auto, up to run.warm_start_max_steps; needs "
                    "task.solution_column or a task with demonstration())")


def spread_chance(rewards: list[float], g: int) -> float:
    """The chance that g of these rewards drawn without replacement are not all equal (a group of
    size g with a reward spread): 1 - sum over distinct values v of C(c_v, g) / C(n, g), the unbiased
    estimate in the way pass@k is one. Needs 2 <= g <= n; g = n is 1 if any two differ, else 0."""
    n = len(rewards)
    if not 2 <= g <= n:
        raise ValueError(f"spread_chance: n={n}, g={g}; need 2 <= g <= n")
    return 1.0 - sum(comb(c, g) for c in Counter(rewards).values()) / comb(n, g)


@dataclass(frozen=True)
class Probe:
    """Held-out figures of groups of size `k` (one probe: each prompt sampled k times or more).
    `spread`: the share of groups with a reward spread; `pass_at_k`: of prompts solved (reward >= 1)
    at least once in k tries; `pass_rate`: of samples with reward >= 1; `binary`: every reward is 0 or 1.
    NaN figures when no prompt has k usable samples."""

    k: int
    prompts: int
    mean_reward: float
    pass_rate: float
    pass_at_k: float
    spread: float
    binary: bool

    @classmethod
    def of(cls, per_prompt: list[list[float]], k: int) -> "Probe":
        full = [r for r in per_prompt if len(r) >= k]
        flat = [x for r in full for x in r]
        if not full:
            nan = float("nan")
            return cls(k, 0, nan, nan, nan, nan, False)
        n = len(full)
        return cls(k=k, prompts=n, mean_reward=sum(flat) / len(flat),
                   pass_rate=sum(x >= 1.0 for x in flat) / len(flat),
                   pass_at_k=sum(1.0 - comb(len(r) - sum(x >= 1.0 for x in r), k) / comb(len(r), k) for r in full) / n,
                   spread=sum(spread_chance(r, k) for r in full) / n if k >= 2 else 0.0,
                   binary=all(x in (0.0, 1.0) for x in flat))

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/pass@group": self.pass_at_k, f"{prefix}/mean_reward": self.mean_reward,
                f"{prefix}/spread_share": self.spread, f"{prefix}/pass_rate": self.pass_rate}

    def text(self) -> str:
        return (f"held-out pass@{self.k} = {self.pass_at_k:.2f}, mean reward {self.mean_reward:.3f}, "
                f"{self.spread:.2f} of groups of {self.k} have a reward spread")


@dataclass(frozen=True)
class RunFacts:
    """What the pre-flight line and buffer.zero_signal=auto read besides the probe: the setting,
    whether a teacher scores every token (teacher.hf_dir set and trainer.distill_coef > 0), the
    warm-start steps taken before RL, run.steps and run.no_signal_patience (0: not known)."""

    zero_signal: str = "keep"
    teacher: bool = False
    warm_steps: int = 0
    steps: int = 0
    patience: int = 0

    @classmethod
    def of(cls, cfg: Any, warm_steps: int) -> "RunFacts":
        return cls(cfg.buffer.zero_signal, bool(cfg.teacher.hf_dir) and cfg.trainer.distill_coef > 0, warm_steps,
                   cfg.run.steps, cfg.run.no_signal_patience)


def dynamic_sampling(p: Probe | None, facts: RunFacts) -> tuple[bool, str]:
    """Whether groups without a reward spread are dropped (DAPO dynamic sampling), and why.
    buffer.zero_signal=keep|drop decides by itself. auto: off with a teacher (per-token distillation
    gives every group a signal); off without a probe (`p` None, or no prompt with k samples); on
    when fewer than SIGNAL_SHARE of the held-out groups have a reward spread, but not fewer than
    DROP_FLOOR (then nearly every group would be dropped, and batches would starve); else off."""
    if facts.zero_signal != "auto":
        return facts.zero_signal == "drop", f"buffer.zero_signal={facts.zero_signal}"
    if facts.teacher:
        return False, "buffer.zero_signal=auto with a teacher, whose per-token distillation gives every group a signal"
    if p is None or not p.prompts:
        return False, "buffer.zero_signal=auto without a pre-flight probe"
    share = f"{p.spread:.2f} of held-out groups have a reward spread"
    if p.spread < DROP_FLOOR:
        return False, (f"buffer.zero_signal=auto, {share}, under {DROP_FLOOR:g}: dropping the others would "
                       "starve the batches")
    if p.spread < SIGNAL_SHARE:
        return True, f"buffer.zero_signal=auto, {share}, under {SIGNAL_SHARE:g}"
    return False, f"buffer.zero_signal=auto, {share}, at least {SIGNAL_SHARE:g}"


def preflight(p: Probe, facts: RunFacts = RunFacts()) -> tuple[str, bool]:
    """The pre-flight line (after the warm start, before RL) and whether it is a warning: what the
    held-out probe implies for GRPO and, for buffer.zero_signal=auto, what dynamic_sampling chose.
    Below SIGNAL_SHARE of groups with a reward spread it is a warning with the numbers (share,
    mean reward, pass rate), the choice and why, the levers that apply (a teacher, self-distillation,
    a warm start, the cause's knobs) and, for a short run, that it may end before the zero-signal
    alarm fires."""
    on, why = dynamic_sampling(p, facts)
    if not p.prompts:
        tail = f"; dynamic sampling off ({why})" if facts.zero_signal == "auto" else ""
        return f"pre-flight: no held-out prompt had {p.k} usable samples; nothing to say about the signal{tail}", True
    head = f"pre-flight: {p.text()}: "
    if p.spread >= SIGNAL_SHARE:
        tail = f" (dynamic sampling {'on' if on else 'off'}: {why})" if facts.zero_signal == "auto" else ""
        return head + "most groups carry a learning signal for GRPO" + tail, False
    solved = p.mean_reward >= 0.5
    cause = ("the policy solves nearly every prompt every time" if solved
             else f"the policy rarely solves a prompt in {p.k} tries")
    effect = ("GRPO gets almost no gradient" if p.spread < 0.1
              else "GRPO learns from those groups only, the others add no gradient")
    if facts.teacher:  # the teacher's per-token advantage reaches every group
        effect += " from the reward; the teacher's per-token signal reaches every group"
    choice = (f"dynamic sampling on ({why}): groups without a spread are dropped and replaced by new prompts"
              if on else f"dynamic sampling off ({why})")
    levers = [] if facts.teacher else [TEACHER_LEVER, SELF_DISTILL_LEVER]
    if facts.zero_signal == "keep" and not facts.teacher:
        levers.append("dynamic sampling (buffer.zero_signal=auto or drop)")
    if solved:
        levers.append("harder prompts (the difficulty filter, buffer.set_aside_samples, sets solved ones aside "
                      "for a while)" + ("; a shorter warm start if the demonstrations taught the answers"
                                        if facts.warm_steps else ""))
    else:
        levers += [WARM_START_LEVER if not facts.warm_steps else
                   "a longer warm start (a higher run.warm_start_max_steps, or more steps)",
                   "a higher generator.temperature, a larger buffer.group_size (more tries per prompt), or easier prompts"]
    out = (head[:-2] + f", pass rate {p.pass_rate:.3f}: most groups will have no reward spread ({cause}), so "
           f"{effect}; {choice}; other levers: " + "; ".join(levers))
    if facts.teacher:
        return out, True
    if facts.steps and facts.steps < facts.patience:
        out += (f". run.steps={facts.steps} is below run.no_signal_patience={facts.patience}: the run ends before "
                "the zero-signal alarm can fire")
    elif facts.steps and facts.steps < SHORT_RUN:
        out += (f". run.steps={facts.steps} is a short run: it may end before the zero-signal alarm "
                f"(run.no_signal_patience={facts.patience} steps in a row without signal) can fire")
    return out, True


@dataclass(frozen=True)
class WarmStartRule:
    """When run.warm_start_steps=auto stops: `decide` gives the reason to stop after `steps`
    supervised steps, or None to go on. In this order: the probe shows signal (a share of at least
    `signal` of held-out groups with a reward spread and, for a 0/1 reward, a pass rate in
    [pass_min, pass_max]); a 0/1 pass rate above pass_max; the last chunk's mean loss less than
    `min_loss_drop` (relative) below the one before; `max_steps` reached.

    Example:
        rule = WarmStartRule(signal=0.5, pass_min=0.1, pass_max=0.9, min_loss_drop=0.03, max_steps=200)
        rule.decide(10, probe, [2.1])   # None: go on (no signal yet, one chunk's loss only)
    """

    signal: float
    pass_min: float
    pass_max: float
    min_loss_drop: float
    max_steps: int

    @classmethod
    def of(cls, run: Any) -> "WarmStartRule":
        return cls(run.warm_start_signal, run.warm_start_pass_min, run.warm_start_pass_max,
                   run.warm_start_min_loss_drop, run.warm_start_max_steps)

    def decide(self, steps: int, probe: Probe | None, losses: list[float]) -> str | None:
        if probe is not None and probe.prompts:
            band = probe.binary and not self.pass_min <= probe.pass_rate <= self.pass_max
            if probe.spread >= self.signal and not band:
                extra = (f", pass rate {probe.pass_rate:.2f} in {self.pass_min:g}..{self.pass_max:g}"
                         if probe.binary else "")
                return f"{probe.spread:.2f} of held-out groups have a reward spread (target {self.signal:g}){extra}"
            if probe.binary and probe.pass_rate > self.pass_max:
                return (f"the held-out pass rate {probe.pass_rate:.2f} is above run.warm_start_pass_max="
                        f"{self.pass_max:g} (more demonstrations would only take the reward spread away)")
        if self.min_loss_drop and len(losses) >= 2 and losses[-2] > 0:
            drop = (losses[-2] - losses[-1]) / losses[-2]
            if drop < self.min_loss_drop:
                return (f"the demonstration loss stopped falling ({losses[-2]:.4f} -> {losses[-1]:.4f}, "
                        f"{drop:.1%} < run.warm_start_min_loss_drop={self.min_loss_drop:g})")
        if steps >= self.max_steps:
            return f"run.warm_start_max_steps={self.max_steps} reached"
        return None


@dataclass(frozen=True)
class StepSignal:
    """One RL step's signal figures: `flat_share`, the share of the groups that finished in it without
    a reward spread (the trained batch's, plus the groups buffer.zero_signal=drop dropped); the
    common reward of each flat group of the batch (`flat_values`, which tells solved from unsolved);
    the batch's mean reward, pass rate (reward >= 1) and the policy's mean token entropy."""

    flat_share: float
    flat_values: tuple[float, ...]
    mean_reward: float
    pass_rate: float
    entropy: float

    @classmethod
    def of(cls, metrics: dict, flat_values: list[float], batch_groups: int, dropped_flat: int,
           pass_rate: float) -> "StepSignal":
        zvf = float(metrics.get("groups/zero_variance_frac", 0.0))
        share = (zvf * batch_groups + dropped_flat) / max(batch_groups + dropped_flat, 1)
        return cls(share, tuple(flat_values), float(metrics.get("reward/mean", float("nan"))), pass_rate,
                   float(metrics.get("entropy", float("nan"))))


@dataclass
class SignalWatch:
    """The zero-signal alarm. A step is without signal when its flat_share >= `share`. After
    `patience` such steps in a row: one warning (once per run), with the numbers and the knobs for
    each cause, told apart by the flat groups' rewards (all >= 1: always solved; all <= 0: never
    solved; else equal partial rewards, identical samples: collapse). After `stop_after` in a row
    (0: never) the run is to stop: `update` returns ("stop", message). A step with signal resets the streak.

    Example:
        watch = SignalWatch(share=0.9, patience=2, stop_after=3)
        [watch.update(s, flat) for s in (1, 2, 3)]   # [None, ("warn", ...), ("stop", ...)]
    """

    share: float
    patience: int
    stop_after: int
    streak: int = 0
    warned: bool = False
    causes: Counter = field(default_factory=Counter)
    last: StepSignal | None = None

    def update(self, step: int, s: StepSignal) -> tuple[str, str] | None:
        self.last = s
        if not (s.flat_share >= self.share):
            self.streak = 0
            self.causes.clear()
            return None
        self.streak += 1
        self.causes.update("solved" if v >= 1.0 else "unsolved" if v <= 0.0 else "equal" for v in s.flat_values)
        if self.stop_after and self.streak >= self.stop_after:
            return "stop", (f"step {step}: stopping early (run.stop_without_signal={self.stop_after}): "
                            + self.message())
        if self.streak >= self.patience and not self.warned:
            self.warned = True
            tail = (f" The run stops after run.stop_without_signal={self.stop_after} such steps in a row."
                    if self.stop_after else "")
            return "warn", f"step {step}: " + self.message() + tail
        return None

    def message(self) -> str:
        """The numbers of the current streak and, for each cause seen in it, its share and knobs."""
        s = self.last
        ent = f"{s.entropy:.3g}" if math.isfinite(s.entropy) else "n/a"
        out = (f"no learning signal: {self.streak} steps in a row with at least {self.share:g} of the groups "
               f"without a reward spread (last step: {s.flat_share:.2f}; mean reward {s.mean_reward:.3f}, pass rate "
               f"{s.pass_rate:.3f}, policy entropy {ent}), so GRPO's advantages and gradient are 0.")
        n = sum(self.causes.values())
        for cause, what, knobs in (("unsolved", "never solved (reward 0)", NONE_SOLVED_KNOBS),
                                   ("solved", "always solved (reward 1)", ALL_SOLVED_KNOBS),
                                   ("equal", "equal partial rewards (identical samples: entropy collapse?)",
                                    COLLAPSE_KNOBS)):
            if self.causes[cause]:
                out += f" {self.causes[cause] / n:.0%} of these groups were {what}: try {knobs}."
        return out

    def summary(self) -> dict[str, Any]:
        s = self.last
        return {"streak": self.streak, "flat_share": s.flat_share if s else None,
                "mean_reward": s.mean_reward if s else None, "pass_rate": s.pass_rate if s else None,
                "entropy": s.entropy if s else None, "causes": dict(self.causes)}
