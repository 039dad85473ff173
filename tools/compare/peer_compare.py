"""This project's GRPO against TRL's GRPOTrainer: same start, task, prompts and settings, several seeds.

    python -m tools.compare.peer_compare                                     # tiny: reverse and arith, seeds 0-2, 400 steps
    python -m tools.compare.peer_compare --tasks reverse --seeds 3,4 --steps 400        # more runs, appended
    python -m tools.compare.peer_compare --report                             # table and plot from the results only
    python -m tools.compare.peer_compare --config configs/smollm2-135m-add.yaml --sides trl --seeds 11,12,13 \\
        --steps 10 --eval-every 5 --recorded outputs/smollm2-s11,outputs/smollm2-s12,outputs/smollm2-s13 \\
        --out bench_out/peer_smollm2                                 # TRL only, beside finished CLI runs

Two kinds of config. One that warm-starts (configs/tiny.yaml, run.warm_start_steps: auto): per task
and seed, the project side is a whole CLI run in sync mode (`python -m pipeline.run --config
configs/tiny.yaml run.mode=sync run.seed=S ...`: every batch sampled by the version it trains, so
both sides are on-policy), which takes --warm-start-steps supervised steps (default 15) and exports the
warm start (out_dir/warm_start); the TRL side (tools/lib/peer_trl.py) starts GRPOTrainer from that
export. One with run.warm_start_steps: 0 (a pretrained instruct checkpoint:
configs/smollm2-135m-add.yaml) is compared as it is: its own task (--tasks defaults to its
task.name), its own task.eval_samples, and the TRL side starts from its model.hf_dir as
`pipeline.models.hf.resolved` resolves it (`builtin:smollm2-135m-instruct` -> the folder under
.cache/smollm2); side project_fresh, which needs a warm-start export, is refused. Either way TRL
runs with the same group size, batch, learning rate, KL coefficient, temperature, completion length
and prompts (the project's train stream, in order; chat prompts in TRL's conversational format, their
token ids checked at start-up to be encode_prompt's), for the same number of steps (so trained
samples), and evaluates on the task's held-out prompts at the same steps with HF `generate`
(greedy, sampled and pass@k with k = task.eval_k). The project's curve is its own eval (vLLM); as a
cross-check the same HF evaluator also scores a project run's start and final export (`hf_start`,
`hf_final`). How each setting maps (and where it cannot) is in the JSON's "settings" and
docs/results/benchmarks.md.

`--recorded DIR,DIR,...` takes the project side from finished CLI runs of the same config (e.g.
`python -m pipeline.run --config configs/smollm2-135m-add.yaml run.seed=S run.out_dir=DIR`, in the
config's own run.mode): each DIR's metrics.jsonl (read as tools/compare/recipe_compare.py reads it), rows up
to --steps, as side `recorded`, keyed by the directory's name. Such a run must have reached --steps;
its config is not stored in the directory, so that it was this config (with these overrides) is the
caller's word. Use it with `--sides trl` (or `--report`) so no project run is started.

Every finished run is merged into --out/results.json at once (keyed task/seed/side, or
task/DIR-name/recorded; a rerun replaces its entry), so the comparison can be run in pieces. The
report covers every entry in the file. Per task and project side beside TRL, at the last eval step
both sides reached (so at equal trained samples): held-out greedy, sampled and pass@k, mean ± sample
std and range over seeds per side, and whether the two means agree within the seed spread: |Δ| <=
2·SE, SE = sqrt(s_p²/n_p + s_t²/n_t). Then every side's curve at each eval step all runs of the task
share: trained samples, the three held-out metrics and the wall-clock to that step's eval (mean ±
std (min..max)): the project's from its run's time stamps (metrics.jsonl time_s: seconds since the
run opened its metrics, actor and engine start and step 0's eval included), TRL's from its rows'
time_s (seconds since the trainer was built, its step-0 eval included); and at TRL's final step the
ratio of the project's wall-clock to TRL's, whole and from step 0's eval on. Writes compare.md,
compare.png (the three metrics and the wall-clock over trained samples: mean curves, min-max bands)
and summary.json. The exit code is 1 when a pair of sides does not agree. The settings table
(peer_trl.trl_settings) describes the project side as sync when peer_compare runs it, and for a
config that warm-starts (whose project side is peer_compare's own sync runs); else, e.g. with
--recorded, in the config's run.mode (configs/smollm2-135m-add.yaml: async, trainer.correction=tis).
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

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.config import load_config as _load_config
from pipeline.models.hf import resolved
from pipeline.tasks import load_task
from tools.lib.peer_trl import HFEval, check_task, require_trl, run_trl, trl_settings
from tools.lib.cli import run_to_dir
from tools.lib.metrics import EVALS, read_rows
from tools.lib.peer import (LABELS, PROJECT_SIDES, SIDES, by_step, clock_at, common_steps, plot, runs_of,
                            samples_at, tasks_of)

METRICS = EVALS
"""(name, key) of the held-out metrics reported: greedy, sampled, pass@k (tools.lib.metrics.EVALS)."""
KEEP = ("step", "time_s", "samples", "eval/reward", "eval/reward_greedy", "eval/pass@k", "eval/mean@k", "eval_s",
        "step_s", "reward/mean", "reward", "kl_ref", "kl", "entropy", "response/length_mean", "completions/mean_length")
WARM_DEFAULT, EVAL_SAMPLES_DEFAULT = 15, 16
"""--warm-start-steps and --eval-samples for a config that warm-starts (the measured tiny setup)."""


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


def keep(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in KEEP if k in r} for r in rows]


def resolve(args) -> None:
    """Fill the defaults that depend on the config (module docstring): --warm-start-steps (the config's
    own integer, 15 for `auto`), --eval-samples (16 for a config that warm-starts, else its own
    task.eval_samples) and --tasks (reverse,arith for a config that warm-starts, else its task.name)."""
    cfg = load_config(args.config, args.overrides)
    if args.warm_start_steps is None:
        ws = cfg.run.warm_start_steps
        args.warm_start_steps = ws if isinstance(ws, int) else WARM_DEFAULT
    warm = args.warm_start_steps != 0
    if args.eval_samples is None:
        args.eval_samples = EVAL_SAMPLES_DEFAULT if warm else cfg.task.eval_samples
    if args.tasks is None:
        args.tasks = "reverse,arith" if warm else cfg.task.name
    args.warm = warm


def _base_overrides(args, task: str, seed: int) -> list[str]:
    return [f"task.name={task}", f"run.seed={seed}", f"run.steps={args.steps}",
            f"run.warm_start_steps={args.warm_start_steps}", f"run.eval_every={args.eval_every}",
            f"task.eval_samples={args.eval_samples}", "buffer.zero_signal=keep"]


def common_overrides(args, task: str, seed: int) -> list[str]:
    """The config both sides read: a fixed warm start (run.warm_start_steps=auto would stop where its
    probe says, per seed), so every seed starts from the same number of demonstration steps (0: none);
    groups without a reward spread kept (buffer.zero_signal=keep: TRL has no dynamic sampling, which
    auto may turn on); the caller's overrides last."""
    return [*_base_overrides(args, task, seed), *args.overrides]


