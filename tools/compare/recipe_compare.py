"""Loss recipes side by side on the real model: held-out accuracy at equal trained samples, response
length, entropy and what each recipe's parts did.

    python -m tools.compare.recipe_compare                                    # grpo,dapo,dr_grpo,gspo,cispo; seed 11; 10 steps
    python -m tools.compare.recipe_compare --recipes none,dapo --seeds 11,12,13 --steps 25
    python -m tools.compare.recipe_compare --recorded none=outputs/smollm2-s11,outputs/smollm2-s12 ...

Each (recipe, seed) is a whole CLI run (`python -m pipeline.run --config configs/smollm2-135m-add.yaml
trainer.recipe=R run.seed=S run.steps=N ...`), one after another (they would share the cores), into
--out/R-sS. A recipe's own needs come with it: `gspo` runs with `trainer.correction=geo_is` (the
config's token-level `tis` is refused with a sequence-level ratio), `dapo` with
`buffer.zero_signal=drop` (its dynamic sampling, named here since the base sets keep); every other recipe with `buffer.zero_signal=keep`
(not auto, whose choice may differ per run), so the recipes differ in their loss alone. Every run
has the same batch (4 groups of 8), so equal steps are equal trained samples. `--recorded LABEL=DIR,DIR` adds finished runs of the same
config (their rows up to --steps; a directory or its metrics .jsonl), e.g. the three seeds of the
recipe's default loss; a LABEL that is also in --recipes adds them to that recipe's runs (earlier
seeds of it). A source may also be an earlier recipes.json of this tool, whose one-run entry for
LABEL stands in for that run (its eval figures and its last-three-step means, as that run gave them).

Per recipe it reports, at each eval step, held-out greedy accuracy, sampled accuracy and pass@k
(mean over seeds, and min..max), and over the last three steps the mean response length, the
entropy of the sampled tokens, the clip fractions per side (PPO's low and high, CISPO's weight), the
share of truncated samples filtered (DAPO), and the sequence-level ratio's spread (GSPO). Writes
recipes.md, recipes.json and recipes.png (held-out greedy and sampled accuracy over trained samples)
into --out. With --reuse, a finished run in --out with the same overrides is read instead of rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tools.lib.cli import run_to_dir
from tools.lib.metrics import EVALS, read_rows
from tools.lib.report import plot_recipes, publish

CONFIG = "configs/smollm2-135m-add.yaml"
NEEDS = {"gspo": ["trainer.correction=geo_is"], "dapo": ["buffer.zero_signal=drop"]}
BASE = ["buffer.zero_signal=keep"]
"""Every recipe's runs, before its NEEDS (module docstring)."""
"""What a recipe needs beside its preset on this config (module docstring)."""
END = ("response/length_mean", "entropy", "clip_low_frac", "clip_high_frac", "cispo_clip_frac",
       "overlong_filtered_frac", "seq_ratio_std")
"""Training metrics averaged over a run's last three steps (a key a recipe does not log is left out)."""


def spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def summarise(label: str, runs: list[dict], steps: int) -> dict:
    """One recipe's runs (each {"rows", "exit_code", "wall_s"}) -> its table row and curves."""
    ok = [r for r in runs if r["exit_code"] == 0 and any("eval/reward" in x for x in r["rows"])]
    res = {"recipe": label, "runs": len(runs), "ok": len(ok), "exit_codes": [r["exit_code"] for r in runs],
           "wall_s": [round(r["wall_s"]) for r in runs if r.get("wall_s") is not None]}
    if not ok:
        return res
    evals = [{x["step"]: x for x in r["rows"] if "eval/reward" in x and x["step"] <= steps} for r in ok]
    common = sorted(set.intersection(*(set(e) for e in evals)))
    res["curve"] = {name: [(s, spread([e[s][key] for e in evals if key in e[s]])) for s in common]
                    for name, key in EVALS}
    last = [[x for x in r["rows"] if "reward/mean" in x and x["step"] <= steps][-3:] for r in ok]
    res["end"] = {k: spread([statistics.fmean(x[k] for x in rows) for rows in last if all(k in x for x in rows)])
                  for k in END}
    res["end"] = {k: v for k, v in res["end"].items() if v}
    res["samples_per_step"] = ok[0]["rows"][-1].get("samples")
    return res


