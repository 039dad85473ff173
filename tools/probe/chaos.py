"""Chaos run: the default job with generators killed at random times; it must finish anyway.

    python -m tools.probe.chaos                                  # default job (800 steps), 2 generators, 6 kills
    python -m tools.probe.chaos --kills 5 --generators 1 --steps 120 key=value ...
    python -m tools.probe.chaos --quick                          # a short version (what the test runs)
    python -m tools.probe.chaos --stop --kills 2 --generators 1 --steps 120   # hangs (SIGSTOP) instead of deaths

Starts `python -m pipeline.run` on configs/tiny.yaml and, once training is under way, SIGKILLs at
random moments a generator's vLLM engine core, then a whole generator proc (alternating), waiting for
each recovery before the next kill. With --stop the signal is SIGSTOP: the process hangs instead of
dying, which the generator's liveness check (generator.hang_timeout_s) must find. Per kill it prints the detection and recovery seconds (from
the run's out_dir/faults.jsonl, against the kill's wall time). At the end it checks that the run
completed every step with exit 0, that the buffer's accounting identity holds, that no admitted
group was lost (each was trained, dropped as stale, or requeued and then trained: no group was
dropped because of a kill), that every generator restarted as many times as it was killed, and that
held-out reward rose (sampled or greedy). Writes chaos.json and chaos.png (reward per step, kills marked) into --out.
Exit 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from pipeline.procs import descendants, parent
from tools.lib.cli import start_cli, wait_for
from tools.lib.metrics import eval_rows, read_rows, read_summary, step_rows
from tools.lib.report import pyplot, save


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def engine_cores(root: int) -> list[int]:
    return [p for p, _ in descendants(root) if "EngineCore" in cmdline(p)]


def plot(metrics: list[dict], kills: list[dict], path: Path) -> None:
    steps = step_rows(metrics)
    t0 = steps[0]["time_s"] if steps else 0.0
    fig, ax = pyplot().subplots(figsize=(9, 3.5))
    ax.plot([r["time_s"] - t0 for r in steps], [r["reward/mean"] for r in steps], lw=1, label="batch reward")
    for k in kills:
        ax.axvline(k["killed_at_run_s"], color="tab:red", ls="--", lw=1)
        if k.get("recovery_s") is not None:
            ax.axvspan(k["killed_at_run_s"], k["killed_at_run_s"] + k["recovery_s"], color="tab:red", alpha=0.12)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("mean reward")
    ax.set_title("chaos run: kills (dashed) and recovery windows (shaded)")
    ax.legend(loc="lower right")
    save(fig, path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--gap", type=float, nargs=2, default=(3.0, 12.0), help="seconds between a recovery and the next kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/chaos")
    ap.add_argument("--stop", action="store_true", help="SIGSTOP (a hang) instead of SIGKILL (a death)")
    ap.add_argument("--quick", action="store_true", help="2 kills of the only generator, 30 steps (the test)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.quick:
        # one generator: training waits for each recovery, so the run cannot end before it. The tiny
        # job's steps of 16 samples can take ~0.2 s on idle cores: a kill 1-3 s after a step came too
        # late at 20 steps (step 19 when kill 1 was due); kills within 0.5 s, out of 30 steps
        args.kills, args.steps, args.gap, args.generators = 2, 30, (0.0, 0.5), 1
        # deaths only (found by their death notices): a loose hang bound, so a loaded machine (the
        # suite's other worker) stalling the generator's process for 30 s is not taken for a hang
        args.overrides = ["buffer.batch_groups=4", "buffer.group_size=4", "run.eval_every=30", "task.eval_prompts=16",
                          "run.warm_start_steps=5", "generator.hang_timeout_s=30", *args.overrides]
    rng = random.Random(args.seed)
    out = Path(args.out)
    run_dir = out / "run"
    for f in ("metrics.jsonl", "faults.jsonl", "summary.json"):
        (run_dir / f).unlink(missing_ok=True)
    overrides = [f"run.steps={args.steps}", f"generator.num_generators={args.generators}",
                 f"generator.max_restarts={args.kills}", "run.progress=false", f"run.out_dir={run_dir}", *args.overrides]
    print(f"[chaos] -m pipeline.run --config {args.config} " + " ".join(overrides), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    proc = start_cli(args.config, overrides, out / "run.log", new_session=True)
    kills: list[dict] = []
    ok = True
    try:
        metrics_path, faults_path = run_dir / "metrics.jsonl", run_dir / "faults.jsonl"
        wait_for(lambda: any("reward/mean" in r for r in read_rows(metrics_path)), 900, "first training step", proc)
        t_first = time.time()
        for k in range(args.kills):
            time.sleep(rng.uniform(*args.gap))
            done = max((r["step"] for r in read_rows(metrics_path) if "reward/mean" in r), default=0)
            if done > 0.75 * args.steps:  # a kill this late may outlast the run: its recovery goes unseen
                print(f"[chaos] step {done} of {args.steps}: too late for kill {k + 1} (raise --steps)", flush=True)
                break
            kind = "engine core" if k % 2 == 0 else "generator proc"
            cores = wait_for(lambda: engine_cores(proc.pid), 120, "a live engine core", proc)
            core = rng.choice(cores)
            victim = core if kind == "engine core" else parent(core)
            before = len(read_rows(faults_path))
            killed_at = time.time()
            sig = signal.SIGSTOP if args.stop else signal.SIGKILL
            os.kill(victim, sig)
            print(f"[chaos] kill {k + 1}/{args.kills}: {sig.name} {kind} pid {victim}", flush=True)
            try:
                event = wait_for(lambda: read_rows(faults_path)[before:], 600, f"recovery from kill {k + 1}", proc)[0]
            except RuntimeError as e:  # the run ended first: with several generators, training goes on
                why = ("the run finished its steps before this generator was back (--steps too few for "
                       "--kills)" if proc.returncode == 0 else "the run failed")
                print(f"[chaos]   {e}: {why}; no later kill", flush=True)
                break
            kills.append({"kind": kind, "pid": victim, "killed_at_run_s": killed_at - t_first,
                          "generator": event["generator"], "detection_s": event["detected_at"] - killed_at,
                          "recovery_s": event["recovered_at"] - killed_at, "requeued_groups": event["requeued_groups"],
                          "cause": event["cause"][:120]})
            print(f"[chaos]   generator{event['generator']}: detected after {kills[-1]['detection_s']:.1f}s, "
                  f"generating again after {kills[-1]['recovery_s']:.1f}s ({event['requeued_groups']} groups requeued)",
                  flush=True)
        code = proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    metrics = read_rows(run_dir / "metrics.jsonl")
    buf = read_summary(run_dir).get("stats", {}).get("buffer", {})
    evals = eval_rows(metrics)
    steps = [r["step"] for r in step_rows(metrics)]
    checks = {
        "exit code 0": code == 0,
        f"all {args.steps} steps": steps == list(range(1, args.steps + 1)),
        "accounting identity": bool(buf) and buf["admitted_samples"] == buf["trained_samples"]
        + buf["dropped_samples"] + buf["held_samples"],
        "no group lost to a kill": bool(buf) and set(buf["dropped_groups"]) <= {"stale", "zero_signal"},
        f"all {args.kills} kills made and recovered": len(kills) == args.kills,
    }
    if not args.quick:  # sampled or greedy, either alone is noisy; --quick's 30 steps prove no learning
        checks["held-out reward rose"] = len(evals) >= 2 and any(evals[-1][k] > evals[0][k]
                                                                 for k in ("eval/reward", "eval/reward_greedy"))
    print("\n| kill | what | generator | detection s | recovery s | groups requeued |")
    print("|---:|---|---:|---:|---:|---:|")
    for k, e in enumerate(kills, 1):
        print(f"| {k} | {e['kind']} | {e['generator']} | {e['detection_s']:.1f} | {e['recovery_s']:.1f} | "
              f"{e['requeued_groups']} |")
    if evals:
        print(f"\nheld-out reward {evals[0]['eval/reward']:.3f} (step {evals[0]['step']}) -> "
              f"{evals[-1]['eval/reward']:.3f} (step {evals[-1]['step']})")
    if buf:
        print(f"buffer: admitted {buf['admitted_samples']} = trained {buf['trained_samples']} + dropped "
              f"{buf['dropped_samples']} {buf['dropped_groups']} + held {buf['held_samples']}; "
              f"requeued groups {buf['requeued_groups']}")
    for name, passed in checks.items():
        print(f"[{'ok' if passed else 'FAIL'}] {name}")
        ok &= passed
    (out / "chaos.json").write_text(json.dumps({"kills": kills, "checks": checks, "buffer": buf}, indent=2))
    if metrics:
        plot(metrics, kills, out / "chaos.png")
    if code != 0:  # the run's own words on why it ended: the tail of its log
        print("[chaos] the run's last log lines:\n" + "\n".join((out / "run.log").read_text(errors="replace").splitlines()[-40:]))
    print(f"wrote {out / 'chaos.json'}, {out / 'chaos.png'}; run log {out / 'run.log'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
