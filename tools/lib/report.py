"""Tables and figures the tools write: Markdown tables, a figure saved with its folder made, curves of
metrics over steps, and a result set written as NAME.md, NAME.json (and NAME.png by the caller); the
figures the results book (docs/results, `python -m tools.report`) redraws from its data files.

    print(markdown_table(["model", "ms"], [["tiny", "3.1"]], align="-:"))
    header, rows = table_cells(text)                       # the cells of a Markdown table, back
    plt = pyplot()
    fig, axes = plt.subplots(1, 3)
    plot_curves(axes, {"seq_is": rows_a, "tis": rows_b}, [("ESS", ["is_ess"], 1)])
    save(fig, out / "compare.png")                         # no version or date in the file: same data, same bytes
    write_results(out, "compare", text, results)           # compare.md, compare.json (rows left out)
    publish(out, "compare", text, results, "correction_compare")   # the same, the table printed first
"""

from __future__ import annotations

import json
import re
import statistics
import zlib
from pathlib import Path

from tools.lib.metrics import series


def markdown_row(cells: list) -> str:
    """One row: `| a | b |`, an empty cell as `| |`."""
    return "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)


def markdown_table(header: list[str], rows: list[list], align: str = "") -> str:
    """A Markdown table; `align` one character a column: "-" left (the default), ":" right."""
    marks = ["---:" if (align[i:i + 1] == ":") else "---" for i in range(len(header))]
    lines = [markdown_row(header), "|" + "|".join(marks) + "|"]
    lines += [markdown_row([str(c) for c in row]) for row in rows]
    return "\n".join(lines)


