"""The results book's tables and plots computed from the raw data the tools wrote (docs/results/data):
VIEWS[name](path) -> (header, rows) for a table marker's `view=name`; PLOTS[name](root, spec, out, text)
draws data/plots.json's entry `spec` into `out` (tools/report.py says how both are named).

    header, rows = VIEWS["elastic_phases"](Path("docs/results/data/elastic/elastic.json"))

A view formats its figures as the page prints them; a missing file or key raises DataError naming the
file.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tools.lib import peer
from tools.lib.metrics import eval_points, read_rows
from tools.lib.report import (engine_start_summary, plot_accuracy, plot_engine_start, plot_learning_curves, plot_modes,
                              plot_recipes)


class DataError(Exception):
    """A data file that is missing or does not hold what its table or plot reads."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def load_json(path: Path):
    if not path.exists():
        raise DataError(path, "missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(path, f"not JSON ({e})") from None


def load_rows(path: Path) -> list[dict]:
    """A kept metrics .jsonl file's rows."""
    if not path.exists():
        raise DataError(path, "missing")
    try:
        return read_rows(path)
    except ValueError as e:
        raise DataError(path, f"not JSON lines ({e})") from None


# ---- plots: data/plots.json's "draw" names ----

def draw_accuracy(root: Path, spec: dict, out: Path, text: dict) -> Path:
    """{"runs": {label: [metrics .jsonl, ...]}, "title": ...}: tools.lib.report.plot_accuracy."""
    runs = {label: [eval_points(load_rows(root / f)) for f in files] for label, files in spec["runs"].items()}
    return plot_accuracy(runs, out, spec.get("title", ""), text=text)


def draw_learning_curves(root: Path, spec: dict, out: Path, text: dict) -> Path:
    """{"runs": {label: metrics .jsonl}, "budget_min": ..., "title": ...}: tools.lib.report.plot_learning_curves."""
    runs = {label: [r for r in load_rows(root / f) if "eval/reward_greedy" in r] for label, f in spec["runs"].items()}
    return plot_learning_curves(runs, out, spec["budget_min"], spec.get("title", ""), text=text)


def draw_modes(root: Path, spec: dict, out: Path, text: dict) -> Path:
    """{"results": pipeline_bench's results.json, "title": ...}: tools.lib.report.plot_modes."""
    d = load_json(root / spec["results"])
    return plot_modes(d["summary"], d["runs"], out, spec["title"], text=text)


def draw_recipes(root: Path, spec: dict, out: Path, text: dict) -> Path:
    """{"results": recipe_compare's recipes.json}: tools.lib.report.plot_recipes."""
    return plot_recipes(load_json(root / spec["results"]), out, text=text)


def draw_peer(root: Path, spec: dict, out: Path, text: dict) -> Path:
    """{"results": peer_compare's results.json}: tools.lib.peer.plot."""
    return peer.plot(load_json(root / spec["results"]), out, text=text)


def draw_engine_start(root: Path, spec: dict, out: Path, text: dict) -> Path:
    """{"results": tools.bench.engine_start's engine_start.json}: tools.lib.report.plot_engine_start."""
    return plot_engine_start(load_json(root / spec["results"])["rows"], out, text=text)


PLOTS = {"accuracy": draw_accuracy, "learning_curves": draw_learning_curves, "modes": draw_modes,
         "recipes": draw_recipes, "peer": draw_peer, "engine_start": draw_engine_start}


# ---- tables: a marker's view= names ----

VIEWS: dict = {}


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def sci(x: float, digits: int = 2) -> str:
    """7.55e-3 (Python's 7.55e-03 without the exponent's leading zero); 0 as "0"."""
    if x == 0:
        return "0"
    m, e = f"{x:.{digits}e}".split("e")
    return f"{m}e{int(e)}"


def spread(xs, fmt, bold: bool = False) -> str:
    """mean (min..max), each formatted by `fmt` (a format spec or a function); the mean in bold."""
    f = fmt if callable(fmt) else (lambda v: format(v, fmt))
    xs = list(xs)
    m = f(mean(xs))
    return f"{f'**{m}**' if bold else m} ({f(min(xs))}..{f(max(xs))})"


def median_range(xs, fmt) -> str:
    """median (min..max)."""
    f = fmt if callable(fmt) else (lambda v: format(v, fmt))
    return f"{f(statistics.median(xs))} ({f(min(xs))}..{f(max(xs))})"


def files(folder: Path, pattern: str) -> list[Path]:
    found = sorted(folder.glob(pattern))
    if not found:
        raise DataError(folder / pattern, "missing")
    return found


# audit-minibatches.md: tools/compare/minibatch_clips.py's --json (its table, each run's per-step figures)

MINIBATCH_COLS = ("clip_frac", "clip_low_frac", "clip_high_frac")
MINIBATCH_HEADER = ["recipe", "seeds", *MINIBATCH_COLS, "recipe-specific", "greedy acc, step 0 → last",
                    "sampled acc, step 0 → last", "flat groups dropped", "wall min"]


def _agg(vals: list[float | None], spec: str | None = None) -> str:
    """The mean over the runs, with (min..max) when there is more than one."""
    ok = [v for v in vals if v is not None]
    if not ok:
        return "-"
    m = sum(ok) / len(ok)
    if spec is None:
        spec = ".3f" if max(abs(v) for v in ok) >= 0.01 or m == 0 else ".2g"
    fmt = lambda x: format(x, spec)  # noqa: E731
    return fmt(m) if len(ok) == 1 else f"{fmt(m)} ({fmt(min(ok))}..{fmt(max(ok))})"


def minibatch_rows(runs: dict[str, dict[int, dict]]) -> list[list[str]]:
    """One row a recipe: the mean over its finished seeds, (min..max) with more than one. A run in
    flight, a failed one and one that never trained are left out."""
    rows = []
    for recipe, by_seed in runs.items():
        done = sorted(s for s in by_seed if by_seed[s]["finished"] and by_seed[s]["rc"] in (0, None)
                      and by_seed[s]["steps"])
        rs = [by_seed[s] for s in done]
        if not rs:
            continue
        spec = []
        for k in ("seq_clip_frac", "seq_ratio_std", "cispo_clip_frac", "overlong_filtered_frac"):
            vals = [r["mean"].get(k) for r in rs]
            if any(v is not None for v in vals) and (k != "overlong_filtered_frac" or any(vals)):
                spec.append(f"`{k}` {_agg(vals)}")

        def acc(name: str) -> str:
            first = [_eval(r, 0).get(name) for r in rs]
            last = [_eval(r, max(int(s) for s in r["evals"])).get(name) if r["evals"] else None for r in rs]
            return f"{_agg(first)} → {_agg(last)}"

        wall = [r["wall_s"] / 60 if r["wall_s"] else None for r in rs]
        rows.append([recipe, ",".join(str(s) for s in done),
                     *(_agg([r["mean"].get(c) for r in rs]) for c in MINIBATCH_COLS),
                     "; ".join(spec) or "-", acc("greedy"), acc("sampled"),
                     _agg([r["zero_signal_dropped"] for r in rs], ".1f"), _agg(wall, ".1f")])
    return rows


def _eval(run: dict, step: int) -> dict:
    """A run's held-out figures at `step` (the evals keyed by step, as ints or, read back from JSON, strings)."""
    return run["evals"].get(step, run["evals"].get(str(step), {}))


def _minibatch_runs(path: Path) -> dict[str, dict[int, dict]]:
    return {recipe: {int(s): r for s, r in by_seed.items()} for recipe, by_seed in load_json(path)["runs"].items()}


def minibatch_clips(path: Path):
    return MINIBATCH_HEADER, minibatch_rows(_minibatch_runs(path))


def minibatch_last_eval(path: Path):
    """Each recipe's held-out greedy and sampled accuracy at its last eval, seed by seed."""
    rows = []
    for recipe, by_seed in _minibatch_runs(path).items():
        last = [_eval(by_seed[s], max(int(k) for k in by_seed[s]["evals"])) for s in sorted(by_seed)]
        rows.append([recipe, ", ".join(f"{e['greedy']:.3f}" for e in last),
                     ", ".join(f"{e['sampled']:.3f}" for e in last)])
    return ["recipe", "greedy", "sampled"], rows


# audit-rmsnorm.md: tools/compare/rmsnorm_order.py and tools/compare/norm_vllm.py

def rmsnorm_trainer_vs_hf(path: Path):
    runs = load_json(path)["runs"]
    col = lambda order, k: [r[order][k] for r in runs]  # noqa: E731
    zero = lambda xs: "0" if not any(xs) else spread(xs, sci)  # noqa: E731
    rows = [["norm outputs one bf16 step from HF's",
             f"{mean(r['norm_outputs_apart'] for r in runs):.3f} ({min(r['norm_outputs_apart'] for r in runs):.4f}.."
             f"{max(r['norm_outputs_apart'] for r in runs):.4f})", "0"],  # HF's order is HF's norm: 0 by construction
            ["mean \\|Δ log p\\|, next tokens", spread(col("torch", "token_dlogp_mean"), sci),
             spread(col("hf", "token_dlogp_mean"), sci, bold=True)],
            ["max \\|Δ log p\\|, next tokens", spread(col("torch", "token_dlogp_max"), sci),
             zero(col("hf", "token_dlogp_max"))],
            ["mean \\|Δ log p\\|, whole distribution", spread(col("torch", "dist_dlogp_mean"), sci),
             zero(col("hf", "dist_dlogp_mean"))]]
    return [f"{len(runs)} seeds (mean, min..max)", "torch's order (before)", "HF's order (after)"], rows


def rmsnorm_vllm(path: Path):
    d = load_json(path)["orders"]
    hf, torch = d["hf"], d["torch"]
    rows = [[str(i + 1), f"{h['tokens']:,}", f"{h['mean_abs']:.4f}", f"{t['mean_abs']:.4f}",
             f"{t['mean_abs'] / h['mean_abs']:.2f}"] for i, (h, t) in enumerate(zip(hf, torch))]
    mh, mt = [x["mean_abs"] for x in hf], [x["mean_abs"] for x in torch]
    rows.append(["mean (min..max)", "", spread(mh, ".4f", bold=True), spread(mt, ".4f", bold=True),
                 f"{mean(mt) / mean(mh):.2f}"])
    return ["repeat", "completion tokens", "mean \\|log p_engine − log p_trainer\\|, HF order (now)",
            "torch order (before)", "torch / HF"], rows


# audit-warm-start.md: tools/compare/warm_start_moments.py

def warm_start_first_steps(path: Path):
    runs = load_json(path)["runs"]
    seeds = sorted(runs)
    steps = len(runs[seeds[0]]["carried"])
    col = lambda arm, k, key: [runs[s][arm][k][key] for s in seeds]  # noqa: E731
    rows = [[str(k + 1), spread(col("carried", k, "update_norm"), ".4f"), spread(col("reset", k, "update_norm"), ".3f"),
             f"{mean(col('carried', k, 'update_per_lr_sqrt_n')):.2f}", f"{mean(col('reset', k, 'update_per_lr_sqrt_n')):.2f}",
             spread(col("carried", k, "cos_last_warm_update"), ".2f", bold=k == 0),
             spread(col("reset", k, "cos_last_warm_update"), ".3f")] for k in range(steps)]
    return ["RL step", "carried: \\|Δθ\\|", "reset: \\|Δθ\\|", "carried: \\|Δθ\\|/(lr·√n)", "reset: \\|Δθ\\|/(lr·√n)",
            "carried: cos with the warm start", "reset: cos with the warm start"], rows


# benchmarks.md

def async_vs_sync(path: Path):
    """tools/bench/pipeline_bench.py's results.json: median (min..max) over the repeats, per mode."""
    cell = lambda m, k, f, bold=False: (  # noqa: E731
        (f"**{m[k]['median']:{f}}**" if bold else f"{m[k]['median']:{f}}") + f" ({m[k]['min']:{f}}..{m[k]['max']:{f}})")
    rows = [[m["mode"], cell(m, "samples_per_s", ".1f"), cell(m, "tokens_per_s", ".0f"),
             cell(m, "trainer_idle_frac", ".2f", bold=m["mode"] == "async"), cell(m, "generator_idle_frac", ".2f"),
             f"{m['mean_staleness']['median']:.2f}", f"{m['dropped_samples']['median']:.0f}"]
            for m in load_json(path)["summary"]]
    return ["mode", "trained samples/s", "trained tokens/s", "trainer idle", "generator idle", "mean staleness",
            "dropped samples"], rows


def engine_start(path: Path):
    """tools/bench/engine_start.py's engine_start.json: median (min..max) over the starts, per way, and the
    ratios of the medians (tools.lib.report.engine_start_summary)."""
    rows = load_json(path)["rows"]
    s = engine_start_summary(rows)
    cell = lambda m, f: f"{m['median']:{f}} ({m['min']:{f}}..{m['max']:{f}})"  # noqa: E731
    out = [[name, str(sum(r["way"] == way for r in rows)), cell(s[way]["start_s"], ".1f"),
            cell(s[way]["core_cpu_s"], ".1f"), cell(s[way]["tok_s"], ".0f")]
           for way, name in (("fork", "forked from the generator's process"), ("spawn", "spawned (vLLM's CPU default)"))]
    r = s["ratio_fork_over_spawn"]
    out.append(["forked / spawned (medians)", "", f"**{r['start_s']:.2f}x**", f"{r['core_cpu_s']:.2f}x", f"{r['tok_s']:.2f}x"])
    return ["engine core", "starts", "engine start (s)", "core CPU at ready (s)", "tokens/s"], out


VIEWS["engine_start"] = engine_start


def trainer_ragged(folder: Path):
    """tools/bench/trainer_bench.py --ragged, before.json and after.json: per micro_batch_size the step's
    median (min..max), and the second setting's step over the first's."""
    rows = []
    for name, tree in (("before", "before"), ("after", "as it lands")):
        r = load_json(folder / f"{name}.json")["rows"]
        rows.append([tree, *(median_range(x["step_s"], ".2f") for x in r), median_range(r[1]["ratio_to_first"], ".3f")])
    return ["tree", "`micro_batch_size` 0, step s median (min..max)", "8", "8 over 0, per step"], rows


GIB = 2 ** 30
H200_RUNS = (("tiny.json", "`gpu_check.py` (tiny, 32 x 256)"),
             ("qwen3.json", "`--qwen3 Qwen3-0.6B` (596 M params, vocab 151,936; 32 x 256)"),
             ("qwen3_long.json", "`--qwen3 Qwen3-0.6B --samples 64 --seq-len 1024 --prompt-len 256 --micro-batch 16`"))
H200_CHUNKS = (("qwen3.json", "32 x 256"), ("qwen3_long.json", "64 x 1,024, micro-batch 16"),
               ("long_c4096.json", "same"), ("long_c16384.json", "same"))


def _ms(s: float) -> str:
    ms = s * 1000
    return f"{ms:,.1f}"


def h200_steps(folder: Path):
    """tools/probe/gpu_check.py --out, one JSON a run."""
    rows = []
    for f, name in H200_RUNS:
        d = load_json(folder / f)
        rows.append([name, f"{_ms(statistics.median(d['step_s']))} ms ({_ms(min(d['step_s']))}..{_ms(max(d['step_s']))}), "
                           f"{d['steps']} steps",
                     f"{d['trained_tokens_per_s']:,.0f} / {d['total_tokens_per_s']:,.0f}", f"{d['peak_cuda_bytes'] / GIB:.2g} GiB"
                     if d["peak_cuda_bytes"] < GIB else f"{d['peak_cuda_bytes'] / GIB:.1f} GiB"])
    return ["run", "step time, median (min..max)", "tokens/s trained / total", "peak CUDA memory"], rows


def h200_chunked_head(folder: Path):
    """The full [tokens, vocab] logits against the chunked head, one step each (gpu_check's chunk_vs_full)."""
    rows = []
    for f, batch in H200_CHUNKS:
        d = load_json(folder / f)
        c = d["chunk"]
        full, chunked = d["chunk_vs_full"]["0"], d["chunk_vs_full"][str(c)]
        mem = lambda k: (f"{full[k] / GIB:.1f} -> {chunked[k] / GIB:.1f} GiB "  # noqa: E731
                         f"({chunked[k] / full[k]:.2f}x)")
        ms = [x["step_s"] * 1000 for x in (full, chunked)]
        step = (f"{ms[0]:.1f} -> {ms[1]:.1f} ms" if ms[0] < 1000 else f"{ms[0]:,.0f} -> {ms[1]:,.0f} ms") + \
            f" ({ms[1] / ms[0]:.2f}x)"
        whole = " (a whole micro-batch)" if c >= d["seq_len"] * d["samples"] // 4 else ""
        rows.append([batch, f"{c:,}{whole}", mem("peak_bytes"), mem("peak_above_start_bytes"), step])
    return ["batch", "chunk (tokens)", "peak, full -> chunked", "above start, full -> chunked", "step, full -> chunked"], rows


# elastic-generators.md: tools/probe/elastic_run.py's data file

ELASTIC_PHASES = ("1 generator (before)", "1 generator, the 2nd's engine starting", "2 generators", "1 generator (after)")


def elastic_phase_rows(res: dict) -> list[list[str]]:
    return [[name, ph["steps"], f"{ph['steps_per_s']:.2f}", f"{ph['trained_tokens_per_s']:.0f}",
             f"{ph['gen_tokens_per_s']:.0f}", f"{ph['trainer_idle']:.2f}", f"{ph['staleness_max']:.0f}"]
            for name, ph in zip(ELASTIC_PHASES, res["run_a"]["phases"])]


ELASTIC_PHASE_HEADER = ["phase", "steps", "steps/s", "trained tokens/s", "generators' tokens/s", "trainer idle",
                        "max staleness"]


def elastic_phases(path: Path):
    return ELASTIC_PHASE_HEADER, elastic_phase_rows(load_json(path))


def elastic_checks(path: Path):
    res = load_json(path)
    a, b = res["run_a"], res["run_b"]
    yes = lambda v: "yes" if v else "no"  # noqa: E731

    def dropped(c: dict, note: str) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in c["dropped_groups"].items())
        return f"{kinds}, none failed{note}" if c["no_group_lost"] else f"{kinds}: a group lost"

    ca, cb = a["checks"], b["checks"]
    rows = [["exit code", str(a["rc"]), f"{b['rc']} (resumed from step {b['resumed_from']}, generators at the end "
                                         f"`{b['generators']}`)"],
            ["steps", str(ca["steps"]), str(cb["steps"])],
            ["accounting identity (admitted = trained + dropped + held)",
             *("holds" if c["accounting"] else "broken" for c in (ca, cb))],
            ["groups dropped", dropped(ca, " (no group lost)"), dropped(cb, "")],
            ["groups requeued", str(ca["requeued_groups"]), str(cb["requeued_groups"])],
            ["samples logged / each group trained once and whole",
             *(f"{c['samples_logged']} / {yes(c['each_group_once_whole'])}" for c in (ca, cb))],
            ["max staleness (buffer.max_staleness = 1)", str(ca["staleness_max"]), str(cb["staleness_max"])],
            ["pushes verified", *(f"{c['pushes']['verified']} / {c['pushes']['started']}" for c in (ca, cb))]]
    return ["", "run A (1 → 2 → 1)", "run B (resumed into 1 generator)"], rows


