"""Async vs sync on the same machine, in one invocation, on a long-tail response-length workload.

    python tools/pipeline_bench.py                      # defaults: 12 steps each, B=8, G=4
    python tools/pipeline_bench.py --steps 20 --out bench_out/pipeline key=value ...

Both runs use the same components and config (task `pipeline.tasks.longtail` with `ignore_eos`, so
lengths are lognormal); `run.mode=sync` generates a full batch, trains, syncs and repeats (Δ=0,
max_staleness=0; a version is admitted only once every generator serves it, so nothing is dropped),
`run.mode=async` overlaps generation, training and the weight push. Prints trained samples/s and
trained tokens/s, trainer and generator idle fractions, dropped samples and wasted tokens per mode,
and the async/sync speedup in both units; writes results.json and pipeline_bench.png into --out.
Extra `key=value` arguments override the config.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.config import load_config  # noqa: E402
from pipeline.metrics import read_jsonl  # noqa: E402


def measure(mode: str, args, out: Path) -> dict:
    overrides = [
        "task.name=pipeline.tasks.longtail", "generator.ignore_eos=true", f"generator.max_new_tokens={args.max_tokens}",
        f"buffer.batch_groups={args.batch_groups}", f"buffer.group_size={args.group_size}",
        f"run.steps={args.steps}", "run.eval_every=0", "run.warm_start_steps=0", "run.checkpoint_every=0",
        "run.progress=false", f"run.mode={mode}", f"run.out_dir={out / mode}", *args.overrides]
    load_config(args.config, overrides)  # a bad override fails here, before any run
    print(f"[pipeline_bench] {mode}: {args.steps} steps, B={args.batch_groups}, G={args.group_size}, "
          f"lengths lognormal capped at {args.max_tokens}", flush=True)
    # the CLI, so each mode is a whole run with its own start, shutdown and cleanup
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{mode}.log"
    with open(log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", args.config, *overrides],
                              cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"the {mode} run exited with {code}; see {log}")
    summary = json.loads((out / mode / "summary.json").read_text())
    rows = [r for r in read_jsonl(out / mode / "metrics.jsonl") if "version/trainer" in r]
    # skip the first step: it includes the engines' first-batch warm-up in both modes
    rows = rows[1:] if len(rows) > 1 else rows
    wall = rows[-1]["time_s"] - rows[0]["time_s"] + rows[0]["time/batch_wait_s"] + rows[0]["time/train_s"]
    train_s = sum(r["time/train_s"] for r in rows)
    samples = sum(r["samples"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    gens = [v for k, v in summary["stats"].items() if k.startswith("generator")]
    gen_busy = sum(g["busy_s"] for g in gens) / max(len(gens), 1)
    return {"mode": mode, "steps": len(rows), "wall_s": wall, "samples_per_s": samples / wall,
            "tokens_per_s": tokens / wall, "dropped_samples": rows[-1]["buffer/dropped_samples"],
            "wasted_tokens": rows[-1]["buffer/wasted_tokens"],
            "trainer_idle_frac": 1 - train_s / wall,
            "generator_idle_frac": max(0.0, 1 - gen_busy / summary["elapsed_s"]),
            "mean_staleness": sum(r["staleness/mean"] for r in rows) / len(rows),
            "tokens_per_sample": tokens / samples}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.5))
    modes = [r["mode"] for r in results]
    for ax, key, title in zip(axes, ["samples_per_s", "tokens_per_s", "trainer_idle_frac", "generator_idle_frac"],
                              ["trained samples / s", "trained tokens / s", "trainer idle fraction",
                               "generator idle fraction"]):
        ax.bar(modes, [r[key] for r in results], color=["tab:gray", "tab:blue"][: len(modes)])
        ax.set_title(title)
    fig.suptitle("async vs sync, long-tail response lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench_out/pipeline")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    results = [measure(mode, args, out) for mode in ("sync", "async")]
    sync, asyn = results
    print("\n| mode | samples/s | tokens/s | trainer idle | generator idle | mean staleness | tokens/sample "
          "| dropped samples | wasted tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['trainer_idle_frac']:.2f} | "
              f"{r['generator_idle_frac']:.2f} | {r['mean_staleness']:.2f} | {r['tokens_per_sample']:.1f} | "
              f"{r['dropped_samples']:.0f} | {r['wasted_tokens']:.0f} |")
    speedup = {"samples": asyn["samples_per_s"] / sync["samples_per_s"],
               "tokens": asyn["tokens_per_s"] / sync["tokens_per_s"]}
    print(f"\nasync/sync speedup: {speedup['samples']:.2f}x in trained samples/s, "
          f"{speedup['tokens']:.2f}x in trained tokens/s")
    (out / "results.json").write_text(json.dumps({"results": results, "speedup": speedup}, indent=2))
    plot(results, out / "pipeline_bench.png")
    print(f"wrote {out / 'results.json'} and {out / 'pipeline_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
