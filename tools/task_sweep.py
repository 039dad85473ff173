"""The default config on every built-in task (and any task path given): does it learn them all?

    python tools/task_sweep.py                                   # every built-in task, default config
    python tools/task_sweep.py --tasks my_pkg.my_task pipeline.tasks.sort --steps 300 key=value ...

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
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.config import load_config  # noqa: E402
from pipeline.driver.metrics import read_jsonl  # noqa: E402
from pipeline.run import NO_SIGNAL_EXIT  # noqa: E402

BUILTIN = ["pipeline.tasks.reverse", "pipeline.tasks.arith", "pipeline.tasks.sort", "pipeline.tasks.boxed",
           "pipeline.tasks.calc", "pipeline.tasks.rotate", "pipeline.tasks.lookup"]
PANELS = [("held-out reward", ["eval/reward", "eval/reward_greedy"]), ("policy entropy", ["entropy"]),
          ("response length", ["response/length_mean"]), ("groups without signal", ["groups/zero_variance_frac"])]


def short(task: str) -> str:
    return task.rsplit(".", 1)[-1]


def _but_out_dir(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("run.out_dir=")]


def run_cli(run_dir: Path, overrides: list[str], config: str, timeout: float, reuse: bool, label: str) -> dict:
    """One whole CLI run (`python -m pipeline.run --config <config> <overrides>`) into run_dir, its
    output in run_dir/run.log; with `reuse`, a finished run there with the same overrides (but for
    run.out_dir: a finished run may be copied) is read instead. Returns its exit code, wall seconds
    and metrics rows. The run starts in the repository, so `config` and `run_dir` are taken as
    absolute paths (relative ones from where this runs, or a config from the repository)."""
    config = str(Path(config).resolve() if Path(config).exists() else REPO / config)
    cfg = load_config(config, overrides)  # a bad override or task fails here, before any run
    done = run_dir / "sweep_run.json"
    prev = json.loads(done.read_text()) if reuse and done.exists() else {}
    same = bool(prev) and _but_out_dir(prev["overrides"]) == _but_out_dir(overrides)  # a run copied elsewhere
    if prev and not same:
        print(f"[{label}] not reusing {run_dir}: it ran with other overrides", flush=True)
    if same:
        code, wall = prev["exit_code"], prev["wall_s"]
        print(f"[{label}] reusing the finished run in {run_dir}", flush=True)
    else:
        print(f"[{label}] {cfg.run.steps} steps ({run_dir / 'run.log'})", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(run_dir / "run.log", "w") as f:
            code = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", config, *overrides],
                                  cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        wall = time.monotonic() - t0
        done.write_text(json.dumps({"exit_code": code, "wall_s": wall, "overrides": overrides}))
    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    return {"exit_code": code, "wall_s": wall, "rows": rows, "summary": summary, "cfg": cfg}


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
    run = run_cli(run_dir, overrides, args.config, args.timeout, args.reuse, f"task_sweep {short(task)}")
    code, wall, rows = run["exit_code"], run["wall_s"], run["rows"]
    evals = [r for r in rows if "eval/reward" in r]
    steps = [r for r in rows if "entropy" in r]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def draw(axes, rows):
        for ax, (name, keys) in zip(axes, PANELS):
            for k in keys:
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, ms=3, label=k)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            if ax.lines:
                ax.legend(fontsize=6)

    for r in results:
        fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 3.4))
        draw(axes, r["rows"])
        fig.suptitle(f"{r['task']} (default config)")
        fig.tight_layout()
        fig.savefig(out / f"{short(r['task'])}.png", dpi=80)
        plt.close(fig)
    fig, axes = plt.subplots(len(results), len(PANELS), figsize=(16, 3.0 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        draw(row, r["rows"])
        row[0].set_ylabel(short(r["task"]))
    fig.suptitle("task sweep: the default config on every task")
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=70)
    plt.close(fig)


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
    (out / "sweep.md").write_text(text + "\n")
    (out / "sweep.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "rows"} for r in results],
                                               indent=2))
    plot(results, out)
    print(f"[task_sweep] wrote {out / 'sweep.md'}, {out / 'sweep.png'} and one plot per task")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
