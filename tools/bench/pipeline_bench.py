"""Async vs sync on the same machine, in one invocation, on a long-tail response-length workload.

    python -m tools.bench.pipeline_bench                      # defaults: 3 repeats of 12 steps per mode, B=8, G=4
    python -m tools.bench.pipeline_bench --steps 20 --repeats 5 --out bench_out/pipeline key=value ...
    python -m tools.bench.pipeline_bench --placement shared   # every mesh on every core (no pinning)
    python -m tools.bench.pipeline_bench --config configs/smollm2-135m-add.yaml --workload config \
        --placement shared --steps 6 --repeats 2         # a recipe's own task, model and batch, evals off

Both runs use the same components and config (`--workload longtail`, the default: task
`pipeline.tasks.longtail` with `ignore_eos`, so lengths are lognormal; `--workload config`: the
config's own task, model, batch and lengths, as a recipe runs, with evals off); `run.mode=sync` generates a full batch, trains, syncs and repeats (Δ=0,
max_staleness=0; a version is admitted only once every generator serves it, so nothing is dropped),
`run.mode=async` overlaps generation, training and the weight push. Prints trained samples/s and
trained tokens/s, trainer and generator idle fractions, dropped samples and wasted tokens per mode,
and the async/sync speedup in both units; writes results.json and pipeline_bench.png into --out.
Placement is the same in both modes: `--placement disjoint` (the default) pins the trainer to the
first core and the generators (and the light replay buffer) to the others (trainer.cpus,
generator.cpus, buffer.cpus), so neither side's compute slows the other; `shared` leaves every mesh
unpinned. Modes alternate (sync, async, sync, ...) `--repeats` times; the table gives each metric's
median and its min..max over the repeats, the speedups are ratios of medians (with the spread of the
per-repeat ratios), and a per-step breakdown (trainer waiting for a batch, training, weight sync)
says where the time goes. Extra `key=value` arguments override the config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from pipeline.config import load_config
from tools.lib.cli import check_cli, disjoint_cores
from tools.lib.metrics import read_rows, read_summary
from tools.lib.report import plot_modes


def measure(mode: str, args, out: Path, rep: int) -> dict:
    name = f"{mode}{rep}"
    workload = (["task.name=pipeline.tasks.longtail", "generator.ignore_eos=true"]
                if args.workload == "longtail" else [])
    shape = [f"{k}={v}" for k, v in (("generator.max_new_tokens", args.max_tokens),
                                     ("buffer.batch_groups", args.batch_groups),
                                     ("buffer.group_size", args.group_size)) if v is not None]
    overrides = [
        *workload, *shape,
        f"run.steps={args.steps}", "run.eval_every=0", "run.warm_start_steps=0", "run.checkpoint_every=0",
        "run.progress=false", f"run.mode={mode}", f"run.out_dir={out / name}", *disjoint_cores(args.placement),
        *args.overrides]
    cfg = load_config(args.config, overrides)  # a bad override fails here, before any run
    lengths = ("lognormal" if args.workload == "longtail" else f"the task's ({cfg.task.name})")
    print(f"[pipeline_bench] {mode}: {args.steps} steps, B={cfg.buffer.batch_groups}, G={cfg.buffer.group_size}, "
          f"lengths {lengths} capped at {cfg.generator.max_new_tokens}", flush=True)
    # the CLI, so each mode is a whole run with its own start, shutdown and cleanup
    out.mkdir(parents=True, exist_ok=True)
    check_cli(args.config, overrides, out / f"{name}.log", f"the {mode} run")
    summary = read_summary(out / name)
    rows = [r for r in read_rows(out / name / "metrics.jsonl") if "version/trainer" in r]
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
            "tokens_per_sample": tokens / samples,
            "batch_wait_s": sum(r["time/batch_wait_s"] for r in rows) / len(rows),
            "train_s": train_s / len(rows),
            "sync_s": sum(r["sync/latency_s"] for r in rows if r["sync/latency_s"] == r["sync/latency_s"]) / len(rows)}


KEYS = ["samples_per_s", "tokens_per_s", "trainer_idle_frac", "generator_idle_frac", "mean_staleness",
        "tokens_per_sample", "dropped_samples", "wasted_tokens", "batch_wait_s", "train_s", "sync_s"]


def summarise(runs: list[dict]) -> dict:
    """Median, min and max of every KEYS metric over a mode's repeats."""
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in KEYS} | {"mode": runs[0]["mode"], "repeats": len(runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--placement", choices=("disjoint", "shared"), default="disjoint")
    ap.add_argument("--workload", choices=("longtail", "config"), default="longtail",
                    help="longtail: lognormal lengths (ignore_eos); config: the config's own task and lengths")
    ap.add_argument("--batch-groups", type=int, default=None, help="longtail default 8; config: the config's")
    ap.add_argument("--group-size", type=int, default=None, help="longtail default 4; config: the config's")
    ap.add_argument("--max-tokens", type=int, default=None, help="longtail default 96; config: the config's")
    ap.add_argument("--out", default="bench_out/pipeline")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.workload == "longtail":
        args.batch_groups, args.group_size = args.batch_groups or 8, args.group_size or 4
        args.max_tokens = args.max_tokens or 96
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # what this bench runs, so `python -m tools.plan validate` can simulate any configuration measured here
    (out / "bench.json").write_text(json.dumps({
        "config": args.config, "max_tokens": args.max_tokens, "steps": args.steps, "batch_groups": args.batch_groups,
        "group_size": args.group_size, "placement": args.placement, "overrides": args.overrides,
        "workload": args.workload,
        # disjoint: every generator on the cores after the first (engines beyond that many share them)
        "generator_devices": len(os.sched_getaffinity(0)) - 1 if args.placement == "disjoint" else 0}, indent=1))
    print(f"[pipeline_bench] placement {args.placement}: {' '.join(disjoint_cores(args.placement)) or 'unpinned'}")
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for rep in range(args.repeats):  # alternate, so a drift in the machine's load hits both modes alike
        for mode in runs:
            r = measure(mode, args, out, rep)
            runs[mode].append(r)
            print(f"[pipeline_bench]   {mode} #{rep + 1}: {r['samples_per_s']:.1f} samples/s, "
                  f"{r['tokens_per_s']:.0f} tokens/s", flush=True)
    summaries = [summarise(runs["sync"]), summarise(runs["async"])]

    def cell(m: dict, key: str, fmt: str) -> str:
        return f"{m[key]['median']:{fmt}} ({m[key]['min']:{fmt}}..{m[key]['max']:{fmt}})"

    print(f"\nmedian (min..max) over {args.repeats} repeats, placement {args.placement}\n")
    print("| mode | samples/s | tokens/s | trainer idle | generator idle | mean staleness | tokens/sample "
          "| dropped samples | wasted tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in summaries:
        print(f"| {m['mode']} | {cell(m, 'samples_per_s', '.1f')} | {cell(m, 'tokens_per_s', '.0f')} | "
              f"{cell(m, 'trainer_idle_frac', '.2f')} | {cell(m, 'generator_idle_frac', '.2f')} | "
              f"{m['mean_staleness']['median']:.2f} | {m['tokens_per_sample']['median']:.1f} | "
              f"{m['dropped_samples']['median']:.0f} | {m['wasted_tokens']['median']:.0f} |")
    print("\nper step (median s): | mode | waiting for a batch | training | weight sync |")
    for m in summaries:
        print(f"| {m['mode']} | {m['batch_wait_s']['median']:.2f} | {m['train_s']['median']:.2f} | "
              f"{m['sync_s']['median']:.2f} |")
    sync, asyn = summaries
    speedup = {}
    for unit, key in (("samples", "samples_per_s"), ("tokens", "tokens_per_s")):
        ratios = [a[key] / s[key] for a, s in zip(runs["async"], runs["sync"])]
        speedup[unit] = {"median_ratio": asyn[key]["median"] / sync[key]["median"],
                         "pair_min": min(ratios), "pair_max": max(ratios)}
    print(f"\nasync/sync speedup (ratio of medians; per-repeat pairs min..max): "
          f"{speedup['samples']['median_ratio']:.2f}x ({speedup['samples']['pair_min']:.2f}..{speedup['samples']['pair_max']:.2f}) "
          f"in trained samples/s, {speedup['tokens']['median_ratio']:.2f}x "
          f"({speedup['tokens']['pair_min']:.2f}..{speedup['tokens']['pair_max']:.2f}) in trained tokens/s")
    print(f"trainer idle in async: {asyn['trainer_idle_frac']['median']:.2f} (target <= 0.15); "
          f"tokens/s speedup target >= 1.6x")
    (out / "results.json").write_text(json.dumps({"placement": args.placement, "runs": runs, "summary": summaries,
                                                   "speedup": speedup}, indent=2))
    plot_modes(summaries, runs, out / "pipeline_bench.png",
         "long-tail response lengths" if args.workload == "longtail" else f"{Path(args.config).stem}'s own task")
    print(f"wrote {out / 'results.json'} and {out / 'pipeline_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
