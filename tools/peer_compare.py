"""This project's GRPO against TRL's GRPOTrainer: same warm start, task, prompts and settings, several seeds.

    python tools/peer_compare.py                                     # reverse and arith, seeds 0-2, 400 steps
    python tools/peer_compare.py --tasks reverse --seeds 3,4 --steps 400        # more runs, appended
    python tools/peer_compare.py --report                             # table and plot from the results only

Per task and seed, the project side is a whole CLI run in sync mode (`python -m pipeline.run --config
configs/tiny.yaml run.mode=sync run.seed=S ...`: every batch sampled by the version it trains, so both
sides are on-policy), which takes run.warm_start_steps supervised steps and exports the warm start
(out_dir/warm_start). The TRL side (tools/peer_trl.py) starts GRPOTrainer from that export with the
same group size, batch, learning rate, KL coefficient, temperature, completion length and prompts,
for the same number of steps (so trained samples), and evaluates it on the task's held-out prompts
at the same steps with HF `generate`. The project's curve is its own eval (vLLM); as a cross-check
the same HF evaluator also scores the project's warm start and final export (`hf_start`, `hf_final`).
How each loss setting maps (and where it cannot) is in the JSON's "settings" and docs/benchmarks.md.

Every finished run is merged into --out/results.json at once (keyed task/seed/side; a rerun
replaces its entry), so the comparison can be run in pieces. The report covers every entry in the
file: the final held-out reward, sampled and greedy, mean ± sample std and range over seeds per
side, and whether the two means agree within the seed spread: |Δ| <= 2·SE, SE = sqrt(s_p²/n_p +
s_t²/n_t). Writes compare.md and compare.png (mean curves over trained samples, min-max bands).
The TRL side needs the optional extra: pip install --no-deps "trl==1.16.*" accelerate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from peer_trl import HFEval, check_task, require_trl, run_trl, trl_settings  # noqa: E402
from task_sweep import run_cli  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.tasks import load_task  # noqa: E402

SIDES = ("project", "trl", "project_fresh")
KEEP = ("eval/reward", "eval/reward_greedy", "reward/mean", "reward", "kl_ref", "kl", "entropy",
        "response/length_mean", "completions/mean_length")


def task_path(name: str) -> str:
    return name if "." in name else f"pipeline.tasks.{name}"


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def merge(path: Path, key: str, entry: dict, settings: list) -> None:
    """Write one run's entry into the results file (replacing an older one), atomically."""
    res = load(path)
    res["runs"][key] = entry
    res["settings"] = settings
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)


def hf_score(cfg, task, hf_dir: Path, seed: int) -> dict:
    """The HF evaluator's held-out reward of an exported model (the cross-check of the two evaluators)."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    return HFEval(cfg, task).evaluate(model, AutoTokenizer.from_pretrained(str(hf_dir)), seed)


def side_overrides(args, task: str, seed: int) -> list[str]:
    """The config both sides read: the project's run is in sync mode, so on-policy as TRL's; a fixed
    warm start (run.warm_start_steps=auto would stop where its probe says, per seed), so every seed
    starts from the same number of demonstration steps."""
    return [f"task.name={task}", "run.mode=sync", f"run.seed={seed}", f"run.steps={args.steps}",
            f"run.warm_start_steps={args.warm_start_steps}",
            f"run.eval_every={args.eval_every}", f"task.eval_samples={args.eval_samples}", *args.overrides]


def warm_export(run_dir: Path, task: str, seed: int) -> Path:
    """The project run's warm-start export, which the other sides of this task and seed start from."""
    warm = run_dir.parent / "project" / "warm_start"
    if not (warm / "config.json").exists():
        raise SystemExit(f"peer_compare: no warm start at {warm}; run the project side of {task} seed {seed} first "
                         "(--sides project): the other sides start from its export")
    return warm


def project_side(args, task: str, seed: int, run_dir: Path) -> dict:
    """The project's CLI run in sync mode. As side `project`, with its own warm start (the AdamW moments
    of the supervised steps carry into RL); as `project_fresh`, from the `project` run's warm-start
    export with no warm start (model.hf_dir: fresh AdamW moments and that export as the KL reference,
    exactly TRL's start)."""
    fresh = run_dir.name == "project_fresh"
    start = warm_export(run_dir, task, seed) if fresh else run_dir / "warm_start"
    overrides = [*side_overrides(args, task, seed), f"run.out_dir={run_dir}", "run.progress=false",
                 "run.checkpoint_every=0", *([f"model.hf_dir={start}", "run.warm_start_steps=0"] if fresh else [])]
    run = run_cli(run_dir, overrides, args.config, args.timeout, args.reuse,
                  f"peer_compare {task} s{seed} {run_dir.name}")
    if run["exit_code"] != 0:
        raise SystemExit(f"peer_compare: the project run failed (exit {run['exit_code']}); see {run_dir / 'run.log'}")
    cfg = load_config(args.config, overrides)
    t = load_task(task, cfg.task)
    rows = [{"step": r["step"], **{k: r[k] for k in KEEP if k in r}} for r in run["rows"]]
    return {"rows": rows, "wall_s": run["wall_s"], "overrides": overrides,
            "trained_samples": int(sum(r.get("samples", 0) for r in run["rows"])),
            "hf_start": hf_score(cfg, t, start, seed), "hf_final": hf_score(cfg, t, run_dir / "hf_checkpoint", seed)}