def project_overrides(args, task: str, seed: int) -> list[str]:
    """The project's own runs are in sync mode, so on-policy as TRL's."""
    return [*_base_overrides(args, task, seed), "run.mode=sync", *args.overrides]


def load_config(path, overrides):
    """The config with model.hf_dir a folder (a builtin: name built and resolved), as a run sees it."""
    return resolved(_load_config(path, overrides))


def hf_score(cfg, task, hf_dir: Path, seed: int) -> dict:
    """The HF evaluator's held-out metrics of an exported model (the cross-check of the two evaluators)."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    return HFEval(cfg, task).evaluate(model, AutoTokenizer.from_pretrained(str(hf_dir)), seed)


def warm_export(run_dir: Path, task: str, seed: int) -> Path:
    """The project run's warm-start export, which the other sides of this task and seed start from."""
    warm = run_dir.parent / "project" / "warm_start"
    if not (warm / "config.json").exists():
        raise SystemExit(f"peer_compare: no warm start at {warm}; run the project side of {task} seed {seed} first "
                         "(--sides project): the other sides start from its export")
    return warm


def start_dir(args, cfg, run_dir: Path, task: str, seed: int) -> Path:
    """Where TRL (and project_fresh) start: the project run's warm-start export, or without a warm
    start (run.warm_start_steps=0) the config's model.hf_dir as `resolved` made it a folder."""
    return warm_export(run_dir, task, seed) if args.warm else Path(cfg.model.hf_dir)