# openenv.md: each run's metrics (eval rows and step totals), one .jsonl a seed

def openenv_tiny(folder: Path):
    runs = [(p.stem.rsplit("_s", 1)[1], load_rows(p)) for p in files(folder, "tiny_keyvault_s*.jsonl")]
    rows, gains, first, last, gfirst, glast = [], [], [], [], [], []
    for seed, rs in runs:
        ev = [r for r in rs if "eval/reward" in r]
        a, b = ev[0], ev[-1]
        rows.append([seed, f"{a['warm_start/steps']:.0f}", f"{a['eval/reward']:.3f} → **{b['eval/reward']:.3f}**",
                     f"{a['eval/reward_greedy']:.3f} → {b['eval/reward_greedy']:.3f}", f"{rs[-1]['time_s']:.0f} s"])
        first.append(a["eval/reward"]), last.append(b["eval/reward"])
        gfirst.append(a["eval/reward_greedy"]), glast.append(b["eval/reward_greedy"])
        gains.append(b["eval/reward"] - a["eval/reward"])
    rows.append(["mean", "", f"{mean(first):.3f} → **{mean(last):.3f}** (gain {mean(gains):+.2f}, spread "
                              f"{min(gains):+.2f} to {max(gains):+.2f})", f"{mean(gfirst):.3f} → {mean(glast):.3f}", ""])
    step = max(r["step"] for _, rs in runs for r in rs)
    return ["seed", "warm-start steps", f"sampled reward, step 0 → {step}", f"greedy, step 0 → {step}", "wall-clock"], rows


