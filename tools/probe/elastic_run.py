"""Elastic generator pool, measured: a tiny run goes 1 -> 2 -> 1 generators through pipeline.control
while it trains, then a checkpoint taken while 2 generators ran is resumed into 1 generator.

    python -m tools.probe.elastic_run --out outputs/elastic                # ~6-10 min on 2 shared cores
    python -m tools.probe.elastic_run --report docs/results/data/elastic/elastic.json   # the results page's tables again

Run A (configs/tiny.yaml, weight_sync.verify=every, every trained sample logged, a checkpoint every
--checkpoint-every steps): at step --grow-at `generators=2`; --shrink-after steps after the join,
`generators=1`. Run B resumes the last checkpoint taken while 2 generators served, with 1 generator,
for --resume-steps more steps. Prints, and writes to --data (JSON): per phase (before, with 2, after)
steps/s, trained tokens/s, the generators' tokens/s (metrics' throughput/gen_tokens_per_s), trainer
idle; the join and leave times; the checks (exit codes, accounting identity, no group lost or trained
twice, staleness <= buffer.max_staleness, every push verified, the joiner's first-token version).
Exit 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from tools.lib.cli import REPO, start_cli, wait_for
from tools.lib.metrics import read_rows
from tools.lib.report import markdown_table
from tools.lib.views import ELASTIC_PHASE_HEADER, elastic_phase_rows

G, B, ETA = 8, 8, 1


def steps(out: Path) -> int:
    return len(read_rows(out / "metrics.jsonl"))


def control(out: Path, arg: str) -> dict:
    t0, asked = time.monotonic(), steps(out)
    p = subprocess.run([sys.executable, "-m", "pipeline.control", str(out), arg, "--timeout", "900"], cwd=REPO,
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"pipeline.control {arg} failed ({p.returncode}): {p.stderr}")
    return {**json.loads(p.stdout), "wall_s": time.monotonic() - t0, "asked_at_step": asked, "at_step": steps(out)}


def launch(out: Path, log: Path, args: list[str]) -> subprocess.Popen:
    overrides = ["run.eval_every=0", "run.warm_start_steps=15", f"run.out_dir={out}", "run.progress=false",
                 "weight_sync.verify=every", f"run.log_rollouts={G * B}", f"buffer.max_staleness={ETA}",
                 "generator.hang_timeout_s=120", *args]
    print("$ -m pipeline.run --config configs/tiny.yaml", " ".join(overrides), flush=True)
    return start_cli("configs/tiny.yaml", overrides, log)


def wait_steps(p: subprocess.Popen, out: Path, n: int) -> None:
    try:
        wait_for(lambda: steps(out) >= n, float("inf"), f"step {n}", p)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


def phase(ms: list[dict], lo: int, hi: int) -> dict:
    """Steps lo+1..hi: rates between the rows of steps lo and hi."""
    sel = [m for m in ms if lo < m["step"] <= hi]
    t0 = next(m["time_s"] for m in ms if m["step"] == lo) if lo else sel[0]["time_s"] - sel[0]["time/batch_wait_s"]
    dt = sel[-1]["time_s"] - t0
    mean = lambda k: sum(m[k] for m in sel) / len(sel)  # noqa: E731
    return {"steps": f"{lo + 1}-{hi}", "n": len(sel), "steps_per_s": len(sel) / dt,
            "trained_tokens_per_s": sum(m["batch/tokens"] for m in sel) / dt,
            "gen_tokens_per_s": mean("throughput/gen_tokens_per_s"), "trainer_idle": mean("trainer/idle_frac"),
            "staleness_max": max(m["staleness/max"] for m in sel)}


def checks(out: Path, steps_total: int, first: int = 1) -> dict:
    s = json.loads((out / "summary.json").read_text())
    buf = s["stats"]["buffer"]
    by_group = defaultdict(list)
    roll = read_rows(out / "rollouts.jsonl")
    for r in roll:
        by_group[r["group_id"]].append(r["step"])
    return {"steps": s["steps"], "accounting": buf["admitted_samples"] == buf["trained_samples"]
            + buf["dropped_samples"] + buf["held_samples"], "dropped_groups": buf["dropped_groups"],
            "no_group_lost": set(buf["dropped_groups"]) <= {"stale", "zero_signal"},
            "requeued_groups": buf["requeued_groups"], "samples_logged": len(roll),
            "each_group_once_whole": len(roll) == (steps_total - first + 1) * G * B
            and all(len(v) == G and len(set(v)) == 1 for v in by_group.values()),
            "staleness_max": max(r["staleness"] for r in roll), "pushes": s["pushes"],
            "all_pushes_verified": s["pushes"]["started"] == s["pushes"]["verified"] > 0}


def measure(a: argparse.Namespace) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run_a, run_b = out / "a", out / "b"
    p = launch(run_a, out / "a.log", [f"run.steps={a.steps}", f"run.checkpoint_every={a.checkpoint_every}",
                                      "run.keep_checkpoints=0"])
    wait_steps(p, run_a, a.grow_at)
    grow = control(run_a, "generators=2")
    wait_steps(p, run_a, min(grow["at_step"] + a.shrink_after, a.steps - 10))  # steps left for "after"
    shrink = control(run_a, "generators=1")
    rc_a = p.wait()
    ms = read_rows(run_a / "metrics.jsonl")
    two = [m["step"] for m in ms if m.get("generators/live") == 2.0]
    events = read_rows(run_a / "faults.jsonl")
    ckpts = [m["step"] for m in ms if "checkpoint" in m and m.get("generators/live") == 2.0]
    res = {"date": time.strftime("%Y-%m-%d"), "run_a": {"rc": rc_a, "grow": grow, "shrink": shrink, "events": events,
           "phases": [phase(ms, 0, grow["asked_at_step"]), phase(ms, grow["asked_at_step"], two[0] - 1),
                      phase(ms, two[0] - 1, two[-1]), phase(ms, shrink["at_step"], a.steps)],
           "checks": checks(run_a, a.steps) if rc_a == 0 else None}}
    if ckpts:
        k = ckpts[-1]
        p = launch(run_b, out / "b.log", [f"run.steps={k + a.resume_steps}", "run.checkpoint_every=0",
                                          f"run.resume={run_a / 'checkpoints' / f'step_{k}'}"])
        rc_b = p.wait()
        res["run_b"] = {"rc": rc_b, "resumed_from": k, "checks": checks(run_b, k + a.resume_steps, k + 1)
                        if rc_b == 0 else None, "generators": json.loads((run_b / "summary.json").read_text())
                        ["generators"] if rc_b == 0 else None}
    return res


def report(res: dict) -> tuple[str, bool]:
    a = res["run_a"]
    added = next(e for e in a["events"] if e["kind"] == "added")
    removed = next(e for e in a["events"] if e["kind"] == "removed")
    lines = markdown_table(ELASTIC_PHASE_HEADER, elastic_phase_rows(res)).splitlines()
    lines += ["", f"join: requested after step {a['grow']['asked_at_step']}, command returned after "
              f"{a['grow']['wall_s']:.1f} s (engine start included), generator{added['generator']} served version "
              f"{added['version']} (verified: {added['verified']}), its first tokens carried version "
              f"{added['first_token_version']}; leave: {removed['leave_s']:.2f} s ({removed['mode']}, drained: "
              f"{removed['drained']}), {removed['requeued_groups']} groups requeued, {removed['tokens']} tokens generated"]
    ok = a["rc"] == 0 and added["first_token_version"] == added["version"]
    for name, run in (("run A (1 -> 2 -> 1)", a), ("run B (resumed into 1 generator)", res.get("run_b"))):
        if run is None:
            lines.append(f"\n{name}: not run (no checkpoint while 2 generators served)")
            ok = False
            continue
        c = run["checks"]
        lines.append(f"\n{name}: exit {run['rc']}" + (f", resumed from step {run['resumed_from']}, generators at "
                                                       f"the end {run['generators']}" if "resumed_from" in run else ""))
        if c:
            lines.append(f"steps {c['steps']}; accounting identity {c['accounting']}; dropped {c['dropped_groups']} "
                         f"(no group lost: {c['no_group_lost']}); requeued {c['requeued_groups']}; {c['samples_logged']}"
                         f" samples logged, each group once and whole: {c['each_group_once_whole']}; max staleness "
                         f"{c['staleness_max']} (<= {ETA}); pushes {c['pushes']['verified']}/{c['pushes']['started']}"
                         " verified")
            ok = ok and c["accounting"] and c["no_group_lost"] and c["each_group_once_whole"] and \
                c["staleness_max"] <= ETA and c["all_pushes_verified"]
        ok = ok and run["rc"] == 0
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/elastic")
    ap.add_argument("--data", default="docs/results/data/elastic/elastic.json")
    ap.add_argument("--report", default=None, help="print the tables of a --data file and exit")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--grow-at", type=int, default=10)
    ap.add_argument("--shrink-after", type=int, default=10)
    ap.add_argument("--checkpoint-every", type=int, default=4)
    ap.add_argument("--resume-steps", type=int, default=6)
    a = ap.parse_args()
    if a.report:
        res = json.loads(Path(a.report).read_text())
    else:
        res = measure(a)
        Path(a.data).parent.mkdir(parents=True, exist_ok=True)
        Path(a.data).write_text(json.dumps(res, indent=2, default=str))
    text, ok = report(res)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
