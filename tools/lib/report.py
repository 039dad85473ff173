"""Tables and figures the tools write: Markdown tables, a figure saved with its folder made, curves of
metrics over steps, and a result set written as NAME.md, NAME.json (and NAME.png by the caller).

    print(markdown_table(["model", "ms"], [["tiny", "3.1"]], align="-:"))
    plt = pyplot()
    fig, axes = plt.subplots(1, 3)
    plot_curves(axes, {"seq_is": rows_a, "tis": rows_b}, [("ESS", ["is_ess"], 1)])
    save(fig, out / "compare.png")
    write_results(out, "compare", text, results)           # compare.md, compare.json (rows left out)
    publish(out, "compare", text, results, "correction_compare")   # the same, the table printed first
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tools.lib.metrics import series


def markdown_table(header: list[str], rows: list[list], align: str = "") -> str:
    """A Markdown table; `align` one character a column: "-" left (the default), ":" right."""
    marks = ["---:" if (align[i:i + 1] == ":") else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display: the tools write files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int = 90) -> Path:
    """Lay out, write (making the folder) and close a figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def rolling_median(ys: list[float], win: int) -> list[float]:
    if win <= 1:
        return list(ys)
    return [statistics.median(ys[max(0, i - win // 2):i + win // 2 + 1]) for i in range(len(ys))]


def plot_curves(axes, runs: dict[str, list[dict]], panels: list[tuple[str, list[str], int]],
                xlabel: str = "step") -> None:
    """One panel an axis: (title, metric keys, rolling-median window). Each run's rows draw one line a
    key (labelled by the key for one run, else by the run, and the key where a panel has several)."""
    for ax, (title, keys, win) in zip(axes, panels):
        for label, rows in runs.items():
            for k in keys:
                xs, ys = series(rows, k)
                if xs:
                    name = k if len(runs) == 1 else label if len(keys) == 1 else f"{label}: {k}"
                    ax.plot(xs, rolling_median(ys, win), marker="o" if len(xs) < 20 else None, ms=3, label=name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        if ax.lines:
            ax.legend(fontsize=7)


def write_results(out: Path, name: str, text: str, results, drop: tuple[str, ...] = ("rows",)) -> None:
    """NAME.md (the table) and NAME.json (the results, each dict without the `drop` keys)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    if isinstance(results, list):
        results = [{k: v for k, v in r.items() if k not in drop} if isinstance(r, dict) else r for r in results]
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))


def publish(out: Path, name: str, text: str, results, tool: str, drop: tuple[str, ...] = ("rows",)) -> None:
    """A comparison's end: the table printed, then written with the results (write_results), and said."""
    print("\n" + text)
    write_results(out, name, text, results, drop)
    print(f"[{tool}] wrote {out / name}.md and {out / name}.json", flush=True)