def openenv_smollm2(folder: Path):
    zero = load_json(folder / "smollm2_keyvault_auto_warm_start.json")
    runs = [[r for r in load_rows(p) if "eval/reward" in r] for p in files(folder, "smollm2_keyvault_ws2_s*.jsonl")]
    one = lambda xs, f: f"{xs[0]:{f}}" if len(set(xs)) == 1 else " / ".join(f"{x:{f}}" for x in xs)  # noqa: E731
    rows = [["zero-shot (the pre-flight probe of a run without a warm start, seed 1)",
             f"{zero['warm_start/before/mean_reward']:.3f} (no group with a reward spread)", "", ""]]
    for i, evs in enumerate(zip(*runs)):
        step = evs[0]["step"]
        name = (f"after {runs[0][0].get('warm_start/steps', 0):.0f} supervised steps (step 0)" if step == 0 else
                f"step {step} of GRPO" if i == 1 else f"step {step}")
        sampled = " / ".join(f"{e['eval/reward']:.3f}" for e in evs)
        last = i == len(runs[0]) - 1
        rows.append([name, f"**{sampled}**" if last else sampled, one([e["eval/reward_greedy"] for e in evs], ".3f"),
                     " / ".join(f"{e['eval/pass@k']:.2f}" for e in evs)])
    return ["start", "held-out sampled reward, seeds 1 / 2 / 3", "greedy", "pass@2, seeds 1 / 2 / 3"], rows


