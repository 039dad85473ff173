"""Metrics sinks: JSONL + TensorBoard on disk, a progress bar, and the end-of-run summary plot.

    sink = MetricsSink(out_dir)
    sink.log(step, {"reward/mean": 0.4, "staleness/mean": 0.5})
    sink.close()
    plot_summary(out_dir / "metrics.jsonl", out_dir / "summary.png")
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _scalar(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line of a killed run: dropped


class MetricsSink:
    """One JSON line per `log` call (all values) and TensorBoard scalars (numeric values).

    A run owns its out_dir's metrics: a fresh run (`resume_step=None`) starts metrics.jsonl anew; a
    resumed one keeps the rows up to its checkpoint's step, drops the later ones (logged after that
    checkpoint by the run that died) and appends, so no step appears twice. TensorBoard events from
    `resume_step + 1` on are purged likewise.
    """

    def __init__(self, out_dir: str | Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        keep = []
        if resume_step is not None and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _row_step(line) <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)  # a crash here leaves the old file or the kept rows, never half
        self._f = self.path.open("a")
        self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"),
                                 purge_step=None if resume_step is None else resume_step + 1)
        self._t0 = time.monotonic()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        rec = {"step": step, "time_s": round(time.monotonic() - self._t0, 3), **metrics}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()
        for k, v in metrics.items():
            s = _scalar(v)
            if s is not None:
                self._tb.add_scalar(k, s, step)

    def close(self) -> None:
        self._f.close()
        self._tb.close()


class Progress:
    """tqdm bar over RL steps showing reward, staleness, tokens/s and version lag."""

    def __init__(self, total: int, enabled: bool, desc: str = "rl"):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)

    def update(self, metrics: dict[str, Any]) -> None:
        keys = {"reward": "reward/mean", "stale": "staleness/mean", "tok/s": "throughput/gen_tokens_per_s",
                "lag": "version/lag", "Δ": "buffer/delta"}
        self._bar.set_postfix({k: f"{metrics[m]:.3g}" for k, m in keys.items() if _scalar(metrics.get(m)) is not None})
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Rows of one shape as CSV (the benchmarks' tabular output)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


SUMMARY_PANELS = [
    ("reward", ["reward/mean", "eval/reward", "eval/reward_greedy"]),
    ("staleness", ["staleness/mean", "staleness/max"]),
    ("over-commitment Δ", ["buffer/delta"]),
    ("weight sync latency (s)", ["sync/latency_s"]),
    ("throughput", ["throughput/samples_per_s"]),
    ("trainer idle fraction", ["trainer/idle_frac"]),
    ("policy entropy (nats/token)", ["entropy"]),
    ("response length (tokens)", ["response/length_mean", "response/length_min"]),
    ("groups without signal", ["groups/zero_variance_frac", "collapse/active"]),
]


def plot_summary(jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
    """One panel per SUMMARY_PANELS entry, metric vs step; missing metrics leave a panel empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(jsonl)
    fig, axes = plt.subplots(3, 3, figsize=(14, 10))
    for ax, (name, keys) in zip(axes.flat, SUMMARY_PANELS):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if _scalar(r.get(k)) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="." if len(pts) < 50 else None, label=k)
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title or str(Path(jsonl).parent))
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
