"""A run's learning curve from its metrics.jsonl: held-out greedy and sampled accuracy (and pass@k) over
steps, the train reward beside them, and the median seconds of each step phase (time/* keys).

    python tools/plot_learning_curve.py outputs/smollm2-135m-add --out docs/img/smollm2_add_curve.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    rs = rows(a.run_dir)
    ev = [r for r in rs if "eval/reward_greedy" in r]
    tr = [r for r in rs if "reward/mean" in r]
    print("step  greedy  sampled  pass@k")
    for r in ev:
        print(f"{r['step']:4d}  {r['eval/reward_greedy']:.3f}   {r['eval/reward']:.3f}    {r.get('eval/pass@k', float('nan')):.3f}")
    phases = sorted({k for r in tr for k in r if k.startswith("time/")})
    for k in phases:
        v = [r[k] for r in tr if isinstance(r.get(k), (int, float))]
        if v:
            print(f"{k:32s} median {statistics.median(v):7.2f} s  (n={len(v)})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in ev]
    ax.plot(steps, [r["eval/reward_greedy"] for r in ev], "o-", label="held-out greedy accuracy")
    ax.plot(steps, [r["eval/reward"] for r in ev], "s-", label="held-out sampled accuracy")
    if ev and "eval/pass@k" in ev[0]:
        ax.plot(steps, [r["eval/pass@k"] for r in ev], "^--", label="held-out pass@k")
    ax.plot([r["step"] for r in tr], [r["reward/mean"] for r in tr], "-", alpha=0.4, label="train reward (batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(a.title, fontsize=9)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