# distillation.md: the runs' metrics (data/opd_smollm2, data/smollm2_runs, data/rg_smollm2)

OPD_ROWS = (  # label, runs, cell: seeds (greedy / greedy (sampled / sampled)), range (greedy min-max), one
    ("**OPD, lr 2e-5**, seeds 11 / 12", ("opd_smollm2/opd_add_lr2e-5_s11", "opd_smollm2/opd_add_lr2e-5_s12"), "seeds"),
    ("OPD, lr 5e-6", ("opd_smollm2/opd_add_s11",), "one"),
    ("GRPO, `zero_signal=keep`, 3 seeds (earlier tree, another CPU; `docs/results/data/smollm2_runs/v37_*`)",
     ("smollm2_runs/v37_s11", "smollm2_runs/v37_s12", "smollm2_runs/v37_s13"), "range"),
    ("GRPO + dynamic sampling (`auto`), this tree", ("opd_smollm2/add_auto_s11",), "one"))


def _points(data: Path, run: str) -> list[dict]:
    return eval_points(load_rows(data / f"{run}.metrics.jsonl"))


def opd_by_samples(data: Path):
    """Held-out greedy (sampled) accuracy at each eval after step 0, by trained samples."""
    table = []
    for label, runs, kind in OPD_ROWS:
        pts = [{p["samples"]: p for p in _points(data, r) if p["step"]} for r in runs]
        table.append((label, kind, pts))
    samples = sorted({s for _, _, pts in table for by in pts for s in by})
    rows = []
    for label, kind, pts in table:
        cells = []
        for s in samples:
            at = [by[s] for by in pts if s in by]
            if len(at) < len(pts):
                cells.append("")
            elif kind == "seeds":
                g = " / ".join(f"{p['greedy']:.3f}" for p in at)
                cells.append(f"**{g}** (" + " / ".join(f"{p['sampled']:.3f}" for p in at) + ")")
            elif kind == "range":
                g = [p["greedy"] for p in at]
                cells.append(f"{min(g):.3f}-{max(g):.3f}")
            else:
                cells.append(f"{at[0]['greedy']:.3f} ({at[0]['sampled']:.3f})")
        rows.append([label, *cells])
    return ["trained samples", *(f"{s:.0f}" for s in samples)], rows


