"""OPPO over-commitment: how many groups beyond B the buffer keeps in flight (Δ).

The trainer asks for B groups per step; the buffer keeps B + Δ in flight, hands over the first B
that complete and defers the rest to the next step, so a long-tail sample delays no step.
`DeltaController` picks Δ per `BufferConfig.overcommit`:

    none      Δ = 0 (plain batching: the next batch is admitted only as the last one leaves)
    fixed     Δ = buffer.delta
    adaptive  OPPO: s = least-squares slope of the mean reward over the last `window` steps,
              SE its standard error, t = s / SE (n − 2 degrees of freedom);
              t > slope_tstat → Δ + 1 (capped at delta_max), else Δ − 1 (floored at delta_min).
              Rising reward buys throughput; a flat curve (convergence) decays Δ to delta_min,
              which removes the staleness over-commitment costs. Δ starts at `delta` clamped into
              [delta_min, delta_max] and holds until the window is full.

Why a t-statistic rather than the sign of s: on a noisy plateau the sign of s is a coin flip, so a
threshold at 0 makes Δ random-walk across its range. Requiring a *significant* rise (t > 2: about a
5% false-positive rate per step with w = 8) keeps Δ at delta_min there, with at most brief +1
excursions, and needs no knowledge of the reward's scale or noise level. Decay is −1 per step,
symmetric with growth, so one false positive costs one step of Δ + 1.

    ctl = DeltaController(cfg.buffer)
    for step in ...:
        ... train on a batch ...
        ctl.update(batch.rewards.mean().item())   # -> the Δ for the next step

No concurrency controller lives here: each generator keeps N' requests in flight itself (CoPRIS).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

from pipeline.config import BufferConfig

__all__ = ["DeltaController", "reward_slope", "slope_tstat"]

_HISTORY = 4096  # Δ values kept for metrics; a long run logs Δ each step through stats() anyway


def reward_slope(values: Sequence[float]) -> float:
    """Least-squares slope of `values` against 0, 1, 2, ... (reward units per step)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"reward_slope: need at least 2 points, got {n}")
    x_mean = (n - 1) / 2
    y_mean = sum(values) / n
    sxx = sum((i - x_mean) ** 2 for i in range(n))
    sxy = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    return sxy / sxx


def slope_tstat(values: Sequence[float]) -> tuple[float, float]:
    """(least-squares slope, slope / its standard error) of `values` against 0, 1, 2, ...

    SE = sqrt(Σ residual² / (n − 2) / Σ (x − x̄)²). Points exactly on a line have SE = 0: t is then
    ±inf with the slope's sign, and 0 for a constant sequence.
    """
    n = len(values)
    if n < 3:
        raise ValueError(f"slope_tstat: need at least 3 points for a standard error, got {n}")
    s = reward_slope(values)
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    sxx = sum((i - x_mean) ** 2 for i in range(n))
    rss = sum((y - y_mean - s * (i - x_mean)) ** 2 for i, y in enumerate(values))
    se = math.sqrt(rss / (n - 2) / sxx)
    if se == 0:
        return s, math.copysign(math.inf, s) if s else 0.0
    return s, s / se


class DeltaController:
    """Δ for the next step, from the mode and (adaptive) the reward slope over the window."""

    def __init__(self, cfg: BufferConfig):
        self.mode = cfg.overcommit
        self.delta_min, self.delta_max = cfg.delta_min, cfg.delta_max
        self.window, self.tstat = cfg.window, cfg.slope_tstat
        if self.mode == "none":
            start = 0
        elif self.mode == "fixed":
            start = cfg.delta
        else:
            start = min(max(cfg.delta, self.delta_min), self.delta_max)
        self._delta = start
        self._rewards: deque[float] = deque(maxlen=self.window)
        self.last_slope: float | None = None
        self.last_tstat: float | None = None
        self.history: deque[int] = deque([start], maxlen=_HISTORY)

    @property
    def delta(self) -> int:
        return self._delta

    @property
    def bound(self) -> int:
        """Largest Δ this controller can ever return (sizes the buffer's worst-case occupancy)."""
        return self.delta_max if self.mode == "adaptive" else self._delta

    def update(self, mean_reward: float) -> int:
        """Record one step's mean reward; return the Δ for the next step."""
        if not math.isfinite(mean_reward):
            raise ValueError(f"DeltaController.update: mean reward is {mean_reward}")
        self._rewards.append(float(mean_reward))
        if self.mode == "adaptive" and len(self._rewards) == self.window:
            self.last_slope, self.last_tstat = slope_tstat(self._rewards)
            if self.last_tstat > self.tstat:
                self._delta = min(self._delta + 1, self.delta_max)
            else:
                self._delta = max(self._delta - 1, self.delta_min)
        self.history.append(self._delta)
        return self._delta

    def state_dict(self) -> dict:
        return {"delta": self._delta, "rewards": list(self._rewards), "last_slope": self.last_slope,
                "last_tstat": self.last_tstat, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        if self.mode == "adaptive":  # fixed/none keep the configured Δ; the range may have changed
            self._delta = min(max(int(state["delta"]), self.delta_min), self.delta_max)
        self._rewards = deque(state["rewards"], maxlen=self.window)
        self.last_slope = state["last_slope"]
        self.last_tstat = state.get("last_tstat")  # absent in checkpoints from before the t-test
        self.history = deque(state["history"], maxlen=_HISTORY)