def project_side(args, task: str, seed: int, run_dir: Path) -> dict:
    """The project's CLI run in sync mode. As side `project`, with its own warm start (the AdamW moments
    of the supervised steps carry into RL) or, with run.warm_start_steps=0, from model.hf_dir; as
    `project_fresh`, from the `project` run's warm-start export with no warm start (model.hf_dir:
    fresh AdamW moments and that export as the KL reference, exactly TRL's start)."""
    fresh = run_dir.name == "project_fresh"
    if fresh and not args.warm:
        raise SystemExit("peer_compare: side project_fresh starts from the project run's warm-start export; with "
                         "run.warm_start_steps=0 there is none, and side project already starts as TRL does "
                         "(model.hf_dir, fresh AdamW)")
    start = warm_export(run_dir, task, seed) if fresh else run_dir / "warm_start"
    overrides = [*project_overrides(args, task, seed), f"run.out_dir={run_dir}", "run.progress=false",
                 "run.checkpoint_every=0", *([f"model.hf_dir={start}", "run.warm_start_steps=0"] if fresh else [])]
    run = run_to_dir(run_dir, overrides, args.config, args.timeout, args.reuse,
                     f"peer_compare {task} s{seed} {run_dir.name}")
    if run["exit_code"] != 0:
        raise SystemExit(f"peer_compare: the project run failed (exit {run['exit_code']}); see {run_dir / 'run.log'}")
    cfg = load_config(args.config, overrides)
    t = load_task(task, cfg.task)
    if not args.warm:
        start = Path(cfg.model.hf_dir)
    return {"rows": keep(run["rows"]), "wall_s": run["wall_s"], "overrides": overrides,
            "trained_samples": int(sum(r.get("samples", 0) for r in run["rows"])),
            "hf_start": hf_score(cfg, t, start, seed), "hf_final": hf_score(cfg, t, run_dir / "hf_checkpoint", seed)}


def trl_side(args, task: str, seed: int, run_dir: Path) -> dict:
    """TRL's GRPOTrainer from the `project` run's warm-start export, or from model.hf_dir (tools/lib/peer_trl.py)."""
    cfg = load_config(args.config, common_overrides(args, task, seed))
    start = start_dir(args, cfg, run_dir, task, seed)
    res = run_trl(cfg, load_task(task, cfg.task), start, seed, args.steps, args.eval_every, run_dir, args.project_mode)
    return {"rows": keep(res["rows"]), "wall_s": res["wall_s"], "trained_samples": res["trained_samples"],
            "threads": torch.get_num_threads(), "start": res["start"], "prompts_checked": res["prompts_checked"],
            "trl_version": res["trl_version"], "settings": res["settings"]}


RUNNERS = {"project": project_side, "trl": trl_side, "project_fresh": project_side}