def _kilo(n: float) -> str:
    return f"{n / 1000:.1f}k"


def _entropy_range(rows: list[dict]) -> str:
    e = [r["entropy"] for r in rows if "loss" in r and "entropy" in r]
    return f"{min(e):.2f}-{max(e):.2f}"


WEAK_START_ROWS = (("GRPO + dynamic sampling (`auto`)", "grpo_wp_s11", True),
                   ("self-distillation (`opd`, lr 5e-6)", "sd_wp_s11", True),
                   ("self-distillation (`opd`, lr 2e-5)", "sd_wp_lr2e-5_s11", False))


def weak_start_word_problems(folder: Path):
    """The word-problem runs: held-out figures at each eval, generated tokens, wall-clock, entropy range."""
    out = []
    for label, run, with_pass in WEAK_START_ROWS:
        rows = load_rows(folder / f"{run}.metrics.jsonl")
        pts = eval_points(rows)
        join = lambda k, f: " / ".join(f"{p[k]:{f}}" for p in pts)  # noqa: E731
        last = pts[-1]
        out.append([label, join("greedy", ".3f"), join("sampled", ".3f"), join("pass@k", ".2f") if with_pass else "",
                    f"{_kilo(last['gen_tokens'])} ({last['gen_tokens'] / last['samples']:.0f} a trained sample), "
                    f"{last['seconds']:.0f} s", _entropy_range(rows)])
    samples = " / ".join(f"{p['samples']:.0f}" for p in pts)
    return ["run", f"greedy at {samples} samples", "sampled", "pass@2", "generated tokens", "entropy"], out


