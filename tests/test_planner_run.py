"""The planner against a real run made here and now: a short tools/pipeline_bench.py pair (sync then
async, the real CLI: Monarch procs, the vLLM engine, the torchtitan trainer, shm pushes) checked
by `tools/plan.py validate`'s comparison, as docs/planner.md's table is made, only shorter.

The machine running the suite is not the one the committed cost file was calibrated on (and CI's is
loaded), so the prediction checked is the one "from the sync arm": the cost file's shapes at the
speeds the real sync run showed (validate's `_sync_scaled`), which never reads the async run. The
bounds are wider than the issue's targets (10%, 0.05) because a pair of 8-step runs varies more than
the medians of three 12-step repeats: here 30% on the ratio and 0.1 on idle and drops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.sim import load_costs
from tools.plan_validate import collect, compare

REPO = Path(__file__).resolve().parents[1]


def test_short_real_pair_is_predicted_from_its_sync_arm(tmp_path):
    out = tmp_path / "e1_s1"
    proc = subprocess.run([sys.executable, "tools/pipeline_bench.py", "--repeats", "1", "--steps", "8",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = collect(tmp_path)
    assert list(runs) == ["e1_s1"] and len(runs["e1_s1"]["sync"]) == len(runs["e1_s1"]["async"]) == 1
    case = compare("e1_s1", runs["e1_s1"], load_costs(REPO / "tools" / "plan_data" / "costs_here.json"),
                   *runs["e1_s1"]["spec"])
    real, pred = case["real"], case["predicted_from_sync_arm"]
    print(f"ratio real {case['ratio_real']:.2f}, from the sync arm {case['ratio_from_sync_arm']:.2f}; "
          + "; ".join(f"{m} {k} real {real[m][k]:.2f} predicted {pred[m][k]:.2f}" for m in ("sync", "async")
                      for k in ("trainer_idle_frac", "dropped_frac")))
    assert real["async"]["dropped_frac"] > 0  # max_staleness 1 with a long tail drops something
    assert abs(case["ratio_error_from_sync_arm"]) <= 0.30, case["ratio_error_from_sync_arm"]
    for mode in ("sync", "async"):
        for key in ("trainer_idle_frac", "dropped_frac"):
            assert abs(pred[mode][key] - real[mode][key]) <= 0.10, (mode, key, pred[mode][key], real[mode][key])