def read_recorded(dirs: list[str], steps: int, batch: int, hf: tuple | None = None) -> dict[str, dict]:
    """Finished CLI runs as entries of side `recorded`, by directory name: each one's metrics.jsonl
    (tools.lib.metrics.read_rows) up to `steps`, its trained samples (the rows' `samples`) and its wall-clock
    to the last kept row. SystemExit for a directory without metrics.jsonl, or a run that stopped
    before `steps`; a step that trained other than `batch` samples is printed. `hf` = (cfg, task,
    seeds) (--hf-check): the HF evaluator also scores the start (cfg.model.hf_dir) and each run's
    final export (DIR/hf_checkpoint), run i with sampling seed seeds[i], as `hf_start`/`hf_final`."""
    out = {}
    for i, d in enumerate(dirs):
        path = Path(d) / "metrics.jsonl"
        if not path.exists():
            raise SystemExit(f"peer_compare: --recorded {d}: no metrics.jsonl (a finished `python -m pipeline.run` "
                             "run's out_dir holds one)")
        rows = read_rows(path)
        if max((r["step"] for r in rows), default=-1) < steps:
            raise SystemExit(f"peer_compare: --recorded {d}: its last step is "
                             f"{max((r['step'] for r in rows), default=None)}, --steps is {steps}")
        rows = [r for r in rows if r["step"] <= steps]
        odd = sorted({r["samples"] for r in rows if "samples" in r} - {batch})
        if odd:
            print(f"[peer_compare] --recorded {d}: steps trained {odd} samples, not the config's batch {batch}")
        name = Path(d).resolve().name
        out[name] = {"rows": keep(rows), "recorded": str(Path(d).resolve()), "wall_s": rows[-1]["time_s"],
                     "trained_samples": int(sum(r.get("samples", 0) for r in rows))}
        if hf is not None:
            cfg, task, seeds = hf
            final = Path(d) / "hf_checkpoint"
            if not (final / "config.json").exists():
                raise SystemExit(f"peer_compare: --hf-check: {final} holds no exported model (a run that reached "
                                 "run.steps writes one)")
            seed = seeds[i] if i < len(seeds) else 0
            out[name] |= {"hf_start": hf_score(cfg, task, Path(cfg.model.hf_dir), seed),
                          "hf_final": hf_score(cfg, task, final, seed)}
            print(f"[peer_compare] --hf-check {name}: HF evaluator start {out[name]['hf_start']}, "
                  f"final {out[name]['hf_final']}", flush=True)
    return out