def zero_signal_auto(data: Path):
    """buffer.zero_signal=keep (3 seeds) against auto on additions and on the word problems."""
    keep = [load_rows(data / f"smollm2_runs/v37_s{s}.metrics.jsonl") for s in (11, 12, 13)]
    auto = load_rows(data / "opd_smollm2/add_auto_s11.metrics.jsonl")
    wp = load_rows(data / "opd_smollm2/grpo_wp_s11.metrics.jsonl")

    def pre(rows):
        return next(r for r in rows if "preflight/spread_share" in r)

    def steps(rows):
        return max(r["step"] for r in rows)

    def groups(rows):
        """Groups generated per trained group: the trained ones (batch_groups a step) and those dropped
        without a reward spread."""
        tr = [r for r in rows if "loss" in r]
        trained = round(sum(r["samples"] for r in tr) / 8)
        dropped = round(tr[-1].get("buffer/zero_signal_dropped", 0))
        return trained, trained + dropped

    def per_sample(rows):
        p = eval_points(rows)[-1]
        return p["gen_tokens"] / p["samples"]

    on = lambda rows: pre(rows).get("preflight/dynamic_sampling") == 1.0  # noqa: E731
    ev = {name: eval_points(rows) for name, rows in (("auto", auto), ("wp", wp))}
    ks = [eval_points(r)[-1] for r in keep]
    spreads = [pre(r)["preflight/spread_share"] for r in keep]
    t_a, g_a = groups(auto)
    t_w, g_w = groups(wp)
    rows = [["pre-flight spread share",
             f"{spreads[0]:.3f}" if len(set(spreads)) == 1 else f"{min(spreads):.2f}-{max(spreads):.2f}",
             f"{pre(auto)['preflight/spread_share']:.3f} → dynamic sampling {'on' if on(auto) else 'off'}",
             f"{pre(wp)['preflight/spread_share']:.3f} → {'on' if on(wp) else 'off'}"],
            ["held-out greedy at the end", " / ".join(f"{p['greedy']:.3f}" for p in ks) + f" ({steps(keep[0])} steps)",
             f"{ev['auto'][-1]['greedy']:.3f} ({steps(auto)} steps)",
             f"{ev['wp'][0]['greedy']:.3f} → {ev['wp'][-1]['greedy']:.3f} ({steps(wp)} steps)"],
            ["held-out sampled at the end", " / ".join(f"{p['sampled']:.3f}" for p in ks),
             f"{ev['auto'][-1]['sampled']:.3f}", f"{ev['wp'][0]['sampled']:.3f} → {ev['wp'][-1]['sampled']:.3f}"],
            ["groups generated per trained group",
             f"{mean(g / t for t, g in map(groups, keep)):.1f}", f"{g_a / t_a:.2f} ({g_a} for {t_a})",
             f"{g_w / t_w:.1f} ({g_w} for {t_w})"],
            ["generated tokens per trained sample", f"{mean(map(per_sample, keep)):.0f}", f"{per_sample(auto):.0f}",
             f"{per_sample(wp):.0f}"]]
    return ["", "additions, `keep` (3 seeds, earlier tree)", "additions, `auto`, this tree (seed 11)",
            "word problems, `auto` (seed 11)"], rows


# smollm2.md: the recipe's seeds (data/smollm2_runs)

def _seed_evals(folder: Path, prefix: str):
    rows = []
    for p in files(folder, f"{prefix}_s*.metrics.jsonl"):
        seed = p.name.split(".")[0].rsplit("_s", 1)[1]
        for r in load_rows(p):
            if "eval/reward_greedy" in r:
                rows.append([seed, str(r["step"]), f"{r['time_s'] / 60:.1f}", f"{r['eval/reward_greedy']:.3f}",
                             f"{r['eval/reward']:.3f}", f"{r['eval/pass@k']:.3f}"])
    return ["seed", "step", "minutes", "greedy", "sampled (T=0.7)", "pass@2"], rows


def smollm2_seeds_v37(folder: Path):
    """Each seed's evals: minutes since the run started, held-out greedy, sampled and pass@2."""
    return _seed_evals(folder, "v37")


