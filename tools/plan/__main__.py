"""The planner: predict a run before it starts (pipeline/sim/), calibrated here, checked against real runs.

    python -m tools.plan simulate configs/tiny.yaml --costs tools/plan/data/costs_here.json \
        --lengths task run.mode=async buffer.max_staleness=2 [--compare RUN_DIR] [--plot out.png]
    python -m tools.plan calibrate --out tools/plan/data/costs_here.json      # heavy: under the lock, ~4 min
    python -m tools.plan validate bench_out/val --costs tools/plan/data/costs_here.json \
        --record tools/plan/data/validation.json                              # sim vs tools/bench/pipeline_bench.py runs
    python -m tools.plan recommend configs/tiny.yaml --costs tools/plan/data/costs_here.json --lengths task
    python -m tools.plan papers                                               # tools/plan/data/papers/*.yaml

`simulate` prints what a run reports (trained tokens/s, trainer and generator idle, staleness
histogram, dropped samples, wasted tokens) in total and per step; --compare puts a real run's
figures beside it and --plot draws both. Extra key=value arguments override the config, as for
`python -m pipeline.run`. Lengths: `task` (the task's budgets, generator.ignore_eos=true), a
rollouts.jsonl, or lognormal:MEDIAN,SIGMA,CAP[,PROMPT_TOKENS] (pipeline/sim/workload.py). A cost file
missing a component, or a config the simulator does not model, is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.config import ConfigError, load_config
from pipeline.sim import (CostFileError, UnmodelledConfig, WorkloadError, check_modelled, load_costs,
                          real_summary, reward_from_spec, simulate, workload_from_spec)
from pipeline.sim.report import plot_runs, real_rows
from tools.plan.validate import validate
from tools.lib.cli import REPO

BENCH = ["task.name=pipeline.tasks.longtail", "generator.ignore_eos=true", "run.eval_every=0",
         "run.warm_start_steps=0"]


def fmt_summary(name: str, s: dict) -> str:
    hist = ", ".join(f"{k}: {v}" for k, v in sorted(s.get("staleness_hist", {}).items()))
    gen = s.get("generator_idle_frac")
    return (f"{name:<10} {s['tokens_per_s']:8.0f} tok/s {s['samples_per_s']:7.1f} samples/s  trainer idle "
            f"{s['trainer_idle_frac']:.2f}  generator idle {gen if gen is None else round(gen, 2)}  "
            f"staleness {s['mean_staleness']:.2f}  dropped {s['dropped_samples']:.0f} ({s['dropped_frac']:.1%})  "
            f"wasted tokens {s['wasted_tokens']:.0f}" + (f"  hist {{{hist}}}" if hist else ""))


def cmd_simulate(a) -> int:
    cfg = load_config(a.config, a.overrides)
    check_modelled(cfg)  # an unmodelled config is named before anything else is read
    costs = load_costs(a.costs).sharing(cfg.generator.num_generators, a.generator_devices)
    res = simulate(cfg, costs, workload_from_spec(a.lengths, cfg, a.seed),
                   reward_from_spec(a.reward), steps=a.steps, seed=a.seed)
    s = res.summary()
    print(f"workload: {res.workload}; {s['steps'] + 1} steps simulated ({cfg.run.mode}), the first skipped "
          f"as pipeline_bench does")
    print(fmt_summary("simulated", s))
    runs = {"simulated": res.rows_dicts()}
    if a.compare:
        print(fmt_summary("real", real_summary(a.compare)))
        runs["real"] = real_rows(a.compare)
    if a.per_step:
        print("step  time_s  wait_s  train_s  sync_s  tokens  staleness  delta  dropped  wasted")
        for r in res.rows:
            print(f"{r.step:4d} {r.time_s:7.2f} {r.batch_wait_s:7.3f} {r.train_s:8.3f} {r.sync_s:7.3f} {r.tokens:7d} "
                  f"{r.staleness_mean:9.2f} {r.delta:6d} {r.dropped_samples:8d} {r.wasted_tokens:7.0f}")
    if a.plot:
        plot_runs(runs, a.plot, f"{cfg.run.mode}: simulated" + (" vs real" if a.compare else ""))
        print(f"wrote {a.plot}")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": s, "rows": res.rows_dicts()}, indent=1))
    return 0


def cmd_calibrate(a) -> int:
    from tools.plan.calibrate import calibrate, refit

    if a.refit:
        refit(Path(a.out))
    elif a.contention_only:
        from tools.plan.inrun import calibrate_contention

        calibrate_contention(a.config, a.overrides, Path(a.out))
    else:
        calibrate(a.config, a.overrides, Path(a.out), a.reps)
    return 0


def cmd_validate(a) -> int:
    return validate(Path(a.runs), a.costs, a.record, a.plot, a.disturbed_above)


def cmd_recommend(a) -> int:
    from tools.plan.recommend import recommend

    return recommend(a)


def cmd_papers(a) -> int:
    from tools.plan.papers import papers

    return papers(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("simulate", help="simulate one run of a config")
    s.add_argument("config")
    s.add_argument("--costs", required=True)
    s.add_argument("--lengths", default="task")
    s.add_argument("--reward", default="flat:0.0,0.05", help="flat:M[,N] | rising:S,E,TAU[,N] | metrics.jsonl")
    s.add_argument("--steps", type=int, default=None, help="default run.steps")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--compare", help="a real run's out_dir (metrics.jsonl, summary.json) to put beside it")
    s.add_argument("--plot", help="PNG: the simulated run (and --compare's) over time")
    s.add_argument("--per-step", action="store_true")
    s.add_argument("--json", help="write the summary and rows here")
    s.add_argument("--generator-devices", type=int, default=0,
                   help="generators that run at full speed at once (0: each its own device; this machine, "
                        "generators pinned to one core: 1)")
    s.add_argument("overrides", nargs="*")
    s.set_defaults(fn=cmd_simulate)
    c = sub.add_parser("calibrate", help="measure the component costs here (heavy: hold the lock)")
    c.add_argument("--config", default="configs/tiny.yaml")
    c.add_argument("--out", default="tools/plan/data/costs_here.json")
    c.add_argument("--reps", type=int, default=3, help="repeats per measured case (medians are fitted)")
    c.add_argument("--refit", action="store_true", help="fit again from the waves recorded beside --out (light)")
    c.add_argument("--contention-only", action="store_true",
                   help="only the trainer/generator contention, fitted to a short async run, into the existing "
                        "--out (heavy, ~1 min)")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=cmd_calibrate)
    v = sub.add_parser("validate", help="simulate each tools/bench/pipeline_bench.py run under RUNS and compare")
    v.add_argument("runs", help="a directory of pipeline_bench --out directories, or a --record file (its real "
                                "figures predicted again from --costs)")
    v.add_argument("--costs", required=True)
    v.add_argument("--record", help="write the comparison (and the real figures) to this JSON")
    v.add_argument("--plot", help="PNG of simulated vs real per configuration")
    v.add_argument("--disturbed-above", type=float, default=0.0,
                   help="leave out (and list) runs whose mean train call exceeds this many times the simulated one "
                        "(other work on the trainer's core); 0: keep every run")
    v.set_defaults(fn=cmd_validate)
    r = sub.add_parser("recommend", help="generators per trainer rank, max_staleness, Δ bounds, update mode")
    r.add_argument("config")
    r.add_argument("--costs", required=True)
    r.add_argument("--lengths", default="task")
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--max-idle", type=float, default=0.15, help="target: trainer idle below this")
    r.add_argument("--max-stale", type=float, default=1.0, help="target: fraction of trained samples with staleness > 0")
    r.add_argument("--max-dropped", type=float, default=0.2, help="target: fraction of finished samples dropped")
    r.add_argument("--total-devices", type=int, default=0,
                   help="devices for trainer ranks and generators together (the cost file's trainer is then one rank)")
    r.add_argument("--generator-devices", type=int, default=0,
                   help="generators that run at full speed at once (0: each its own device; this machine: 1)")
    r.add_argument("--max-generators", type=int, default=8, help="per trainer rank")
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_recommend)
    p = sub.add_parser("papers", help="reproduce published async/sync speedups from their stated setups")
    p.add_argument("--dir", default=str(REPO / "tools" / "plan" / "data" / "papers"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", help="scenarios whose file name contains this")
    p.set_defaults(fn=cmd_papers)
    a, rest = ap.parse_known_args(argv)  # key=value overrides may follow the options too
    if getattr(a, "generator_devices", 0) < 0:
        ap.error(f"--generator-devices must be 0 (each generator its own device) or more, not {a.generator_devices}")
    bad = [x for x in rest if x.startswith("-") or "=" not in x or not hasattr(a, "overrides")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    if rest:
        a.overrides = [*a.overrides, *rest]
    try:
        return a.fn(a)
    except (CostFileError, UnmodelledConfig, WorkloadError, ConfigError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # a cost file, a run directory or a calibration record named but absent
        print(f"plan: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
