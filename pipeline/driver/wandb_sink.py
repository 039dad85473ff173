"""Weights & Biases beside metrics.jsonl (run.wandb): the same scalars, and the rollouts as a table.

    wb = open_wandb("offline", out_dir, config=dataclasses.asdict(cfg))   # NullWandb for "off"
    wb.log(step, {"reward/mean": 0.4})
    wb.log_rollouts(step, rows)        # rows of pipeline.driver.metrics.trained_samples
    wb.close()

offline writes out_dir/wandb/offline-run-* and needs no network (`wandb sync <that dir>` uploads it
later); online needs a login (`wandb login` or WANDB_API_KEY). The project is WANDB_PROJECT, default
monarch-rl; the run's name is out_dir's last part. The wandb package is optional (`pip install wandb`,
or the `wandb` extra of this project); config validation refuses run.wandb != off without it. A
resumed run starts a new W&B run from its checkpoint's step + 1: W&B cannot take back the steps the
run that died logged after that checkpoint (metrics.jsonl drops them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

COLUMNS = ("step", "group_id", "trainer_version", "staleness", "reward", "advantage", "prompt", "completion",
           "versions")


class NullWandb:
    """run.wandb=off: every call does nothing."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        pass

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


class WandbSink:
    """One W&B run: `log` sends a step's scalars, `log_rollouts` appends rows to one incremental table."""

    def __init__(self, mode: str, out_dir: Path, config: dict[str, Any], resume_step: int | None = None):
        import wandb

        self._wandb = wandb
        settings = wandb.Settings(silent=True, console="off", disable_git=True, save_code=False)
        try:
            self.run = wandb.init(mode=mode, dir=str(out_dir), project=os.environ.get("WANDB_PROJECT", "monarch-rl"),
                                  name=out_dir.resolve().name, config={**config, "resume_step": resume_step},
                                  settings=settings)
        except Exception as e:
            raise RuntimeError(f"run.wandb={mode!r}: wandb.init failed ({type(e).__name__}: {e}); online needs "
                               f"`wandb login` or WANDB_API_KEY, offline needs neither") from e
        self.dir = Path(self.run.dir).parent  # out_dir/wandb/<offline-run-...>
        self._table = wandb.Table(columns=list(COLUMNS), log_mode="INCREMENTAL")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        for r in rows:
            self._table.add_data(*[step if c == "step" else r[c] for c in COLUMNS])
        self.run.log({"rollouts": self._table}, step=step)

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()  # its wandb-core service process, which finish() leaves running


def open_wandb(mode: str, out_dir: str | Path, config: dict[str, Any],
               resume_step: int | None = None) -> NullWandb | WandbSink:
    """The sink for run.wandb=`mode`: off | offline | online."""
    if mode == "off":
        return NullWandb()
    return WandbSink(mode, Path(out_dir), config, resume_step)
