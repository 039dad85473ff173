"""What a simulated run reports, in the units and with the formulas of tools/bench/pipeline_bench.py.

`SimResult.summary()` skips the first step, as pipeline_bench does for a real run (there it holds the
engines' warm-up), and computes

    wall_s             last step's end - first kept step's end + that step's batch wait and train time
    tokens_per_s       trained completion tokens / wall_s (samples_per_s likewise)
    trainer_idle_frac  1 - Σ train_s / wall_s
    generator_idle_frac 1 - mean generator busy time (a slot held) / simulated time
    dropped_frac       dropped samples / (trained + dropped samples)
    wasted_tokens      completion tokens generated and never trained on (dropped groups, late samples)
    staleness_hist     trained samples per staleness (versions), from the buffer

`real_summary(run_dir)` reads the same figures from a real run's metrics.jsonl and summary.json, and
`plot_runs` draws a simulated run beside a real one (trained tokens against time, per-step batch
wait and train time, staleness).

Example:
    res = simulate(cfg, costs, workload)
    s = res.summary(); s["tokens_per_s"], s["trainer_idle_frac"]
    plot_runs({"simulated": res.rows_dicts(), "real": real_rows(run_dir)}, "cmp.png")
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["StepRow", "SimResult", "real_summary", "real_rows", "bench_metrics", "plot_runs"]


@dataclass
class StepRow:
    step: int
    batch_wait_s: float
    train_s: float
    samples: int
    tokens: int
    staleness_mean: float
    reward: float
    time_s: float = math.nan
    sync_s: float = math.nan
    delta: int = 0
    dropped_samples: int = 0
    wasted_tokens: float = 0.0


def bench_metrics(rows: list[dict]) -> dict:
    """pipeline_bench's per-run figures from per-step rows (time_s, batch_wait_s, train_s, samples,
    tokens, staleness_mean, dropped_samples, wasted_tokens), the first step skipped."""
    all_rows, rows = rows, (rows[1:] if len(rows) > 1 else rows)
    wall = rows[-1]["time_s"] - rows[0]["time_s"] + rows[0]["batch_wait_s"] + rows[0]["train_s"]
    samples, tokens = sum(r["samples"] for r in rows), sum(r["tokens"] for r in rows)
    dropped = rows[-1]["dropped_samples"]
    return {"steps": len(rows), "wall_s": wall, "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
            "trainer_idle_frac": 1 - sum(r["train_s"] for r in rows) / wall,
            "mean_staleness": sum(r["staleness_mean"] for r in rows) / len(rows),
            "tokens_per_sample": tokens / samples, "dropped_samples": dropped,
            "dropped_frac": dropped / max(dropped + sum(r["samples"] for r in all_rows), 1),
            "wasted_tokens": rows[-1]["wasted_tokens"],
            "batch_wait_s": sum(r["batch_wait_s"] for r in rows) / len(rows),
            "train_s": sum(r["train_s"] for r in rows) / len(rows)}


class SimResult:
    """A simulated run: per-step rows, the buffer's final stats, generator busy times."""

    def __init__(self, cfg, rows: list[StepRow], elapsed_s: float, gen_busy_s: list[float], buffer_stats: dict,
                 reprefill_tokens: list[int], workload: str):
        self.cfg, self.rows, self.elapsed_s, self.gen_busy_s = cfg, rows, elapsed_s, gen_busy_s
        self.buffer_stats, self.reprefill_tokens, self.workload = buffer_stats, reprefill_tokens, workload

    def rows_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.rows]

    def summary(self) -> dict:
        if not self.rows:
            raise ValueError("simulated run has no steps")
        s = bench_metrics(self.rows_dicts())
        st = self.buffer_stats
        busy = sum(self.gen_busy_s) / len(self.gen_busy_s)
        trained = st["trained_samples"]
        s.update({
            "generator_idle_frac": max(0.0, 1 - busy / self.elapsed_s),
            "staleness_hist": {int(k): v for k, v in st["staleness_hist"].items()},
            "stale_frac": sum(v for k, v in st["staleness_hist"].items() if k > 0) / max(trained, 1),
            "dropped_by_reason": st["dropped_samples_by_reason"], "reprefill_tokens": sum(self.reprefill_tokens),
            "mean_delta": sum(r.delta for r in self.rows) / len(self.rows), "elapsed_s": self.elapsed_s,
            "mode": self.cfg.run.mode, "workload": self.workload,
        })
        return s


def real_rows(run_dir: str | Path) -> list[dict]:
    """A real run's per-step rows (metrics.jsonl), in StepRow's field names."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "version/trainer" not in r:
            continue
        rows.append({"step": r["step"], "time_s": r["time_s"], "batch_wait_s": r["time/batch_wait_s"],
                     "train_s": r["time/train_s"], "samples": r["samples"], "tokens": r["tokens"],
                     "staleness_mean": r["staleness/mean"], "reward": r["reward/mean"],
                     "sync_s": r["sync/latency_s"], "delta": r["buffer/delta"],
                     "dropped_samples": r["buffer/dropped_samples"], "wasted_tokens": r["buffer/wasted_tokens"]})
    return rows


def real_summary(run_dir: str | Path) -> dict:
    """pipeline_bench's figures for a real run directory (metrics.jsonl + summary.json)."""
    s = bench_metrics(real_rows(run_dir))
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    gens = [v for k, v in summary["stats"].items() if k.startswith("generator")]
    busy = sum(g["busy_s"] for g in gens) / max(len(gens), 1)
    s["generator_idle_frac"] = max(0.0, 1 - busy / summary["elapsed_s"])
    return s


def plot_runs(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> None:
    """Per run: cumulative trained tokens against time since the first step's end, batch wait and
    train time per step, and mean staleness per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    for name, rows in runs.items():
        t0 = rows[0]["time_s"]
        ts = [r["time_s"] - t0 for r in rows]
        toks, acc = [], 0
        for r in rows:
            acc += r["tokens"]
            toks.append(acc)
        style = "--" if "sim" in name else "-"
        ax[0].plot(ts, toks, style, marker=".", label=name)
        steps = [r["step"] for r in rows]
        ax[1].plot(steps, [r["batch_wait_s"] for r in rows], style, marker=".", label=f"{name}: wait")
        ax[1].plot(steps, [r["train_s"] for r in rows], style, marker="x", label=f"{name}: train")
        ax[2].plot(steps, [r["staleness_mean"] for r in rows], style, marker=".", label=name)
    ax[0].set(xlabel="seconds since step 1 ended", ylabel="trained tokens", title="throughput")
    ax[1].set(xlabel="step", ylabel="seconds", title="per step: batch wait, train")
    ax[2].set(xlabel="step", ylabel="mean staleness", title="staleness of trained samples")
    for a in ax:
        a.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
