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
from tools.lib.metrics import eval_points, read_rows
from tools.lib.report import plot_accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=metrics.jsonl[,metrics.jsonl...]")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    runs = {}
    for spec in a.runs:
        label, _, files = spec.partition("=")
        runs[label] = curves = [eval_points(read_rows(f)) for f in files.split(",")]
        for c in curves:
            print(f"{label:24s} " + "  ".join(f"step {p['step']:>2}: {p['samples']:>4.0f} samples {p['seconds']:>6.0f} s "
                                              f"{p['gen_tokens']:>7.0f} tok greedy {p['greedy']:.3f} sampled "
                                              f"{p['sampled']:.3f}" for p in c))
    plot_accuracy(runs, a.out, a.title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
