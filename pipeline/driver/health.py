"""Is the policy still learning? Per-batch signals of collapse, and a watch that warns on them.

Pure functions on a Batch and on metric rows (no actors). An RL run on a task nobody tuned for
fails in a recognisable way: the policy's entropy falls towards 0, its responses shrink towards
EOS alone, every group's completions become identical, so every group's rewards are equal and
group-relative advantages (and the gradient) are 0. These are the numbers that show it:

    response/length_mean      mean completion tokens per sample (EOS included)
    response/length_min       the shortest completion in the batch
    response/eos_only_frac    fraction of samples whose completion is one token (EOS alone)
    groups/zero_variance_frac fraction of the batch's groups whose rewards are all equal

`CollapseWatch` turns the trainer's `entropy` and `response/length_mean` into one warning when
either stays under its floor for `patience` steps in a row (run.collapse_*), and another when the
run recovers. The warning names the knobs that help (README "When learning goes wrong").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.types import Batch

KNOBS = ("turn trainer.lr down, trainer.kl_coef up (KL to the warm-started policy) or set "
         "trainer.entropy_target (adaptive entropy bonus); buffer.zero_signal=drop keeps groups "
         "without signal out of the batches")


def batch_health(batch: Batch) -> dict[str, float]:
    """Response-length and reward-variance metrics of one trained batch (see the module docstring)."""
    lengths = batch.loss_mask.sum(dim=1)
    groups: dict[int, list[float]] = {}
    for gid, r in zip(batch.group_ids, batch.rewards.tolist()):
        groups.setdefault(gid, []).append(r)
    flat = sum(1 for rs in groups.values() if max(rs) - min(rs) <= 1e-9)
    return {"response/length_mean": float(lengths.float().mean()), "response/length_min": float(lengths.min()),
            "response/eos_only_frac": float((lengths <= 1).float().mean()),
            "groups/zero_variance_frac": flat / max(len(groups), 1)}


@dataclass
class CollapseWatch:
    """Warns once when entropy < entropy_floor or mean length < length_floor holds for `patience`
    steps in a row, and once more when neither holds again. A floor of 0 is off."""

    entropy_floor: float
    length_floor: float
    patience: int
    streak: int = 0
    collapsed: bool = False
    steps_collapsed: int = 0

    def update(self, step: int, metrics: dict) -> str | None:
        """Feed one step's metrics; returns a message to log, or None. Sets metrics["collapse/active"]."""
        why = self._why(metrics)
        self.streak = self.streak + 1 if why else 0
        msg = None
        if why and self.streak >= self.patience and not self.collapsed:
            self.collapsed = True
            msg = (f"step {step}: the policy looks collapsed ({why} for {self.streak} steps in a row); "
                   f"the gradient vanishes once every group's rewards are equal. To fix: {KNOBS}")
        elif not why and self.collapsed:
            self.collapsed = False
            msg = f"step {step}: the policy recovered (entropy and response length above their floors)"
        self.steps_collapsed += self.collapsed
        metrics["collapse/active"] = float(self.collapsed)
        return msg

    def _why(self, m: dict) -> str:
        parts = []
        ent, length = m.get("entropy"), m.get("response/length_mean")
        if self.entropy_floor > 0 and _finite(ent) and ent < self.entropy_floor:
            parts.append(f"entropy {ent:.3g} < run.collapse_entropy={self.entropy_floor:g}")
        if self.length_floor > 0 and _finite(length) and length < self.length_floor:
            parts.append(f"mean response length {length:.3g} < run.collapse_length={self.length_floor:g}")
        return " and ".join(parts)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

