"""OPPO over-commitment: how many groups beyond B the buffer keeps in flight (Δ).

The trainer asks for B groups per step; the buffer keeps B + Δ in flight, hands over the first B
that complete and defers the rest to the next step, so a long-tail sample delays no step.
`DeltaController` picks Δ per `BufferConfig.overcommit`:

    none      Δ = 0 (plain batching: the next batch is admitted only as the last one leaves)
    fixed     Δ = buffer.delta
    adaptive  OPPO: s = least-squares slope of the mean reward over the last `window` steps;
              s > slope_threshold → Δ + 1 (capped at delta_max), else Δ − 1 (floored at delta_min).
              Rising reward buys throughput; a flat curve (convergence) decays Δ to delta_min,
              which removes the staleness over-commitment costs. Δ starts at `delta` clamped into
              [delta_min, delta_max] and holds until the window is full.

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

__all__ = ["DeltaController", "reward_slope"]

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


class DeltaController:
    """Δ for the next step, from the mode and (adaptive) the reward slope over the window."""

    def __init__(self, cfg: BufferConfig):
        self.mode = cfg.overcommit
        self.delta_min, self.delta_max = cfg.delta_min, cfg.delta_max
        self.window, self.threshold = cfg.window, cfg.slope_threshold
        if self.mode == "none":
            start = 0
        elif self.mode == "fixed":
            start = cfg.delta
        else:
            start = min(max(cfg.delta, self.delta_min), self.delta_max)
        self._delta = start
        self._rewards: deque[float] = deque(maxlen=self.window)
        self.last_slope: float | None = None
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
            self.last_slope = reward_slope(self._rewards)
            if self.last_slope > self.threshold:
                self._delta = min(self._delta + 1, self.delta_max)
            else:
                self._delta = max(self._delta - 1, self.delta_min)
        self.history.append(self._delta)
        return self._delta

    def state_dict(self) -> dict:
        return {"delta": self._delta, "rewards": list(self._rewards), "last_slope": self.last_slope,
                "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        if self.mode == "adaptive":  # fixed/none keep the configured Δ; the range may have changed
            self._delta = min(max(int(state["delta"]), self.delta_min), self.delta_max)
        self._rewards = deque(state["rewards"], maxlen=self.window)
        self.last_slope = state["last_slope"]
        self.history = deque(state["history"], maxlen=_HISTORY)