_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def table_cells(text: str) -> tuple[list[str], list[list[str]], str]:
    """A Markdown table back into (header, rows, align): cells as written (an escaped `\\|` stays in its
    cell), align one character a column as markdown_table takes it."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    split = [[c.strip() for c in _CELL_SPLIT.split(ln[1:-1])] for ln in lines]
    align = "".join(":" if m.endswith(":") else "-" for m in split[1])
    return split[0], split[2:], align


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display: the tools write files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int = 90, text: dict[str, str] | None = None) -> Path:
    """Lay out, write (making the folder) and close a figure. A PNG carries no software version or date
    (the same figure gives the same bytes) and `text` as its text chunks (png_text reads them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    meta = {"Software": None, **(text or {})} if path.suffix == ".png" else None
    fig.savefig(path, dpi=dpi, metadata=meta)
    pyplot().close(fig)
    return path


def png_text(path: str | Path) -> dict[str, str]:
    """The text chunks (tEXt, zTXt, iTXt) of a PNG ({} for a file that is not one)."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return {}
    out, i = {}, 8
    while i + 8 <= len(data):
        n, kind = int.from_bytes(data[i:i + 4], "big"), data[i + 4:i + 8]
        body = data[i + 8:i + 8 + n]
        if kind == b"tEXt":
            k, _, v = body.partition(b"\0")
            out[k.decode("latin-1")] = v.decode("latin-1")
        elif kind == b"zTXt":
            k, _, v = body.partition(b"\0")
            out[k.decode("latin-1")] = zlib.decompress(v[1:]).decode("latin-1")
        elif kind == b"iTXt":
            k, _, rest = body.partition(b"\0")
            flag, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")
            _, _, v = rest.partition(b"\0")
            out[k.decode("latin-1")] = (zlib.decompress(v) if flag else v).decode("utf-8")
        elif kind == b"IEND":
            break
        i += 12 + n
    return out


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


def plot_accuracy(runs: dict[str, list[list[dict]]], path: str | Path, title: str = "",
                  text: dict[str, str] | None = None) -> Path:
    """Held-out greedy (top) and sampled (bottom) accuracy against trained samples, wall-clock and
    generated tokens (eval_points of each run). `runs`: label -> the seeds' points; several seeds are
    drawn as their mean with each seed faint. `text`: the PNG's text chunks (save)."""
    xs = (("samples", "trained samples"), ("seconds", "wall-clock s"), ("gen_tokens", "generated tokens"))
    fig, axes = pyplot().subplots(2, 3, figsize=(15, 8), squeeze=False)
    for k, (label, curves) in enumerate(runs.items()):
        color = f"C{k}"
        n = min(len(c) for c in curves)
        for row, key in enumerate(("greedy", "sampled")):
            for col, (x, xlabel) in enumerate(xs):
                ax = axes[row][col]
                for c in curves if len(curves) > 1 else []:
                    ax.plot([p[x] for p in c], [p[key] for p in c], color=color, alpha=0.25, lw=1)
                mx = [sum(c[i][x] for c in curves) / len(curves) for i in range(n)]
                my = [sum(c[i][key] for c in curves) / len(curves) for i in range(n)]
                ax.plot(mx, my, "o-", color=color, label=f"{label} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(f"held-out {key} accuracy")
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save(fig, path, dpi=110, text=text)


def plot_learning_curves(runs: dict[str, list[dict]], path: str | Path, budget_min: float, title: str = "",
                         text: dict[str, str] | None = None) -> Path:
    """Held-out greedy and sampled accuracy of each run (label -> its eval rows) over wall time (minutes
    since the run started, the budget marked) and over steps."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, ev) in enumerate(runs.items()):
        c = colors[i % len(colors)]
        for ax, x in ((axes[0], [r["time_s"] / 60 for r in ev]), (axes[1], [r["step"] for r in ev])):
            ax.plot(x, [r["eval/reward_greedy"] for r in ev], "o-", color=c, label=f"{name}: greedy")
            ax.plot(x, [r["eval/reward"] for r in ev], "s--", color=c, alpha=0.7, label=f"{name}: sampled")
    axes[0].axvline(budget_min, color="grey", lw=0.8, ls=":")
    axes[0].set_xlabel("wall time (minutes since the run started)")
    axes[1].set_xlabel("step")
    axes[0].set_ylabel("held-out accuracy")
    for ax in axes:
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[1].legend(loc="upper left", fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save(fig, path, dpi=110, text=text)


def plot_modes(summaries: list[dict], runs: dict[str, list[dict]], path: str | Path, title: str,
               text: dict[str, str] | None = None) -> Path:
    """async against sync (pipeline_bench's results.json): per metric the median bar per mode, every
    repeat a dot."""
    panels = [("samples_per_s", "trained samples / s"), ("tokens_per_s", "trained tokens / s"),
              ("trainer_idle_frac", "trainer idle fraction"), ("generator_idle_frac", "generator idle fraction")]
    fig, axes = pyplot().subplots(1, len(panels), figsize=(15, 3.5))
    modes = [m["mode"] for m in summaries]
    for ax, (key, name) in zip(axes, panels):
        ax.bar(modes, [m[key]["median"] for m in summaries], color=["tab:gray", "tab:blue"][: len(modes)], alpha=0.7)
        for x, mode in enumerate(modes):
            ax.plot([x] * len(runs[mode]), [r[key] for r in runs[mode]], "k.", ms=6)
        ax.set_title(name)
    fig.suptitle(f"async vs sync, {title} (bars: median; dots: repeats)")
    return save(fig, path, dpi=90, text=text)


def plot_recipes(results: list[dict], path: str | Path, text: dict[str, str] | None = None) -> Path:
    """recipe_compare's results: held-out greedy and sampled accuracy over trained samples, each
    recipe's mean with its seeds' min..max as a band."""
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 3.8))
    for ax, name in zip(axes, ("greedy", "sampled")):
        for r in results:
            if "curve" not in r:
                continue
            per = r.get("samples_per_step") or 1
            pts = r["curve"][name]
            xs = [s * per for s, _ in pts]
            line, = ax.plot(xs, [d["mean"] for _, d in pts], marker="o", label=f"{r['recipe']} ({r['ok']} seed(s))")
            if r["ok"] > 1:
                ax.fill_between(xs, [d["min"] for _, d in pts], [d["max"] for _, d in pts], alpha=0.15,
                                color=line.get_color())
        ax.set_title(f"held-out accuracy, {name} (mean; band: min..max over seeds)", fontsize=9)
        ax.set_xlabel("trained samples", fontsize=8)
        ax.legend(fontsize=7)
    return save(fig, path, dpi=80, text=text)


ENGINE_START_KEYS = ("start_s", "core_cpu_s", "tok_s")


def engine_start_summary(rows: list[dict]) -> dict:
    """tools.bench.engine_start's rows: per way (fork, spawn) the median, min and max of each figure, and
    the ratios of the medians fork/spawn."""
    import statistics

    out: dict = {}
    for way in ("fork", "spawn"):
        mine = [r for r in rows if r["way"] == way]
        out[way] = {k: {"median": statistics.median(r[k] for r in mine), "min": min(r[k] for r in mine),
                        "max": max(r[k] for r in mine)} for k in ENGINE_START_KEYS}
    out["ratio_fork_over_spawn"] = {k: out["fork"][k]["median"] / out["spawn"][k]["median"] for k in ENGINE_START_KEYS}
    return out


def plot_engine_start(rows: list[dict], path: str | Path, text: dict[str, str] | None = None) -> Path:
    """tools.bench.engine_start's rows: start seconds, core CPU seconds and tokens/s, each start a dot,
    the median a bar, forked beside spawned."""
    import statistics

    plt = pyplot()
    ways = ["fork", "spawn"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (key, label) in zip(axes, [("start_s", "engine start (s)"), ("core_cpu_s", "core CPU at ready (s)"),
                                       ("tok_s", "tokens/s")]):
        for i, way in enumerate(ways):
            ys = [r[key] for r in rows if r["way"] == way]
            ax.scatter([i] * len(ys), ys, alpha=0.7)
            ax.hlines(statistics.median(ys), i - 0.25, i + 0.25)
        ax.set_xticks(range(len(ways)), ["forked", "spawned"])
        ax.set_title(label)
        ax.set_xlim(-0.6, len(ways) - 0.4)
        ax.set_ylim(bottom=0)
    fig.suptitle("vLLM CPU engine core: forked from the generator's process vs spawned")
    return save(fig, path, dpi=110, text=text)


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
