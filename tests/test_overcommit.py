"""Δ controller (OPPO) and the over-commitment simulator.

    .venv/bin/python -m pytest -q tests/test_overcommit.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from pipeline.config import BufferConfig
from pipeline.overcommit import DeltaController, reward_slope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import overcommit_sim  # noqa: E402


def ctl(mode="adaptive", **kw) -> DeltaController:
    base = dict(overcommit=mode, delta=2, delta_min=1, delta_max=5, window=4, slope_threshold=0.01)
    return DeltaController(BufferConfig(**{**base, **kw}))


def test_reward_slope_is_least_squares():
    assert reward_slope([1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert reward_slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        reward_slope([1.0])


def test_rising_reward_grows_delta_to_max_and_no_further():
    c = ctl()
    seen = [c.update(0.05 * step) for step in range(12)]
    assert seen[:3] == [2, 2, 2]  # holds until the window is full
    assert seen[3:6] == [3, 4, 5] and max(seen) == 5 and seen[-1] == 5
    assert c.last_slope == pytest.approx(0.05)


def test_flat_reward_decays_delta_to_min_and_no_further():
    c = ctl(delta=5)
    rng = random.Random(0)
    seen = [c.update(0.5 + rng.uniform(-0.01, 0.01)) for _ in range(12)]  # noise well under the threshold
    assert seen[3:7] == [4, 3, 2, 1] and min(seen) == 1 and seen[-1] == 1


def test_rise_then_plateau_grows_then_shrinks():
    c = ctl(delta=1)
    rewards = [min(0.1 * s, 0.6) for s in range(30)]
    seen = [c.update(r) for r in rewards]
    assert max(seen) == 5 and seen[-1] == 1 and all(1 <= d <= 5 for d in seen)
    assert list(c.history)[1:] == seen


def test_fixed_and_none_modes_ignore_reward():
    fixed, none = ctl("fixed", delta=3), ctl("none", delta=3)
    for s in range(10):
        assert fixed.update(0.1 * s) == 3 and none.update(0.1 * s) == 0
    assert fixed.bound == 3 and none.bound == 0 and ctl().bound == 5


def test_start_clamped_nan_rejected_and_state_round_trip():
    assert ctl(delta=9).delta == 5 and ctl(delta=0).delta == 1
    c = ctl()
    with pytest.raises(ValueError, match="nan"):
        c.update(float("nan"))
    for s in range(5):
        c.update(0.1 * s)
    d = ctl()
    d.load_state_dict(c.state_dict())
    assert d.delta == c.delta and d.update(0.5) == c.update(0.5)


def test_simulator_overcommit_beats_plain_batching_and_writes_outputs(tmp_path):
    res = overcommit_sim.main(["--steps", "30", "--out", str(tmp_path), "--no-progress"])
    assert set(res) == {"none", "fixed", "adaptive"}
    assert res["fixed"]["samples_per_s"] > 1.2 * res["none"]["samples_per_s"]  # long tail deferred
    assert res["none"]["deferred_groups"] == 0 and res["fixed"]["deferred_groups"] > 0
    for r in res.values():
        assert r["mean_staleness"] <= 2 and len(r["delta_history"]) == 31
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["results"]["fixed"]["mean_delta"] == 4
    assert (tmp_path / "overcommit.png").stat().st_size > 10_000
