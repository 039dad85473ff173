"""Learning curves from one or more runs' metrics.jsonl (seeds of one recipe): held-out greedy and
sampled accuracy over wall time (minutes since the run started) and over steps, each run's gain from
its first eval to its last eval within --budget-min minutes, the mean gain and its spread, and the
median seconds of each step phase (time/* keys) per run.

    python -m tools.compare.plot_learning_curve outputs/smollm2-seed1 outputs/smollm2-seed2 outputs/smollm2-seed3 \
        --budget-min 30 --out docs/results/img/smollm2_add_curve.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tools.lib.metrics import read_rows, step_rows
from tools.lib.report import plot_learning_curves


def gains(ev: list[dict], budget_s: float) -> dict | None:
    """First eval -> last eval at or before budget_s of wall time: greedy, sampled, pass@k."""
    within = [r for r in ev if r["time_s"] <= budget_s]
    if len(within) < 2:
        return None
    a, b = within[0], within[-1]
    out = {"step": b["step"], "minutes": b["time_s"] / 60}
    for k, name in (("eval/reward_greedy", "greedy"), ("eval/reward", "sampled"), ("eval/pass@k", "pass@k")):
        if k in a and k in b:
            out[name] = (a[k], b[k], b[k] - a[k])
    return out


def spread(v: list[float]) -> str:
    if len(v) < 2:
        return f"{v[0]:+.3f}" if v else "-"
    return f"{statistics.mean(v):+.3f} ± {statistics.stdev(v):.3f} (min {min(v):+.3f}, n={len(v)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-min", type=float, default=30.0, help="wall-time budget the gains are read at")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    runs = [(d, read_rows(d / "metrics.jsonl")) for d in a.run_dirs]
    per = {"greedy": [], "sampled": []}
    for d, rs in runs:
        ev = [r for r in rs if "eval/reward_greedy" in r]
        tr = step_rows(rs)
        print(f"== {d}")
        print("step  minutes  greedy  sampled  pass@k")
        for r in ev:
            print(f"{r['step']:4d}  {r['time_s'] / 60:7.1f}  {r['eval/reward_greedy']:.3f}   {r['eval/reward']:.3f}    "
                  f"{r.get('eval/pass@k', float('nan')):.3f}")
        g = gains(ev, a.budget_min * 60)
        if g is not None:
            parts = ", ".join(f"{k} {v[0]:.3f} -> {v[1]:.3f} ({v[2]:+.3f})" for k, v in g.items() if isinstance(v, tuple))
            print(f"within {a.budget_min:g} min (step {g['step']}, {g['minutes']:.1f} min): {parts}")
            for k in per:
                if k in g:
                    per[k].append(g[k][2])
        for k in sorted({k for r in tr for k in r if k.startswith("time/") or k == "sync/latency_s"}):
            v = [r[k] for r in tr if isinstance(r.get(k), (int, float)) and r[k] == r[k]]
            if v:
                print(f"  {k:28s} median {statistics.median(v):7.2f} s  (n={len(v)})")
    print(f"gain within {a.budget_min:g} min, over {len(runs)} run(s): greedy {spread(per['greedy'])}; "
          f"sampled {spread(per['sampled'])}")

    plot_learning_curves({d.name: [r for r in rs if "eval/reward_greedy" in r] for d, rs in runs}, a.out,
                         a.budget_min, a.title)
    print(a.out)


if __name__ == "__main__":
    main()