def read_recorded(label: str, src: Path) -> dict:
    """A finished run: a run directory (its metrics.jsonl), a metrics .jsonl file, or an earlier
    recipes.json of this tool whose entry for `label` holds exactly one run. That entry's figures
    become the rows `summarise` reads: one eval row per eval step, and three training rows holding its
    last-three-step means, so the summary of the stand-in is the summary of the run."""
    metrics = src / "metrics.jsonl" if src.is_dir() else src  # or a run's metrics kept on their own (docs/results/data)
    if src.is_dir() and not metrics.exists():
        raise ValueError(f"{src} has no metrics.jsonl")
    if metrics.suffix == ".jsonl" and metrics.is_file():
        return {"rows": read_rows(metrics), "exit_code": 0, "wall_s": None}
    if src.suffix != ".json" or not src.exists():
        raise ValueError(f"{src} is neither a run directory, a metrics .jsonl nor a recipes.json")
    entry = [r for r in json.loads(src.read_text()) if r.get("recipe") == label]
    if not entry or entry[0].get("ok") != 1 or "curve" not in entry[0]:
        raise ValueError(f"{src} has no entry for {label!r} of exactly one finished run")
    e = entry[0]
    keys = dict(EVALS)
    evals: dict[int, dict] = {}
    for name, pts in e["curve"].items():
        for step, d in pts:
            evals.setdefault(step, {"step": step})[keys[name]] = d["mean"]
    last = max(evals)
    train = {"reward/mean": None, "samples": e.get("samples_per_step"),
             **{k: d["mean"] for k, d in e.get("end", {}).items()}}
    rows = [*evals.values(), *({"step": last - 2 + i, **train} for i in range(3))]
    return {"rows": sorted(rows, key=lambda x: x["step"]), "exit_code": 0, "wall_s": None}


def fmt(d: dict, digits: int = 3) -> str:
    if not d:
        return "–"
    if d["n"] == 1:
        return f"{d['mean']:.{digits}f}"
    return f"{d['mean']:.{digits}f} ({d['min']:.{digits}f}..{d['max']:.{digits}f})"


def table(results: list[dict]) -> str:
    lines = ["| recipe | seeds | held-out greedy, start → end | sampled | pass@k | response length | entropy | "
             "clip low / high (CISPO weight) | overlong filtered | seq-ratio std | wall per run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "curve" not in r:
            lines.append(f"| `{r['recipe']}` | {r['runs']} | no finished run (exit {r['exit_codes']}) |||||||||")
            continue
        c, e = r["curve"], r["end"]
        ends = {k: f"{fmt(v[0][1])} → {fmt(v[-1][1])} (step {v[-1][0]})" for k, v in c.items()}
        clip = f"{fmt(e.get('clip_low_frac', {}), 4)} / {fmt(e.get('clip_high_frac', {}), 4)}"
        if "cispo_clip_frac" in e:
            clip += f" ({fmt(e['cispo_clip_frac'], 4)})"
        wall = f"{statistics.fmean(r['wall_s']):.0f} s" if r["wall_s"] else "recorded"
        lines.append(f"| `{r['recipe']}` | {r['ok']} | {ends['greedy']} | {ends['sampled']} | {ends['pass@k']} | "
                     f"{fmt(e.get('response/length_mean', {}), 1)} | {fmt(e.get('entropy', {}))} | {clip} | "
                     f"{fmt(e.get('overlong_filtered_frac', {}))} | {fmt(e.get('seq_ratio_std', {}), 4)} | {wall} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--recipes", default="grpo,dapo,dr_grpo,gspo,cispo")
    ap.add_argument("--seeds", default="11")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--recorded", action="append", default=[], metavar="LABEL=DIR,DIR",
                    help="finished runs of the same config to add (their rows up to --steps)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    ap.add_argument("--out", default="bench_out/recipes")
    ap.add_argument("--reuse", action="store_true", help="read, not rerun, each finished run in --out")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out).resolve()  # the runs start in the repository
    out.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in args.recipes.split(",") if r]
    recorded: dict[str, list[dict]] = {}
    for spec in args.recorded:
        label, _, dirs = spec.partition("=")
        if not label or not dirs:
            ap.error(f"--recorded {spec!r}: expected LABEL=DIR[,DIR...]")
        for d in dirs.split(","):
            try:
                recorded.setdefault(label, []).append(read_recorded(label, Path(d)))
            except ValueError as e:
                ap.error(f"--recorded {label}: {e}")
    results = [summarise(label, runs, args.steps) for label, runs in recorded.items() if label not in recipes]
    for recipe in recipes:
        runs = list(recorded.get(recipe, []))
        for seed in args.seeds.split(","):
            run_dir = out / f"{recipe}-s{seed}"
            overrides = [f"trainer.recipe={recipe}", f"run.seed={seed}", f"run.steps={args.steps}",
                         "run.progress=false", f"run.out_dir={run_dir}", *BASE, *NEEDS.get(recipe, []),
                         *args.overrides]
            runs.append(run_to_dir(run_dir, overrides, args.config, args.timeout, args.reuse,
                                f"recipe_compare {recipe} seed {seed}"))
        r = summarise(recipe, runs, args.steps)
        results.append(r)
        if "curve" in r:
            g = r["curve"]["greedy"]
            print(f"[recipe_compare {recipe}]   greedy {fmt(g[0][1])} -> {fmt(g[-1][1])} at step {g[-1][0]}", flush=True)
        else:
            print(f"[recipe_compare {recipe}]   no finished run (exit codes {r['exit_codes']})", flush=True)
    publish(out, "recipes", table(results), results, "recipe_compare", drop=())
    plot_recipes(results, out / "recipes.png")
    return 0 if all("curve" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
