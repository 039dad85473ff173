"""Held-out accuracy of runs against trained samples, wall-clock and generated tokens, on one figure.

    python -m tools.compare.opd_plot --out docs/results/img/opd_additions.png --title "SmolLM2, additions" \\
        "GRPO=outputs/grpo_s11/metrics.jsonl" "OPD=outputs/opd_s11/metrics.jsonl,outputs/opd_s12/metrics.jsonl"

Each argument is LABEL=METRICS[,METRICS...] (a run's metrics.jsonl, or a kept copy): several files
under one label are seeds, drawn as their mean with each seed faint. Per eval row: trained samples
(Σ `samples` of the steps so far), seconds since the run's first row (`time_s`), and generated
tokens (Σ `batch/tokens` of the trained batches plus `buffer/wasted_tokens`, the tokens of groups
dropped as stale or without a reward spread). Panels: greedy accuracy (`eval/reward_greedy`) and
sampled accuracy (`eval/reward`) against each. A table of the same points is printed.
"""

from __future__ import annotations

import argparse
from tools.lib.metrics import read_rows
from tools.lib.report import pyplot, save


def curve(path: str) -> list[dict]:
    """The eval points of one run: step, samples, seconds, generated tokens, greedy, sampled, entropy."""
    rows = read_rows(path)
    samples = tokens = 0.0
    wasted = 0.0
    entropy = float("nan")
    out = []
    for r in rows:
        if "samples" in r and "loss" in r:
            samples += r["samples"]
            tokens += r.get("batch/tokens", 0.0)
            wasted = r.get("buffer/wasted_tokens", wasted)
            entropy = r.get("entropy", entropy)
        if "eval/reward_greedy" in r:
            out.append({"step": r.get("step", 0), "samples": samples, "seconds": r.get("time_s", 0.0),
                        "gen_tokens": tokens + wasted, "greedy": r["eval/reward_greedy"],
                        "sampled": r.get("eval/reward", float("nan")), "entropy": entropy})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=metrics.jsonl[,metrics.jsonl...]")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    xs = (("samples", "trained samples"), ("seconds", "wall-clock s"), ("gen_tokens", "generated tokens"))
    fig, axes = pyplot().subplots(2, 3, figsize=(15, 8), squeeze=False)
    for k, spec in enumerate(a.runs):
        label, _, files = spec.partition("=")
        curves = [curve(f) for f in files.split(",")]
        color = f"C{k}"
        for c in curves:
            print(f"{label:24s} " + "  ".join(f"step {p['step']:>2}: {p['samples']:>4.0f} samples {p['seconds']:>6.0f} s "
                                              f"{p['gen_tokens']:>7.0f} tok greedy {p['greedy']:.3f} sampled "
                                              f"{p['sampled']:.3f}" for p in c))
        n = min(len(c) for c in curves)
        for row, key in enumerate(("greedy", "sampled")):
            for col, (x, xlabel) in enumerate(xs):
                ax = axes[row][col]
                for c in curves if len(curves) > 1 else []:
                    ax.plot([p[x] for p in c], [p[key] for p in c], color=color, alpha=0.25, lw=1)
                mx = [sum(c[i][x] for c in curves) / len(curves) for i in range(n)]
                my = [sum(c[i][key] for c in curves) / len(curves) for i in range(n)]
                ax.plot(mx, my, "o-", color=color, label=f"{label} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(f"held-out {key} accuracy")
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if a.title:
        fig.suptitle(a.title)
    save(fig, a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
