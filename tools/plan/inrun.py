"""`python -m tools.plan calibrate`'s second stage: each cost's level as a real run sees it.

The waves, the synthetic train steps and sync_bench (tools/plan/calibrate.py) give each cost's
shape; two short real runs of the CLI (CONTROLLER_RUN, sync then async) give what a run adds:

    sync run    the engine's level (batch wait real / simulated), the train call's excess per call,
                the controller's per-step time, the whole push and the generator's pause in it
                (the load), as_in_run and whole_push
    async run   the contention factors whose simulation matches its train call and batch wait
                (fit_contention_in_run)

Example:
    ctl, seen = measure_controller("configs/tiny.yaml", overrides, out)
    costs, factors = as_in_run(costs, "configs/tiny.yaml", overrides, seen)
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from pipeline.config import load_config
from pipeline.sim.costs import ENGINE_TERMS, costs_from_dict
from tools.lib.cli import REPO, check_cli, disjoint_cores
from tools.lib.metrics import read_rows



def say(msg: str) -> None:
    print(f"[calibrate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


CONTROLLER_RUN = ["task.name=pipeline.tasks.longtail", "generator.ignore_eos=true", "generator.max_new_tokens=64",
                  "buffer.batch_groups=8", "buffer.group_size=4", "run.mode=sync", "run.steps=8", "run.eval_every=0",
                  "run.warm_start_steps=0", "run.checkpoint_every=0", "run.progress=false"]
"""The calibration's real run: sync, long-tail lengths capped at 64 (pipeline_bench's cap is 96)."""


def run_cli(config: str, overrides: list[str], out: Path, name: str) -> list[dict]:
    """A short real run of the CLI (CONTROLLER_RUN + overrides); its per-step metrics rows."""
    run_dir = out / name
    check_cli(config, [*CONTROLLER_RUN, *overrides, f"run.out_dir={run_dir}"], out / f"{name}.log",
              f"the calibration run {name}")
    return [r for r in read_rows(run_dir / "metrics.jsonl") if "version/trainer" in r]


def measure_controller(config: str, overrides: list[str], out: Path) -> tuple[dict, dict]:
    """A short sync run of the CLI (CONTROLLER_RUN): the controller's per-step time, and what the
    run saw of each component: the whole push and the generator's pause in it, the batch wait and
    the train call (steps after the first, as pipeline_bench counts them)."""
    say(f"in a run: {CONTROLLER_RUN[-5]}, " + " ".join(CONTROLLER_RUN[:3]) + " (the CLI, sync)")
    rows = run_cli(config, overrides, out, "controller_run")
    other = [b["time_s"] - a["time_s"] - b["time/batch_wait_s"] - b["time/train_s"] - b["sync/latency_s"]
             for a, b in zip(rows[1:], rows[2:])]
    pause = rows[-1]["sync/update_pause_s"]  # the generators' mean pause over the run's updates
    if pause != pause:
        raise RuntimeError(f"the calibration run reported no update pause (sync/update_pause_s); see {out}")
    seen = {"steps": len(rows), "push_s": statistics.median(r["sync/latency_s"] for r in rows[1:]), "pause_s": pause,
            "batch_wait_s": statistics.mean(r["time/batch_wait_s"] for r in rows[1:]),
            "train_s": statistics.mean(r["time/train_s"] for r in rows[1:]), "per_step_other_s": other}
    return {"step_overhead_s": max(0.0, statistics.median(other))}, seen


def measure_async(config: str, overrides: list[str], out: Path) -> dict:
    """The same run in async mode (max_staleness 1): the batch wait and the train call as they are
    when generation and training overlap."""
    say("in a run: the same, async")
    rows = run_cli(config, [*overrides, "run.mode=async"], out, "async_run")
    return {"steps": len(rows), "batch_wait_s": statistics.mean(r["time/batch_wait_s"] for r in rows[1:]),
            "train_s": statistics.mean(r["time/train_s"] for r in rows[1:])}


FACTORS = [1.0 + 0.05 * i for i in range(13)]
"""The contention factors fit_contention_in_run tries: 1.0 .. 1.6."""


def fit_contention_in_run(costs: dict, config: str, overrides: list[str], seen: dict) -> dict:
    """The contention factors that make the async calibration run's simulation match it: the
    trainer's factor from its train call, the generator's from the batch wait (each with the other
    fixed, twice). The isolated measurement (tools/plan/contention.py: each side against the other
    kept fully busy) is an upper bound; in a run the generator is busy with a few long requests most
    of the time, and the run is what the cost file must predict."""
    from pipeline.sim import simulate, workload_from_spec

    cfg = load_config(config, [*overrides, *CONTROLLER_RUN, "run.mode=async"])

    def sim(tf: float, gf: float) -> dict:
        c = costs_from_dict(costs | {"contention": {"trainer_factor": tf, "generator_factor": gf}})
        return simulate(cfg, c, workload_from_spec("task", cfg), steps=seen["steps"]).summary()

    tf = gf = 1.0
    for _ in range(2):
        tf = min(FACTORS, key=lambda x: abs(sim(x, gf)["train_s"] - seen["train_s"]))
        gf = min(FACTORS, key=lambda x: abs(sim(tf, x)["batch_wait_s"] - seen["batch_wait_s"]))
    return {"trainer_factor": tf, "generator_factor": gf}


def as_in_run(costs: dict, config: str, overrides: list[str], seen: dict) -> tuple[dict, dict]:
    """The generator's and the trainer's costs as the calibration run saw them: the run simulated
    with the fitted costs, then every engine term times the real batch wait over the simulated one
    (the engine runs slower beside the buffer's and the controller's messages on its cores), and the
    train call's excess over the simulated one added to step_base_s (what a run adds to a train call
    is per call: the batch's way to the trainer, the call itself; scaling every term instead carried
    a one-epoch run's excess threefold into three-epoch steps, 21% over). The waves and synthetic
    steps fix the shape of each cost (how it grows with concurrency, length, tokens, epochs)."""
    from pipeline.sim import simulate, workload_from_spec

    cfg = load_config(config, [*overrides, *CONTROLLER_RUN])
    sim = simulate(cfg, costs_from_dict(costs), workload_from_spec("task", cfg), steps=seen["steps"]).summary()
    f = {"generator": seen["batch_wait_s"] / sim["batch_wait_s"], "trainer": seen["train_s"] / sim["train_s"],
         "simulated_batch_wait_s": sim["batch_wait_s"], "simulated_train_s": sim["train_s"]}
    g = {k: v * f["generator"] if k in ENGINE_TERMS else v for k, v in costs["generator"].items()}
    extra = seen["train_s"] - sim["train_s"]
    if extra >= 0:  # what the run adds to a train call is per call (the batch's way, the call), not per epoch
        t = costs["trainer"] | {"step_base_s": costs["trainer"]["step_base_s"] + extra}
    else:  # a faster trainer than the synthetic steps showed: every term at the run's speed
        t = {k: v * f["trainer"] if k.endswith("_s") else v for k, v in costs["trainer"].items()}
    f["trainer_added_s"] = max(0.0, extra)
    return costs | {"generator": g, "trainer": t}, f


def whole_push(push: dict, push_e2e_s: float, pause_s: float | None = None) -> dict:
    """The push as a run sees it (sync/latency_s: the trainer's call, staging, the generator's apply
    with its version check, the actor round trips between them) is longer than sync_bench's pack,
    transfer and load. The generator's pause in the run (`pause_s`, sync/update_pause_s: pausing
    the engine, the load, resuming it) is the load: no token is sampled during it, so a keep update
    stalls generation that long, and a request submitted during it samples on the new weights. The
    rest of the whole push beyond the pack is the transfer (transfer_base_s: staging and round trips,
    generation going on). Without `pause_s` (records from before it was measured) the excess over
    the pieces joins the transfer."""
    n = push["bytes"]
    if pause_s is None:
        parts = (push["pack_base_s"] + push["transfer_base_s"] + push["load_base_s"]
                 + (push["pack_per_byte_s"] + push["transfer_per_byte_s"] + push["load_per_byte_s"]) * n)
        return push | {"transfer_base_s": push["transfer_base_s"] + max(0.0, push_e2e_s - parts)}
    load_base = max(push["load_base_s"], pause_s - push["load_per_byte_s"] * n)
    others = push["pack_base_s"] + load_base + (push["pack_per_byte_s"] + push["transfer_per_byte_s"]
                                                + push["load_per_byte_s"]) * n
    return push | {"load_base_s": load_base, "transfer_base_s": max(0.0, push_e2e_s - others)}


def calibrate_contention(config: str, overrides: list[str], out_file: Path) -> dict:
    """Only the contention, into the existing cost file `out_file` (the other components as they
    were): the async calibration run, fitted (fit_contention_in_run)."""
    overrides = [*disjoint_cores(), *overrides]
    out = REPO / "bench_out" / "plan_calibration" / out_file.stem
    out.mkdir(parents=True, exist_ok=True)
    costs = json.loads(out_file.read_text())
    seen_async = measure_async(config, overrides, out)
    costs["contention"] = fit_contention_in_run(costs, config, overrides, seen_async)
    costs["source"] += f"; contention fitted to an async run on {time.strftime('%Y-%m-%d %H:%M')} (--contention-only)"
    costs_from_dict(costs, str(out_file))
    out_file.write_text(json.dumps(costs, indent=1))
    record = out_file.with_name(out_file.stem + "_calibration.json")
    rec = json.loads(record.read_text()) if record.is_file() else {}
    rec.setdefault("in_run", {}).update(seen_async=seen_async, contention=costs["contention"])
    rec.setdefault("contention", {})["fit"] = costs["contention"]
    record.write_text(json.dumps(rec, indent=1, default=str))
    say(f"contention in the async run (batch wait {seen_async['batch_wait_s']:.3f} s, train call "
        f"{seen_async['train_s']:.3f} s): {costs['contention']}; wrote {out_file} and {record}")
    return costs
