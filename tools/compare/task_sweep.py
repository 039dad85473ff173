"""The default config on every built-in task (and any task path given): does it learn them all?

    python -m tools.compare.task_sweep                                   # every built-in task, default config
    python -m tools.compare.task_sweep --tasks my_pkg.my_task pipeline.tasks.sort --steps 300 key=value ...

Each task is a whole CLI run (`python -m pipeline.run --config configs/tiny.yaml task.name=...`),
one after another (they would share the cores). Per task it reads the run's metrics and reports
held-out reward before RL (after the supervised warm start) and at the end, sampled (the policy's
expected reward, what RL optimises) and greedy, the lowest entropy and the final response length,
the steps the collapse watch flagged, and the wall time; the warm start's steps and why it stopped
(the run summary's `warm_start` when the run reports one, else the fixed run.warm_start_steps),
held-out pass@k before and after RL, the first RL step whose batch had a group with a reward spread
(and its seconds after RL began; "never" if none), and the prompts the difficulty filter set aside
and retried (pipeline/difficulty.py). It writes sweep.md (the table), sweep.json,
and per task <task>.png (held-out reward, entropy, response length, groups without signal over
steps) plus sweep.png with every task side by side, into --out. A task "passes" when RL adds at
least --min-gain sampled reward and greedy reward does not fall. Extra `key=value` arguments
override the config for every task. Exit code 1 if a run failed or a task did not pass. With
--reuse, a task whose run in --out finished with the same overrides is read instead of rerun.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.run import NO_SIGNAL_EXIT
from tools.lib.cli import run_to_dir
from tools.lib.metrics import eval_rows, step_rows
from tools.lib.report import plot_curves, pyplot, save, write_results

BUILTIN = ["pipeline.tasks.reverse", "pipeline.tasks.arith", "pipeline.tasks.sort", "pipeline.tasks.boxed",
           "pipeline.tasks.calc", "pipeline.tasks.rotate", "pipeline.tasks.lookup"]
PANELS = [("held-out reward", ["eval/reward", "eval/reward_greedy"], 1), ("policy entropy", ["entropy"], 1),
          ("response length", ["response/length_mean"], 1),
          ("groups without signal", ["groups/zero_variance_frac"], 1)]


def short(task: str) -> str:
    return task.rsplit(".", 1)[-1]


def warm_start_of(summary: dict, cfg) -> str:
    """Steps and why the warm start stopped: the run summary's `warm_start` {steps, reason} when the run
    reports one (run.warm_start_steps=auto), else the configured count."""
    ws = summary.get("warm_start")
    if isinstance(ws, dict) and "steps" in ws:
        return f"{ws['steps']} ({ws.get('reason', '?')})"
    n = cfg.run.warm_start_steps
    return f"{n} (fixed: run.warm_start_steps)" if n else "none"


def first_signal(rows: list[dict], t_rl: float) -> str:
    """The first RL step whose batch had a group with a reward spread, and its seconds after RL began."""
    for r in rows:
        if r.get("groups/zero_variance_frac", 1.0) < 1.0:
            return f"step {r['step']}, {r['time_s'] - t_rl:.0f} s"
    return "never"


def run_task(task: str, args, out: Path) -> dict:
    run_dir = out / short(task)
    overrides = [f"task.name={task}", f"run.out_dir={run_dir}", "run.progress=false", "run.checkpoint_every=0",
                 *([f"run.steps={args.steps}"] if args.steps else []), *args.overrides]
    run = run_to_dir(run_dir, overrides, args.config, args.timeout, args.reuse, f"task_sweep {short(task)}")
    code, wall, rows = run["exit_code"], run["wall_s"], run["rows"]
    evals, steps = eval_rows(rows), step_rows(rows, "entropy")
    res = {"task": task, "exit_code": code, "wall_s": wall, "steps": len(steps), "rows": rows,
           "warm_start": warm_start_of(run["summary"], run["cfg"])}
    if code == NO_SIGNAL_EXIT:  # run.stop_without_signal ended it, saying why: an honest early stop
        res["stopped"] = str(run["summary"].get("no_signal", "no learning signal"))
    if code not in (0, NO_SIGNAL_EXIT) or len(evals) < 2 or not steps:
        res["passed"] = False
        return res
    first, last = evals[0], evals[-1]
    res.update({
        "sampled_before": first["eval/reward"], "sampled_after": last["eval/reward"],
        "greedy_before": first["eval/reward_greedy"], "greedy_after": last["eval/reward_greedy"],
        "entropy_first": steps[0]["entropy"], "entropy_min": min(r["entropy"] for r in steps),
        "length_first": steps[0]["response/length_mean"], "length_last": steps[-1]["response/length_mean"],
        "collapsed_steps": sum(r.get("collapse/active", 0) for r in steps),
        "pass_before": first.get("eval/pass@k", float("nan")), "pass_after": last.get("eval/pass@k", float("nan")),
        "first_signal": first_signal(steps, first.get("time_s", 0.0)),
        "set_aside": steps[-1].get("buffer/prompts_set_aside", 0), "retried": steps[-1].get("buffer/prompts_retried", 0),
    })
    res["sampled_gain"] = res["sampled_after"] - res["sampled_before"]
    res["greedy_gain"] = res["greedy_after"] - res["greedy_before"]
    gained = res["sampled_gain"] >= args.min_gain or res["sampled_after"] >= args.solved
    res["passed"] = "stopped" in res or (gained and res["greedy_gain"] >= -args.greedy_slack)
    return res


def table(results: list[dict], args) -> str:
    lines = ["| task | warm start steps (why stopped) | sampled before → after (gain) | greedy before → after | "
             "pass@k before → after | first step with signal | set aside / retried | entropy first → min | "
             "length first → last | collapsed steps | wall | pass |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "sampled_gain" not in r:
            lines.append(f"| {short(r['task'])} | {r['warm_start']} | run failed (exit {r['exit_code']}) | | | | | | | | "
                         f"{r['wall_s']:.0f} s | no |")
            continue
        lines.append(
            f"| {short(r['task'])} | {r['warm_start']} | {r['sampled_before']:.3f} → {r['sampled_after']:.3f} "
            f"({r['sampled_gain']:+.3f}) | {r['greedy_before']:.3f} → {r['greedy_after']:.3f} | "
            f"{r['pass_before']:.3f} → {r['pass_after']:.3f} | {r['first_signal']} | "
            f"{r['set_aside']:.0f} / {r['retried']:.0f} | {r['entropy_first']:.2f} → {r['entropy_min']:.2f} | "
            f"{r['length_first']:.1f} → {r['length_last']:.1f} | {r['collapsed_steps']:.0f} | {r['wall_s']:.0f} s | "
            f"{('stopped early: ' + r['stopped']) if 'stopped' in r else 'yes' if r['passed'] else 'no'} |")
    lines.append(f"\npass: sampled gain >= {args.min_gain} (or ending at >= {args.solved}) and greedy not lower by more "
                 f"than {args.greedy_slack}, or the run stopped early saying why (run.stop_without_signal, exit "
                 f"{NO_SIGNAL_EXIT}); pass@k with k = task.eval_k")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> None:
    plt = pyplot()
    for r in results:
        fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 3.4))
        plot_curves(axes, {short(r["task"]): r["rows"]}, PANELS)
        fig.suptitle(f"{r['task']} (default config)")
        save(fig, out / f"{short(r['task'])}.png", dpi=80)
    fig, axes = plt.subplots(len(results), len(PANELS), figsize=(16, 3.0 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        plot_curves(row, {short(r["task"]): r["rows"]}, PANELS)
        row[0].set_ylabel(short(r["task"]))
    fig.suptitle("task sweep: the default config on every task")
    save(fig, out / "sweep.png", dpi=70)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--tasks", nargs="*", default=None, help="task paths (default: every built-in task)")
    ap.add_argument("--extra-tasks", nargs="*", default=[], help="task paths added to the built-in ones")
    ap.add_argument("--steps", type=int, default=0, help="RL steps per task (default: the config's run.steps)")
    ap.add_argument("--min-gain", type=float, default=0.25)
    ap.add_argument("--greedy-slack", type=float, default=0.0)
    ap.add_argument("--solved", type=float, default=0.85, help="an ending sampled reward that passes whatever the gain")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one task's run may take")
    ap.add_argument("--out", default="bench_out/task_sweep")
    ap.add_argument("--reuse", action="store_true", help="read, not rerun, each task whose run in --out finished "
                    "(delete a task's directory to rerun it); the table and plots cover every task")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out).resolve()  # the runs start in the repository
    out.mkdir(parents=True, exist_ok=True)
    tasks = (args.tasks or BUILTIN) + args.extra_tasks
    results = []
    for task in tasks:
        r = run_task(task, args, out)
        results.append(r)
        if "sampled_gain" in r:
            print(f"[task_sweep]   sampled {r['sampled_before']:.3f} -> {r['sampled_after']:.3f}, greedy "
                  f"{r['greedy_before']:.3f} -> {r['greedy_after']:.3f}, entropy min {r['entropy_min']:.2f}, "
                  f"{r['wall_s']:.0f} s: {'pass' if r['passed'] else 'FAIL'}", flush=True)
        else:
            print(f"[task_sweep]   run failed (exit {r['exit_code']}); see {out / short(task) / 'run.log'}", flush=True)
    text = table(results, args)
    print("\n" + text)
    write_results(out, "sweep", text, results)
    plot(results, out)
    print(f"[task_sweep] wrote {out / 'sweep.md'}, {out / 'sweep.png'} and one plot per task")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
