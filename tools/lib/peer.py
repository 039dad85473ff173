"""A peer comparison's results.json (tools/compare/peer_compare.py) read back: its runs by task and side,
their eval rows by step, the samples trained by a step; and its figure, the held-out metrics and the
wall-clock of every side over trained samples.

    res = json.loads(Path("results.json").read_text())
    for task in tasks_of(res):
        trl = runs_of(res, task, "trl")
        steps = common_steps(trl)
    plot(res, "compare.png")
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tools.lib.metrics import EVALS
from tools.lib.report import pyplot, save

SIDES = ("project", "trl", "project_fresh", "recorded")
PROJECT_SIDES = ("project", "project_fresh", "recorded")
LABELS = {"project": "this project (sync)", "project_fresh": "this project (sync), fresh AdamW",
          "trl": "TRL GRPOTrainer", "recorded": "this project (recorded CLI runs)"}


def by_step(entry: dict, key: str = "eval/reward") -> dict[int, dict]:
    """A run's eval rows (those with `key`) by step."""
    return {r["step"]: r for r in entry["rows"] if key in r}


def common_steps(entries: list[dict]) -> list[int]:
    """The eval steps every one of `entries` has."""
    sets = [set(by_step(e)) for e in entries]
    return sorted(set.intersection(*sets)) if sets else []


def samples_at(entry: dict, step: int) -> float:
    """Samples a run had trained by `step`: the sum of its rows' `samples` (the project logs each step's),
    else its trained samples pro rata (TRL trains a fixed batch per step)."""
    per = [r["samples"] for r in entry["rows"] if "samples" in r and 0 < r["step"] <= step]
    if per:
        return float(sum(per))
    last = max((r["step"] for r in entry["rows"]), default=0)
    return entry["trained_samples"] * step / last if last else 0.0


def clock_at(entry: dict, step: int) -> float | None:
    """Seconds from the run's time origin to the end of its eval at `step` (peer_compare's docstring)."""
    return by_step(entry).get(step, {}).get("time_s")


def runs_of(res: dict, task: str, side: str) -> list[dict]:
    return [e for k, e in sorted(res["runs"].items()) if k.split("/")[0] == task and k.split("/")[2] == side]


def tasks_of(res: dict) -> list[str]:
    return sorted({k.split("/")[0] for k in res["runs"]})


def plot(res: dict, path: str | Path, text: dict[str, str] | None = None) -> Path:
    """Per task a row, per held-out metric (and the wall-clock) a panel: each side's mean over its seeds
    against trained samples, its min..max a band. `text`: the PNG's text chunks (tools.lib.report.save)."""
    tasks = tasks_of(res)
    panels = [*EVALS, ("wall-clock (s)", "time_s")]
    fig, axes = pyplot().subplots(len(tasks), len(panels), figsize=(4.2 * len(panels), 3.4 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        for ax, (label, key) in zip(row, panels):
            for side, color in zip(SIDES, ("tab:blue", "tab:orange", "tab:green", "tab:purple")):
                runs = runs_of(res, task, side)
                steps = [s for s in common_steps(runs) if all(key in by_step(e)[s] for e in runs)]
                if not steps:
                    continue
                xs = [statistics.mean(samples_at(e, s) for e in runs) for s in steps]
                ys = [[by_step(e)[s][key] for e in runs] for s in steps]
                ax.plot(xs, [statistics.mean(y) for y in ys], color=color, marker="o", ms=3,
                        label=f"{LABELS[side]}, {len(runs)} seeds")
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.2)
            ax.set_title(f"{task.rsplit('.', 1)[-1]}: " + (label if key == "time_s" else f"held-out {label}"),
                         fontsize=9)
            ax.set_xlabel("trained samples", fontsize=8)
            ax.legend(fontsize=7)
    return save(fig, path, dpi=80, text=text)
