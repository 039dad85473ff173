"""What each recipe's clip does at trainer.minibatches > 1: clip fractions and held-out accuracy per run.

    .venv/bin/python -m tools.compare.minibatch_clips [RUNS_DIR] [--json docs/results/data/audit-minibatches-smollm2.json]

RUNS_DIR (default outputs/mb_smollm2) holds one run directory per recipe and seed, named
<recipe>_s<seed> (dapo_s0, gspo_s1, ...), each with its metrics.jsonl; a file <recipe>_s<seed>.time
beside it (the runner's "start ..." / "end ... rc N wall_s S" lines) gives the exit code and the
wall time, else the last row's time_s does. Prints, per recipe, the mean over seeds (min..max) of
each clip fraction averaged over the run's training steps, the held-out accuracy at step 0 and at
the last evaluation, and the wall time; then each run's per-step fractions. --json writes the raw
per-step numbers and the per-run means (docs/results/audit-minibatches.md, the SmolLM2 section).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from tools.lib.metrics import EVALS, read_rows
from tools.lib.report import markdown_table
from tools.lib.views import MINIBATCH_HEADER, minibatch_rows

CLIPS = ("clip_frac", "clip_low_frac", "clip_high_frac", "seq_clip_frac", "seq_ratio_mean", "seq_ratio_std",
         "cispo_clip_frac", "overlong_filtered_frac", "is_clip_frac", "dual_clip_frac")
"""Per-step figures the trainer writes (pipeline/trainer/step.py): a step's value is the mean over its
optimizer steps. seq_* only with a sequence-level ratio (gspo), cispo_clip_frac only with cispo."""
STEP_EXTRA = ("optimizer_steps", "reward/mean", "groups/zero_variance_frac", "buffer/zero_signal_dropped",
              "buffer/dynamic_sampling", "time/train_s", "time/batch_wait_s")
NAME = re.compile(r"^(?P<recipe>[a-z_+]+)_s(?P<seed>\d+)$")


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else None


def read_run(d: Path) -> dict:
    rows = read_rows(d / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r and r.get("step", 0) >= 1]
    evals = [r for r in rows if "eval/reward" in r]
    run = {"dir": str(d), "steps": [r["step"] for r in steps], "per_step": {}, "mean": {}, "evals": {}}
    for k in CLIPS + STEP_EXTRA:
        vals = [_num(r.get(k)) for r in steps]
        if any(v is not None for v in vals):
            run["per_step"][k] = vals
            ok = [v for v in vals if v is not None]
            run["mean"][k] = sum(ok) / len(ok)
    # a running count: the run's total is its last value
    run["zero_signal_dropped"] = run["per_step"].get("buffer/zero_signal_dropped", [None])[-1]
    for r in evals:  # held-out accuracy: the grader's reward is 0 or 1
        run["evals"][r["step"]] = {name: _num(r.get(key)) for name, key in EVALS}
    row0 = next((r for r in rows if r.get("step") == 0), {})
    run["preflight_dynamic_sampling"] = _num(row0.get("preflight/dynamic_sampling"))
    run["last_time_s"] = _num(rows[-1].get("time_s")) if rows else None
    t = d.parent / f"{d.name}.time"
    run["rc"], run["wall_s"] = None, run["last_time_s"]
    if t.exists():
        m = re.search(r"rc (\d+) wall_s (\d+)", t.read_text())
        if m:
            run["rc"], run["wall_s"] = int(m.group(1)), float(m.group(2))
        m = re.search(r"tree (\S+)", t.read_text())
        run["tree"] = m.group(1) if m else None
    # finished: the runner wrote its exit code (without a .time file: the run wrote its summary.json)
    run["finished"] = run["rc"] is not None if t.exists() else (d / "summary.json").exists()
    summary = d / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        run["summary"] = {k: s[k] for k in ("zero_signal", "stopped", "steps") if k in s}
    return run


def per_step(runs: dict[str, dict[int, dict]]) -> str:
    out = []
    for recipe, by_seed in runs.items():
        for seed in sorted(by_seed):
            r = by_seed[seed]
            keys = [k for k in ("clip_frac", "clip_low_frac", "clip_high_frac", "seq_clip_frac", "cispo_clip_frac",
                                "overlong_filtered_frac", "buffer/zero_signal_dropped",
                                "groups/zero_variance_frac") if k in r["per_step"]]
            out.append(f"{recipe} seed {seed} (rc {r['rc']}, {r['wall_s'] or 0:.0f} s, steps {r['steps']}):")
            for k in keys:
                out.append(f"  {k:24s} " + " ".join("   -  " if v is None else f"{v:.4f}" for v in r["per_step"][k]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs_dir", nargs="?", default="outputs/mb_smollm2")
    p.add_argument("--json", default=None, help="write the raw numbers here")
    a = p.parse_args(argv)
    runs: dict[str, dict[int, dict]] = {}
    for d in sorted(Path(a.runs_dir).iterdir()):
        m = NAME.match(d.name)
        if d.is_dir() and m:
            runs.setdefault(m.group("recipe"), {})[int(m.group("seed"))] = read_run(d)
    order = {"dapo": 0, "gspo": 1, "cispo": 2}
    runs = dict(sorted(runs.items(), key=lambda kv: (order.get(kv[0], 9), kv[0])))
    rows = minibatch_rows(runs)
    print(markdown_table(MINIBATCH_HEADER, rows, align="--:::---::"))
    print()
    print(per_step(runs))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"table": [dict(zip(MINIBATCH_HEADER, r)) for r in rows],
                                            "runs": {r: {str(s): v for s, v in bs.items()} for r, bs in runs.items()}},
                                           indent=1) + "\n")


if __name__ == "__main__":
    main()