def smollm2_seeds_before(folder: Path):
    return _seed_evals(folder, "before")


PHASES = (("time/train_s", "train step (`time/train_s`)", ".1f", " s"),
          ("time/policy_s", "of it forward, backward, AdamW (`time/policy_s`)", ".1f", " s"),
          ("time/pi_old_s", "π_old (`time/pi_old_s`)", ".2f", " s"), ("time/ref_s", "reference (`time/ref_s`)", ".2f", " s"),
          ("time/batch_wait_s", "waiting for generation (`time/batch_wait_s`)", ".2f", " s"),
          ("sync/latency_s", "push (`sync/latency_s`)", ".2f", " s"),
          ("throughput/gen_tokens_per_s", "generation tokens/s", ".1f", ""))


def smollm2_phases_before(folder: Path):
    """Medians over each seed's steps of a step's phases."""
    rows = []
    for p in files(folder, "before_s*.metrics.jsonl"):
        steps = [r for r in load_rows(p) if "reward/mean" in r]
        rows.append([p.name.split(".")[0].rsplit("_s", 1)[1],
                     *(f"{statistics.median(r[k] for r in steps if isinstance(r.get(k), (int, float))):{f}}{unit}"
                       for k, _, f, unit in PHASES)])
    return ["seed", *(name for _, name, _, _ in PHASES)], rows


VIEWS.update({
    "minibatch_clips": minibatch_clips, "minibatch_last_eval": minibatch_last_eval,
    "rmsnorm_trainer_vs_hf": rmsnorm_trainer_vs_hf, "rmsnorm_vllm": rmsnorm_vllm,
    "warm_start_first_steps": warm_start_first_steps,
    "async_vs_sync": async_vs_sync, "trainer_ragged": trainer_ragged, "h200_steps": h200_steps,
    "h200_chunked_head": h200_chunked_head,
    "elastic_phases": elastic_phases, "elastic_checks": elastic_checks,
    "openenv_tiny": openenv_tiny, "openenv_smollm2": openenv_smollm2,
    "opd_by_samples": opd_by_samples, "weak_start_word_problems": weak_start_word_problems,
    "zero_signal_auto": zero_signal_auto,
    "smollm2_seeds_v37": smollm2_seeds_v37, "smollm2_seeds_before": smollm2_seeds_before,
    "smollm2_phases_before": smollm2_phases_before,
})


# smollm2.md: this project against TRL (tools/compare/peer_compare.py's results.json)

def _signed(x: float) -> str:
    """+0.000 / −0.026 (a minus sign, as the pages print differences)."""
    return f"+{x:.3f}" if x >= 0 else f"−{-x:.3f}"


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _diff(a: list[float], b: list[float]) -> tuple[float, float]:
    """The difference of the means and twice its standard error."""
    return mean(a) - mean(b), 2 * (_sd(a) ** 2 / len(a) + _sd(b) ** 2 / len(b)) ** 0.5


def _verdict(d: float, two_se: float) -> str:
    """within 2 SE, at the line (within, by less than a tenth of it), or below / above."""
    if abs(d) > two_se:
        return "below" if d < 0 else "above"
    return "at the line" if abs(d) > 0.9 * two_se else "within"


def peer_final(folder: Path):
    """At the last eval step both sides share: each held-out metric's mean ± std (min..max) per side,
    the difference with 2 SE and its verdict; the project's exports by TRL's evaluator where the run
    scored them (--hf-check); the wall-clock to that eval and its ratio."""
    res = load_json(folder / "results.json")
    (task,) = peer.tasks_of(res)
    proj, trl = peer.runs_of(res, task, "recorded"), peer.runs_of(res, task, "trl")
    if not proj or not trl:
        raise DataError(folder / "results.json", "needs recorded project runs and TRL runs")
    step = peer.common_steps(proj + trl)[-1]
    hf = all("hf_final" in e for e in proj)
    cell = lambda xs: f"{mean(xs):.3f} ± {_sd(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"  # noqa: E731
    rows = []
    for name, key in (("greedy", "eval/reward_greedy"), ("sampled", "eval/reward"), ("pass@2", "eval/pass@k")):
        p, t = ([peer.by_step(e)[step][key] for e in side] for side in (proj, trl))
        d, se2 = _diff(p, t)
        v = _verdict(d, se2)
        diff = f"{_signed(d)} ({se2:.3f}): {v}"
        row = [f"held-out {name}", cell(p), cell(t), diff if v == "within" else f"**{diff}**"]
        if hf:
            h = [e["hf_final"][key] for e in proj]
            hd, hse2 = _diff(h, t)
            row.append(f"{mean(h):.3f} ({min(h):.3f}..{max(h):.3f})" +
                       ("" if v == "within" else f": {_signed(hd)} ({hse2:.3f}), {_verdict(hd, hse2)}"))
        rows.append(row)
    clock = [[peer.clock_at(e, step) for e in side] for side in (proj, trl)]
    since = [mean(peer.clock_at(e, step) - peer.clock_at(e, 0) for e in side) for side in (proj, trl)]
    wall = lambda xs: f"{mean(xs):.0f} ± {_sd(xs):.0f} s ({min(xs):.0f}..{max(xs):.0f})"  # noqa: E731
    rows.append(["wall-clock to that eval", wall(clock[0]), wall(clock[1]),
                 f"**{mean(clock[0]) / mean(clock[1]):.2f}x**; from the step-0 eval on {since[0]:.0f} / {since[1]:.0f} s"
                 f" = **{since[0] / since[1]:.2f}x**", *([""] if hf else [])])
    samples = statistics.mean(peer.samples_at(e, step) for e in proj)
    header = [f"at step {step} ({samples:.0f} samples)", "this project, mean ± std (min..max)", "TRL GRPOTrainer",
              "project − TRL (2·SE)", *(["the project's exports by TRL's HF evaluator"] if hf else [])]
    return header, rows


