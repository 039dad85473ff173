"""Entry point: `python -m pipeline.run --config configs/tiny.yaml key=value ...`.

Runs the whole job (generators, replay buffer, trainer, weight sync) as described by the config.
Under torchrun every rank joins one Monarch job and rank 0 drives it, on one host
(`torchrun --nproc-per-node K -m pipeline.run ...`) or several (one launcher per node with
`--nnodes N --node-rank R --master-addr A --master-port P`; see pipeline/torchrun.py).
Exit codes: 0 done, 2 bad config or arguments, 1 the run failed, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from typing import Any

from pipeline.config import Config, ConfigError, load_config

log = logging.getLogger("pipeline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pipeline.run", description="Asynchronous RL post-training job.")
    ap.add_argument("--config", default=None, help="YAML file overriding the dataclass defaults (e.g. configs/tiny.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    return ap.parse_args(argv)


def print_summary(cfg: Config, summary: dict) -> None:
    curve = summary.get("eval_curve") or []
    print(f"\n== done: {summary['steps']} steps in {summary['elapsed_s']:.1f}s "
          f"({summary['samples_per_s']:.2f} samples/s), trainer version {summary['version']}")
    if cfg.run.warm_start_steps:
        print(f"   warm start: {cfg.run.warm_start_steps} supervised steps on task demonstrations before RL "
              f"(held-out rewards below are measured after it)")
    if curve:
        print(f"   held-out reward (sampled): {curve[0][1]:.3f} (step {curve[0][0]}) -> {curve[-1][1]:.3f} "
              f"(step {curve[-1][0]}); greedy: {curve[0][2]:.3f} -> {curve[-1][2]:.3f}")
    print(f"   metrics: {cfg.run.out_dir}/metrics.jsonl, tensorboard: {cfg.run.out_dir}/tensorboard, "
          f"plot: {cfg.run.out_dir}/summary.png")
    print(f"   HF checkpoint: {summary.get('checkpoint')}")


def drive(cfg: Config, host: Any = None) -> None:
    """Run the job from this process on `host` (a host mesh; None: this host) and print its summary."""
    from pipeline.controller import run

    summary = asyncio.run(run(cfg, host=host))
    print_summary(cfg, summary)


def launch(cfg: Config) -> int:
    """Local run, or under torchrun: every rank joins one Monarch job and rank 0 drives it."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        from pipeline.torchrun import run_under_torchrun

        return run_under_torchrun(cfg, functools.partial(drive, cfg))
    drive(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        return launch(cfg)
    except ConfigError as e:  # from the file, or from the job's shape (e.g. trainer.num_ranks vs hosts)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
