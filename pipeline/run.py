"""Entry point: `python -m pipeline.run --config configs/tiny.yaml key=value ...`.

Runs the whole job (generators, replay buffer, trainer, weight sync) as described by the config.
Under torchrun (`torchrun --nproc-per-node K -m pipeline.run ...`) every rank joins one Monarch
job and rank 0 drives it. Exit codes: 0 done, 2 bad config or arguments, 1 the run failed,
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pipeline.config import ConfigError, load_config

log = logging.getLogger("pipeline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pipeline.run", description="Asynchronous RL post-training job.")
    ap.add_argument("--config", default=None, help="YAML file overriding the dataclass defaults (e.g. configs/tiny.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeline.controller import launch

    try:
        return launch(cfg)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