VIEWS["peer_final"] = peer_final


# smollm2.md: the loss recipes (tools/compare/recipe_compare.py's recipes.json)

RECIPE_LABELS = {"none": "`none` = `cispo`"}  # the default loss is CISPO's on this config (smollm2.md says why)


def recipes(path: Path):
    """Per recipe: held-out greedy, sampled and pass@2 from step 0 to the last eval (mean over seeds, end
    with its min..max; the best greedy mean in bold), response length and entropy over the last three
    steps, DAPO's filtered share, each run's wall-clock on this tree (recorded: read from earlier runs)."""
    results = [r for r in load_json(path) if "curve" in r]
    best = max(r["curve"]["greedy"][-1][1]["mean"] for r in results)
    rng = lambda d, f=".3f": f"{d['mean']:{f}} ({d['min']:{f}}..{d['max']:{f}})"  # noqa: E731
    rows = []
    for r in results:
        c, e = r["curve"], r["end"]

        def acc(name: str, bold: bool = False) -> str:
            start, end = c[name][0][1], c[name][-1][1]
            m = f"{end['mean']:.3f}"
            return f"{start['mean']:.3f} → {f'**{m}**' if bold else m} ({end['min']:.3f}..{end['max']:.3f})"

        filtered = e.get("overlong_filtered_frac")
        rows.append([RECIPE_LABELS.get(r["recipe"], f"`{r['recipe']}`"), acc("greedy", c["greedy"][-1][1]["mean"] == best),
                     acc("sampled"), acc("pass@k"), rng(e["response/length_mean"], ".1f"), rng(e["entropy"]),
                     rng(filtered) if filtered and filtered["max"] > 0 else "–",
                     f"{', '.join(f'{w:.0f}' for w in r['wall_s'])} s" if r["wall_s"] else "recorded"])
    last = results[0]["curve"]["greedy"][-1][0]
    return ["recipe", f"held-out greedy, step 0 → {last}", "sampled (T=0.7)", "pass@2", "response length", "entropy",
            "DAPO's filtered share", "wall, this tree"], rows


VIEWS["recipes"] = recipes


# planner.md: `python -m tools.plan validate --record`'s file (tools/plan/data/validation*.json, which
# tests/test_planner.py also reads): the real runs' medians and the simulator's predictions, per case

PLANNER_HEADER = ["configuration", "runs sync / async", "async/sync real (range)", "predicted", "error",
                  "trainer idle sync real (range) / pred", "async real (range) / pred", "dropped async real (range) / pred",
                  "train s sync / async real / pred", "from the sync arm", "ratio within 10%", "all targets"]
PLANNER_ALIGN = "-" + ":" * 9 + "--"


def planner_rows(cases: list[dict]) -> list[list[str]]:
    def rng(d: dict, k: str) -> str:
        lo, hi = d[k + "_min"], d[k + "_max"]
        return f"{d[k]:.2f}" + ("" if lo != lo else f" ({lo:.2f}..{hi:.2f})")  # NaN: not recorded

    rows = []
    for c in cases:
        r, p = c["real"], c["predicted"]
        lo, hi = c["ratio_real_spread"]
        rows.append([c["name"], f"{r['sync']['repeats']} / {r['async']['repeats']}", f"{c['ratio_real']:.2f}x "
                     f"({lo:.2f}..{hi:.2f})", f"{c['ratio_predicted']:.2f}x", f"{c['ratio_error']:+.0%}",
                     f"{rng(r['sync'], 'trainer_idle_frac')} / {p['sync']['trainer_idle_frac']:.2f}",
                     f"{rng(r['async'], 'trainer_idle_frac')} / {p['async']['trainer_idle_frac']:.2f}",
                     f"{rng(r['async'], 'dropped_frac')} / {p['async']['dropped_frac']:.2f}",
                     f"{r['sync']['train_s']:.3f} / {p['sync']['train_s']:.3f}, {r['async']['train_s']:.3f} / "
                     f"{p['async']['train_s']:.3f}", f"{c['ratio_from_sync_arm']:.2f}x ({c['ratio_error_from_sync_arm']:+.0%})",
                     "yes" if c["ratio_within"] else "no", "yes" if c["within"] else "no"])
    return rows


def planner_validation(path: Path):
    return PLANNER_HEADER, planner_rows(load_json(path)["cases"])


VIEWS["planner_validation"] = planner_validation
