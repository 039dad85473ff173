"""A run's records as the tools read them: metrics.jsonl rows (training steps, evaluations), summary.json.

    rows = run_rows(run_dir)                  # or a kept metrics .jsonl file
    steps, evals = step_rows(rows), eval_rows(rows)
    points = eval_points(rows)                # per eval: trained samples, seconds, generated tokens, accuracy

A training step's row carries "reward/mean" (and "version/trainer"); an evaluation's carries
"eval/reward". Rows keep the CLI's keys (pipeline/driver/metrics.py writes them).
"""

from __future__ import annotations

import json
from pathlib import Path

STEP_KEY = "reward/mean"
EVAL_KEY = "eval/reward"
EVALS = (("greedy", "eval/reward_greedy"), ("sampled", "eval/reward"), ("pass@k", "eval/pass@k"))
"""The held-out figures an evaluation row carries: (name, key)."""


def read_rows(path: str | Path) -> list[dict]:
    """The JSON lines of `path` ([] while it does not exist yet: a run that has not logged)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_rows(src: str | Path) -> list[dict]:
    """A run directory's metrics.jsonl, or a metrics .jsonl file kept on its own (docs/results/data)."""
    src = Path(src)
    path = src / "metrics.jsonl" if src.is_dir() else src
    if not path.is_file():
        raise FileNotFoundError(f"{src}: no metrics.jsonl")
    return read_rows(path)


def step_rows(rows: list[dict], key: str = STEP_KEY) -> list[dict]:
    """The training steps' rows (those carrying `key`)."""
    return [r for r in rows if key in r]


def eval_rows(rows: list[dict]) -> list[dict]:
    """The evaluations' rows."""
    return [r for r in rows if EVAL_KEY in r]


def read_summary(run_dir: str | Path) -> dict:
    """The run's summary.json ({} when it did not write one: it failed or is still running)."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the rows with a number under `key`."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


def eval_points(rows: list[dict]) -> list[dict]:
    """The eval points of one run: step, trained samples (the sum of `samples` of the steps so far),
    seconds (`time_s`), generated tokens (the sum of `batch/tokens` of the trained batches plus
    `buffer/wasted_tokens`, the tokens of groups dropped as stale or without a reward spread), greedy
    and sampled accuracy, and the last step's entropy."""
    samples = tokens = wasted = 0.0
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
                        "sampled": r.get("eval/reward", float("nan")), "pass@k": r.get("eval/pass@k", float("nan")),
                        "entropy": entropy})
    return out
