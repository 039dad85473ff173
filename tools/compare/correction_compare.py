"""Off-policy corrections side by side on real runs: ESS, truncation, gradient variance, reward.

    python -m tools.compare.correction_compare                                  # seq_is, mis_balance, tis
    python -m tools.compare.correction_compare --corrections seq_is,mis_balance --steps 300 key=value ...

Each correction is a whole CLI run (`python -m pipeline.run --config configs/tiny.yaml
trainer.correction=C ...`) on the same seed and config, one after another (they would share the
cores). The defaults make the data mix policy versions the way mis_balance needs and measure the
gradient: `generator.on_update=drain buffer.max_staleness=2 trainer.grad_variance=true
trainer.micro_batch_size=8` (tiny.yaml's batch is 8 groups of 8, so 8 chunks of one group each).
Per correction it reports, over the run's steps, the median (and min) ESS of the applied weights
(`is_ess`), the share of tokens the correction truncated (`is_clip_frac`), the gradient's relative
variance `grad/var_rel` (the trace of the covariance of a batch's summed gradient over its squared
norm, estimated from the 8 chunks; median and interquartile range) on every batch and on batches
that mixed versions, and held-out reward before and after (sampled and greedy). Writes compare.md,
compare.json and compare.png (ESS, relative gradient variance and held-out reward over steps) into
--out. With --reuse, a finished run in --out with the same overrides is read instead of rerun.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tools.lib.cli import run_to_dir
from tools.lib.metrics import eval_rows, step_rows
from tools.lib.report import plot_curves, publish, pyplot, save

BASE = ["generator.on_update=drain", "buffer.max_staleness=2", "trainer.grad_variance=true",
        "trainer.micro_batch_size=8", "run.progress=false", "run.checkpoint_every=0"]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return (xs[0],) * 3 if xs else (float("nan"),) * 3
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def summarise(name: str, run: dict) -> dict:
    rows = run["rows"]
    steps, evals = step_rows(rows, "grad/var_rel"), eval_rows(rows)
    res = {"correction": name, "exit_code": run["exit_code"], "wall_s": run["wall_s"], "steps": len(steps),
           "rows": rows}
    if run["exit_code"] != 0 or not steps or len(evals) < 2:
        return res
    mixed = [r for r in steps if r["staleness/mean"] < r["staleness/max"]]  # samples of several versions
    ess = [r["is_ess"] for r in steps]
    res.update({
        "ess_median": statistics.median(ess), "ess_min": min(ess),
        "is_clip_frac": statistics.mean(r["is_clip_frac"] for r in steps),
        "var_rel": quartiles([r["grad/var_rel"] for r in steps]),
        "var_rel_mixed": quartiles([r["grad/var_rel"] for r in mixed]), "mixed_batches": len(mixed),
        "sampled": (evals[0]["eval/reward"], evals[-1]["eval/reward"]),
        "greedy": (evals[0]["eval/reward_greedy"], evals[-1]["eval/reward_greedy"]),
    })
    return res


def table(results: list[dict]) -> str:
    lines = ["| correction | ESS median (min) | tokens truncated | grad var / ‖g‖², median (IQR) | "
             "same, batches mixing versions | held-out reward, sampled (greedy) | wall |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "ess_median" not in r:
            lines.append(f"| `{r['correction']}` | run failed (exit {r['exit_code']}) | | | | | {r['wall_s']:.0f} s |")
            continue
        v, m = r["var_rel"], r["var_rel_mixed"]
        lines.append(
            f"| `{r['correction']}` | {r['ess_median']:.3f} ({r['ess_min']:.3f}) | {100 * r['is_clip_frac']:.2f}% | "
            f"{v[1]:.3f} ({v[0]:.3f}..{v[2]:.3f}) | {m[1]:.3f} ({m[0]:.3f}..{m[2]:.3f}), {r['mixed_batches']} batches | "
            f"{r['sampled'][0]:.3f} → {r['sampled'][1]:.3f} ({r['greedy'][0]:.3f} → {r['greedy'][1]:.3f}) | "
            f"{r['wall_s']:.0f} s |")
    return "\n".join(lines)


PANELS = [("ESS of the applied weights", ["is_ess"], 1), ("grad var / ‖g‖² (rolling median of 9)", ["grad/var_rel"], 9),
          ("held-out reward (sampled)", ["eval/reward"], 1)]


def plot(results: list[dict], path: Path) -> None:
    fig, axes = pyplot().subplots(1, len(PANELS), figsize=(15, 3.6))
    plot_curves(axes, {r["correction"]: r["rows"] for r in results}, PANELS)
    save(fig, path, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--corrections", default="seq_is,mis_balance,tis")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    ap.add_argument("--out", default="bench_out/correction_compare")
    ap.add_argument("--reuse", action="store_true", help="read, not rerun, each finished run in --out")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out).resolve()  # the runs start in the repository
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for c in args.corrections.split(","):
        overrides = [f"trainer.correction={c}", f"run.steps={args.steps}", f"run.out_dir={out / c}", *BASE,
                     *args.overrides]
        r = summarise(c, run_to_dir(out / c, overrides, args.config, args.timeout, args.reuse, f"correction_compare {c}"))
        results.append(r)
        if "ess_median" in r:
            print(f"[correction_compare {c}]   ESS {r['ess_median']:.3f} (min {r['ess_min']:.3f}), grad var/‖g‖² "
                  f"{r['var_rel'][1]:.3f}, reward {r['sampled'][0]:.3f} -> {r['sampled'][1]:.3f}", flush=True)
        else:
            print(f"[correction_compare {c}]   run failed (exit {r['exit_code']}); see {out / c / 'run.log'}", flush=True)
    publish(out, "compare", table(results), results, "correction_compare")
    plot(results, out / "compare.png")
    return 0 if all("ess_median" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