def spread(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else float("nan")


def stats(xs: list[float]) -> dict:
    mean, std = spread(xs)
    return {"n": len(xs), "mean": mean, "std": std, "min": min(xs), "max": max(xs)}


def side_stats(entries: list[dict], metric: str, step: int) -> dict:
    """One side's held-out `metric` at `step` over its seeds: n, mean, sample std, range; its value at
    step 0 (start), trained samples and wall-clock at `step`, the HF evaluator's cross-check."""
    out = stats([by_step(e)[step][metric] for e in entries])
    clocks = [clock_at(e, step) for e in entries]
    return {**out, "step": step, "start": statistics.mean(by_step(e)[0][metric] for e in entries)
            if all(0 in by_step(e) for e in entries) else float("nan"),
            "samples": statistics.mean(samples_at(e, step) for e in entries),
            "wall_s": statistics.mean(clocks) if None not in clocks else
            statistics.mean(e["wall_s"] for e in entries),
            "hf": [statistics.mean(e[k][metric] for e in entries) for k in ("hf_start", "hf_final")]
            if all("hf_final" in e and metric in e["hf_final"] for e in entries) else None}


def summary(res: dict) -> list[dict]:
    """Per task, project side run beside TRL and held-out metric both sides report: both sides' stats
    at the last eval step they share, the difference of the means, its standard error and whether
    |difference| <= 2 SE (None with a single seed)."""
    out = []
    for task in tasks_of(res):
        trl = runs_of(res, task, "trl")
        for side in PROJECT_SIDES:
            proj = runs_of(res, task, side)
            steps = common_steps(proj + trl)
            if not (proj and trl and steps):
                continue
            for _, metric in METRICS:
                if not all(metric in by_step(e)[steps[-1]] for e in proj + trl):
                    continue
                p, t = side_stats(proj, metric, steps[-1]), side_stats(trl, metric, steps[-1])
                se = math.sqrt(p["std"] ** 2 / p["n"] + t["std"] ** 2 / t["n"]) if min(p["n"], t["n"]) > 1 \
                    else float("nan")
                out.append({"task": task, "metric": metric, "side": side, "project": p, "trl": t,
                            "diff": p["mean"] - t["mean"], "se": se,
                            "agree": None if math.isnan(se) else abs(p["mean"] - t["mean"]) <= 2 * se})
    return out


def metric_name(metric: str) -> str:
    return next(name for name, key in METRICS if key == metric)


def table(rows: list[dict]) -> str:
    lines = ["| task | held-out reward | this project | seeds | project: start → final, mean ± std (min..max) | "
             "TRL GRPOTrainer: start → final | project − TRL (2·SE) | agree | project by the HF evaluator: start → final |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, t = r["project"], r["trl"]
        cell = lambda s: f"{s['start']:.3f} → **{s['mean']:.3f}** ± {s['std']:.3f} ({s['min']:.3f}..{s['max']:.3f})"  # noqa: E731
        hf = f"{p['hf'][0]:.3f} → {p['hf'][1]:.3f}" if p["hf"] else ""
        lines.append(f"| {r['task'].rsplit('.', 1)[-1]} | {metric_name(r['metric'])} "
                     f"| {LABELS[r['side']].removeprefix('this project ')} | {p['n']} / {t['n']} | {cell(p)} | {cell(t)} "
                     f"| {r['diff']:+.3f} ({2 * r['se']:.3f}) | {dict([(True, 'yes'), (False, 'no')]).get(r['agree'], 'n/a')} "
                     f"| {hf} |")
    for r in {(r["task"], r["side"]): r for r in rows}.values():
        p, t = r["project"], r["trl"]
        lines.append(f"\n{r['task'].rsplit('.', 1)[-1]}, {LABELS[r['side']]} beside TRL: final = step {p['step']}, "
                     f"{p['samples']:.0f} / {t['samples']:.0f} trained samples per run; wall-clock to that eval: project "
                     f"{p['wall_s']:.0f} s, TRL {t['wall_s']:.0f} s. agree: |project − TRL| <= 2·SE, "
                     "SE = sqrt(s_p²/n_p + s_t²/n_t).")
    return "\n".join(lines)


def cell(xs: list[float], digits: int = 3) -> str:
    if not xs:
        return "–"
    s = stats(xs)
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} ({s['min']:.{digits}f}..{s['max']:.{digits}f})"


def curve_table(res: dict) -> str:
    """Per task, every side at each eval step all of the task's runs share: trained samples, held-out
    greedy / sampled / pass@k and the wall-clock to that eval, mean ± std (min..max) over seeds; then,
    per project side beside TRL, the ratio of their wall-clocks at TRL's final step."""
    lines = [f"| task | step | side | seeds | trained samples | {' | '.join(n for n, _ in METRICS)} | wall-clock (s) |",
             "|---|---|---|---|---|" + "---|" * len(METRICS) + "---|"]
    ratios = []
    for task in tasks_of(res):
        sides = {s: runs_of(res, task, s) for s in SIDES if runs_of(res, task, s)}
        steps = common_steps([e for es in sides.values() for e in es])
        for step in steps:
            for side, es in sides.items():
                vals = [cell([by_step(e)[step][key] for e in es if key in by_step(e)[step]]) for _, key in METRICS]
                clocks = [c for e in es if (c := clock_at(e, step)) is not None]
                lines.append(f"| {task.rsplit('.', 1)[-1]} | {step} | {LABELS[side]} | {len(es)} | "
                             f"{statistics.mean(samples_at(e, step) for e in es):.0f} | {' | '.join(vals)} | "
                             f"{cell(clocks, 0)} |")
        trl = sides.get("trl", [])
        final = max(common_steps(trl), default=None)
        for side in PROJECT_SIDES:
            proj = sides.get(side, [])
            if not (trl and proj and final is not None):
                continue
            p = [clock_at(e, final) for e in proj]
            t = [clock_at(e, final) for e in trl]
            p0, t0 = [clock_at(e, 0) for e in proj], [clock_at(e, 0) for e in trl]
            name = f"{task.rsplit('.', 1)[-1]}, {LABELS[side]} / TRL at TRL's final step {final}"
            if None in p or None in t:
                ratios.append(f"- {name}: no wall-clock (a run has no eval row with time_s at step {final})")
                continue
            line = (f"- {name}: {statistics.mean(p):.0f} s / {statistics.mean(t):.0f} s = "
                    f"**{statistics.mean(p) / statistics.mean(t):.2f}x** (whole runs, start-up and step 0's eval in)")
            if None not in p0 + t0 and final > 0:
                dp = statistics.mean(a - b for a, b in zip(p, p0))
                dt = statistics.mean(a - b for a, b in zip(t, t0))
                line += f"; from step 0's eval on: {dp:.0f} s / {dt:.0f} s = **{dp / dt:.2f}x**"
            ratios.append(line)
    return "\n".join(lines + ([""] + ratios if ratios else []))


TRAIN = {"train reward": ("reward/mean", "reward"), "KL to the start": ("kl_ref", "kl"),
         "entropy": ("entropy", "entropy"), "response length": ("response/length_mean", "completions/mean_length")}
"""Per-step metrics both sides log, (this project's name, TRL's): the same definitions (k3 values per
token for KL, EOS counted in the length). Without a KL term neither side measures the KL: TRL logs
none with beta=0, the project logs kl_ref 0.0 with trainer.kl_coef=0 (no reference forward); both
show '–'."""


def train_table(res: dict, last: int = 20) -> str:
    """Per task and side: the mean over seeds of each TRAIN metric averaged over the last `last` steps
    ('–' where the side logs none)."""
    lines = [f"| task | side | {' | '.join(TRAIN)} (mean of the last {last} steps) |", "|---|---|" + "---|" * len(TRAIN)]
    for task in tasks_of(res):
        for side in SIDES:
            runs = runs_of(res, task, side)
            if not runs:
                continue
            cells = []
            for ours, theirs in TRAIN.values():
                key = theirs if side == "trl" else ours
                per_run = [v for e in runs if (v := [r[key] for r in e["rows"] if key in r][-last:])]
                if key == "kl_ref" and all(x == 0.0 for v in per_run for x in v):
                    per_run = []  # not measured: no reference forward
                cells.append(f"{statistics.mean(statistics.mean(v) for v in per_run):.3f}" if per_run else "–")
            lines.append(f"| {task.rsplit('.', 1)[-1]} | {LABELS[side]} | {' | '.join(cells)} |")
    return "\n".join(lines)


def settings_table(settings: list[dict]) -> str:
    lines = ["| setting | this project | TRL | verdict |", "|---|---|---|---|"]
    lines += [f"| {s['setting']} | {s['project']} | {s['trl']} | {s['verdict']} |" for s in settings]
    return "\n".join(lines)


def report(out: Path, res: dict) -> int:
    rows = summary(res)
    head = table(rows) if rows else "No project side beside TRL in the results yet: each side's curve only."
    text = "\n\n".join([head, curve_table(res), train_table(res), settings_table(res.get("settings", []))])
    print("\n" + text)
    (out / "compare.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    plot(res, out / "compare.png")
    print(f"[peer_compare] wrote {out / 'compare.md'}, {out / 'compare.png'} and {out / 'summary.json'}")
    return 0 if all(r["agree"] is not False for r in rows) else 1


def run_line(task: str, run: str, side: str, entry: dict) -> str:
    """One finished run (`run`: s<seed>, or a recorded run's name), printed: its last held-out metrics,
    and for TRL its time per step and per eval."""
    last = [r for r in entry["rows"] if "eval/reward" in r][-1]
    line = (f"[peer_compare {task} {run} {side}] {entry['trained_samples']} samples, held-out at step "
            f"{last['step']}: {last['eval/reward']:.3f} sampled, {last['eval/reward_greedy']:.3f} greedy, "
            f"{last.get('eval/pass@k', float('nan')):.3f} pass@k; {entry['wall_s']:.0f} s")
    step_s = [r["step_s"] for r in entry["rows"] if "step_s" in r]
    eval_s = [r["eval_s"] for r in entry["rows"] if "eval_s" in r]
    if step_s and eval_s:
        line += (f" (a step {statistics.median(step_s):.1f} s median, {min(step_s):.1f}..{max(step_s):.1f}; "
                 f"an eval {statistics.mean(eval_s):.1f} s mean, {min(eval_s):.1f}..{max(eval_s):.1f})")
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--tasks", default=None, help="comma-separated task paths (a bare name: pipeline.tasks.<name>); "
                    "default: reverse,arith for a config that warm-starts, else the config's task.name")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated run.seed values")
    ap.add_argument("--sides", default="project,trl,project_fresh", help="project: the CLI run (sync) with its own "
                    "warm start, or from model.hf_dir without one; trl: GRPOTrainer from its start; project_fresh: "
                    "the CLI run from the warm-start export, fresh AdamW (needs a warm start)")
    ap.add_argument("--hf-check", action="store_true", help="score each --recorded run's start and final export "
                    "(DIR/hf_checkpoint) with TRL's side's HF evaluator too, run i with seed i of --seeds: the two "
                    "evaluators side by side on the same weights")
    ap.add_argument("--recorded", default="", metavar="DIR,DIR", help="finished CLI runs of --config as the "
                    "project side (side `recorded`; their rows up to --steps), e.g. outputs/smollm2-s11,outputs/smollm2-s12")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--warm-start-steps", type=int, default=None, help="run.warm_start_steps of the project run "
                    "(fixed, so every seed starts from as many demonstration steps; default: the config's own "
                    "integer, 15 for auto: the measured tiny setup); 0: no warm start, TRL starts from model.hf_dir")
    ap.add_argument("--eval-samples", type=int, default=None, help="task.eval_samples on both sides: samples per "
                    "held-out prompt (default 16 for a config that warm-starts: 64 prompts x 16, the sampled "
                    "reward's eval noise ~0.006 on tiny; else the config's own, as its recorded runs had)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of this process (the TRL side and the HF "
                    "evaluator; 0: torch's default, one per core). On cores other work keeps busy, 1: two threads "
                    "contending for a shared core made HF generate ~25x slower here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one project run may take")
    ap.add_argument("--out", default="bench_out/peer_compare")
    ap.add_argument("--reuse", action="store_true", help="read, not rerun, a finished project run in --out")
    ap.add_argument("--report", action="store_true", help="only write the table and plot from --out/results.json "
                    "(and --recorded runs, added to it)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for both sides")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    sides = [s for s in args.sides.split(",") if s]
    if not set(sides) <= set(RUNNERS):
        raise SystemExit(f"peer_compare: --sides {args.sides!r}: each one of {', '.join(RUNNERS)}")
    recorded = [d for d in args.recorded.split(",") if d]
    if args.report and not recorded:
        if not load(results)["runs"]:
            raise SystemExit(f"peer_compare: {results} holds no runs yet")
        return report(out, load(results))
    if not args.report and "trl" in sides:
        require_trl()  # fail before an hour of project runs, not after
    if args.threads:
        torch.set_num_threads(args.threads)
    resolve(args)
    tasks = [task_path(t) for t in args.tasks.split(",")]
    if recorded and len(tasks) != 1:
        raise SystemExit(f"peer_compare: --recorded runs are of one task, --tasks names {len(tasks)}")
    own = not args.report and any(s in sides for s in ("project", "project_fresh"))
    # The project side the settings describe: peer_compare's own sync runs (this time, or earlier ones of a
    # config that warm-starts), else recorded CLI runs in the config's run.mode (None).
    args.project_mode = "sync" if own or (args.warm and not recorded) else None
    for task in tasks:
        cfg = load_config(args.config, common_overrides(args, task, 0))
        check_task(load_task(task, cfg.task), cfg)
        tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir) if (Path(cfg.model.hf_dir or "/nonexistent") /
                                                                 "tokenizer_config.json").exists() else None
        settings = trl_settings(cfg, args.steps, 0, tok, args.project_mode)[1]
        hf = (cfg, load_task(task, cfg.task), [int(x) for x in args.seeds.split(",") if x]) if args.hf_check else None
        for name, entry in read_recorded(recorded, args.steps, cfg.buffer.batch_groups * cfg.buffer.group_size,
                                         hf).items():
            merge(results, f"{task}/{name}/recorded", entry, settings)
            print(run_line(task, name, "recorded", entry), flush=True)
        for seed in [] if args.report else map(int, args.seeds.split(",")):
            for side in sides:
                run_dir = out / task.rsplit(".", 1)[-1] / f"seed{seed}" / side
                entry = RUNNERS[side](args, task, seed, run_dir)
                settings = entry.pop("settings", settings)  # a TRL run's notes hold its tokenizer's rows
                merge(results, f"{task}/{seed}/{side}", entry, settings)
                print(run_line(task, f"s{seed}", side, entry), flush=True)
    res = load(results)
    if not res["runs"]:
        raise SystemExit(f"peer_compare: {results} holds no runs yet")
    return report(out, res)


if __name__ == "__main__":
    sys.exit(main())