def trl_side(args, task: str, seed: int, run_dir: Path) -> dict:
    """TRL's GRPOTrainer from the `project` run's warm-start export (tools/peer_trl.py)."""
    cfg = load_config(args.config, side_overrides(args, task, seed))
    res = run_trl(cfg, load_task(task, cfg.task), warm_export(run_dir, task, seed), seed, args.steps,
                  args.eval_every, run_dir)
    rows = [{"step": r["step"], **{k: r[k] for k in KEEP if k in r}} for r in res["rows"]]
    return {"rows": rows, "wall_s": res["wall_s"], "trained_samples": res["trained_samples"],
            "trl_version": res["trl_version"]}


RUNNERS = {"project": project_side, "trl": trl_side, "project_fresh": project_side}
LABELS = {"project": "this project (sync)", "project_fresh": "this project (sync), fresh AdamW",
          "trl": "TRL GRPOTrainer"}


def evals(entry: dict, key: str) -> list[float]:
    """A run's eval rows' values of `key`, in step order."""
    return [r[key] for r in entry["rows"] if key in r]


def spread(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan")


def side_stats(entries: list[dict], metric: str) -> dict:
    """One side's final held-out `metric` over its seeds: n, mean, sample std, range; its start (step 0)."""
    xs = [evals(e, metric)[-1] for e in entries]
    mean, std = spread(xs)
    return {"n": len(xs), "mean": mean, "std": std, "min": min(xs), "max": max(xs),
            "start": statistics.mean(evals(e, metric)[0] for e in entries),
            "samples": statistics.mean(e["trained_samples"] for e in entries),
            "wall_s": statistics.mean(e["wall_s"] for e in entries),
            "hf": [statistics.mean(e[k][metric] for e in entries) for k in ("hf_start", "hf_final")]
            if all("hf_final" in e for e in entries) else None}


def summary(res: dict) -> list[dict]:
    """Per task, metric and project side run beside TRL: both sides' stats, the difference of the
    means, its standard error and whether |difference| <= 2 SE (None with a single seed)."""
    out = []
    for task in sorted({k.split("/")[0] for k in res["runs"]}):
        by = {s: [e for k, e in sorted(res["runs"].items()) if k.split("/")[0] == task and k.split("/")[2] == s]
              for s in SIDES}
        for side in ("project", "project_fresh"):
            if not (by[side] and by["trl"]):
                continue
            for metric in ("eval/reward", "eval/reward_greedy"):
                p, t = side_stats(by[side], metric), side_stats(by["trl"], metric)
                se = math.sqrt(p["std"] ** 2 / p["n"] + t["std"] ** 2 / t["n"]) if min(p["n"], t["n"]) > 1 \
                    else float("nan")
                out.append({"task": task, "metric": metric, "side": side, "project": p, "trl": t,
                            "diff": p["mean"] - t["mean"], "se": se,
                            "agree": None if math.isnan(se) else abs(p["mean"] - t["mean"]) <= 2 * se})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| task | held-out reward | this project | seeds | project: start → final, mean ± std (min..max) | "
             "TRL GRPOTrainer: start → final | project − TRL (2·SE) | agree | project by the HF evaluator: start → final |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, t = r["project"], r["trl"]
        cell = lambda s: f"{s['start']:.3f} → **{s['mean']:.3f}** ± {s['std']:.3f} ({s['min']:.3f}..{s['max']:.3f})"  # noqa: E731
        hf = f"{p['hf'][0]:.3f} → {p['hf'][1]:.3f}" if p["hf"] else ""
        lines.append(f"| {r['task'].rsplit('.', 1)[-1]} | {'greedy' if r['metric'].endswith('greedy') else 'sampled'} "
                     f"| {LABELS[r['side']].removeprefix('this project ')} | {p['n']} / {t['n']} | {cell(p)} | {cell(t)} "
                     f"| {r['diff']:+.3f} ({2 * r['se']:.3f}) | {dict([(True, 'yes'), (False, 'no')]).get(r['agree'], 'n/a')} "
                     f"| {hf} |")
    if rows:
        r = rows[0]
        lines.append(f"\n{r['project']['samples']:.0f} trained samples per run on every side; wall per run: project "
                     f"{r['project']['wall_s']:.0f} s (CLI start, warm start, evals included), TRL "
                     f"{r['trl']['wall_s']:.0f} s. agree: |project − TRL| <= 2·SE, SE = sqrt(s_p²/n_p + s_t²/n_t).")
    return "\n".join(lines)


TRAIN = {"train reward": ("reward/mean", "reward"), "KL to the warm start": ("kl_ref", "kl"),
         "entropy": ("entropy", "entropy"), "response length": ("response/length_mean", "completions/mean_length")}
"""Per-step metrics both sides log, (this project's name, TRL's): the same definitions (k3 values per
token for KL, EOS counted in the length)."""


def train_table(res: dict, last: int = 20) -> str:
    """Per task and side: the mean over seeds of each TRAIN metric averaged over the last `last` steps."""
    lines = [f"| task | side | {' | '.join(TRAIN)} (mean of the last {last} steps) |", "|---|---|" + "---|" * len(TRAIN)]
    for task in sorted({k.split("/")[0] for k in res["runs"]}):
        for side in SIDES:
            runs = [e for k, e in res["runs"].items() if k.split("/")[0] == task and k.split("/")[2] == side]
            if not runs:
                continue
            cells = []
            for ours, theirs in TRAIN.values():
                key = theirs if side == "trl" else ours
                per_run = [[r[key] for r in e["rows"] if key in r][-last:] for e in runs]
                cells.append(f"{statistics.mean(statistics.mean(v) for v in per_run):.3f}")
            lines.append(f"| {task.rsplit('.', 1)[-1]} | {LABELS[side]} | {' | '.join(cells)} |")
    return "\n".join(lines)


def settings_table(settings: list[dict]) -> str:
    lines = ["| setting | this project | TRL | on-policy |", "|---|---|---|---|"]
    lines += [f"| {s['setting']} | {s['project']} | {s['trl']} | {s['verdict']} |" for s in settings]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k.split("/")[0] for k in res["runs"]})
    metrics = [("eval/reward", "sampled"), ("eval/reward_greedy", "greedy")]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.4 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        for ax, (metric, label) in zip(row, metrics):
            for side, color in zip(SIDES, ("tab:blue", "tab:orange", "tab:green")):
                runs = [e for k, e in res["runs"].items() if k.split("/")[0] == task and k.split("/")[2] == side]
                curves = [{r["step"]: r[metric] for r in e["rows"] if metric in r} for e in runs]
                steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
                if not steps:
                    continue
                per = len(runs) and runs[0]["trained_samples"] / max(steps)
                xs = [s * per for s in steps]
                ys = [[c[s] for c in curves] for s in steps]
                ax.plot(xs, [statistics.mean(y) for y in ys], color=color, marker="o", ms=3,
                        label=f"{LABELS[side]}, {len(runs)} seeds")
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.2)
            ax.set_title(f"{task.rsplit('.', 1)[-1]}: held-out reward, {label}", fontsize=9)
            ax.set_xlabel("trained samples", fontsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--tasks", default="reverse,arith", help="comma-separated task paths (a bare name: pipeline.tasks.<name>)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    ap.add_argument("--sides", default="project,trl,project_fresh", help="project: the CLI run with its own warm "
                    "start; trl: GRPOTrainer from its export; project_fresh: the CLI run from that export, fresh AdamW")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--warm-start-steps", type=int, default=15, help="run.warm_start_steps of the project run "
                    "(fixed, so every seed starts from as many demonstration steps; the measured setup used 15)")
    ap.add_argument("--eval-samples", type=int, default=16, help="task.eval_samples on both sides: samples per "
                    "held-out prompt (64 prompts x 16: the sampled reward's eval noise is ~0.006 here)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one project run may take")
    ap.add_argument("--out", default="bench_out/peer_compare")
    ap.add_argument("--reuse", action="store_true", help="read, not rerun, a finished project run in --out")
    ap.add_argument("--report", action="store_true", help="only write the table and plot from --out/results.json")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for both sides")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    sides = [s for s in args.sides.split(",") if s]
    if not set(sides) <= set(SIDES):
        raise SystemExit(f"peer_compare: --sides {args.sides!r}: each one of {', '.join(SIDES)}")
    if not args.report:
        if "trl" in sides:
            require_trl()  # fail before an hour of project runs, not after
        for task in map(task_path, args.tasks.split(",")):
            cfg = load_config(args.config, side_overrides(args, task, 0))
            check_task(load_task(task, cfg.task), cfg)
            settings = trl_settings(cfg, args.steps, 0)[1]
            for seed in map(int, args.seeds.split(",")):
                for side in sides:
                    run_dir = out / task.rsplit(".", 1)[-1] / f"seed{seed}" / side
                    entry = RUNNERS[side](args, task, seed, run_dir)
                    merge(results, f"{task}/{seed}/{side}", entry, settings)
                    last = [r for r in entry["rows"] if "eval/reward" in r][-1]
                    print(f"[peer_compare {task} s{seed} {side}] {entry['trained_samples']} samples, held-out "
                          f"{last['eval/reward']:.3f} sampled, {last['eval/reward_greedy']:.3f} greedy, "
                          f"{entry['wall_s']:.0f} s", flush=True)
    res = load(results)
    if not res["runs"]:
        raise SystemExit(f"peer_compare: {results} holds no runs yet")
    rows = summary(res)
    text = table(rows) + "\n\n" + train_table(res) + "\n\n" + settings_table(res.get("settings", []))
    print("\n" + text)
    (out / "compare.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    plot(res, out / "compare.png")
    print(f"[peer_compare] wrote {out / 'compare.md'}, {out / 'compare.png'} and {out / 'summary.json'}")
    return 0 if all(r["agree"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
