"""`python -m tools.plan validate`: the simulator's prediction beside tools/bench/pipeline_bench.py runs measured here.

    # the real runs, one configuration at a time under the lock (~70 s per repeat):
    flock /tmp/rl-heavy.lock python -m tools.bench.pipeline_bench --repeats 3 --steps 12 --out bench_out/val3/e3_s2 \
        trainer.epochs=3 buffer.max_staleness=2
    python -m tools.plan validate bench_out/val3 --costs tools/plan/data/costs_here.json \
        --record tools/plan/data/validation.json --plot docs/results/img/planner_validation.png

Every directory under RUNS holding a pipeline_bench output (sync0/, async0/, ..., and more
repeats in subdirectories, e.g. rep2/sync0/) is one configuration; it is simulated from the cost
file with the same config (its bench.json, which pipeline_bench writes; for runs made before it
did, CASES by the directory's name) and the task's own lengths. Per configuration: async/sync tokens/s
ratio (target: within 10% of the real one), trainer idle and dropped fraction per mode (within
0.05 absolute). Real figures are medians over the repeats; cases whose sync configuration is the
same (sync mode sets Δ, max_staleness and on_update itself) share their real sync runs. The
prediction is made from the cost file alone, contention included (a train step slows while the
generator is busy on the shared cores, and the generator while the trainer trains: the cost file's
`contention`, fitted by `calibrate` to its own short async run). A second figure predicts the async arm
from the sync arm's measured speeds (`_sync_scaled`: the trainer's and the generator's costs scaled
to the sync runs' train call and batch wait, which never overlap), for a machine whose load from
other work changes between the calibration and the runs; it never reads the async runs. --record writes it all (the real figures, with their min..max over
the repeats, too) so tests/test_planner.py can check the prediction without running anything heavy.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from pipeline.config import load_config
from pipeline.sim import load_costs, real_summary, simulate, workload_from_spec
from pipeline.sim.pipeline import sim_config
from pipeline.sim.report import plot_runs, real_rows
from tools.lib.report import markdown_table
from tools.lib.views import PLANNER_ALIGN, PLANNER_HEADER, planner_rows

CASES = {
    "e1_s1_adaptive": ([], 96),
    "e3_s1_adaptive": (["trainer.epochs=3"], 96),
    "e1_s0_adaptive": (["buffer.max_staleness=0"], 96),
    "e3_s2_adaptive": (["trainer.epochs=3", "buffer.max_staleness=2"], 96),
    "e1_s2_fixed4": (["buffer.overcommit=fixed", "buffer.delta=4", "buffer.max_staleness=2"], 96),
    "e1_s1_len192": ([], 192),
    "e3_s1_abort": (["trainer.epochs=3", "generator.on_update=abort"], 96),
    "e1_s1_save": (["generator.carry_over=save"], 96),
    "e3_s3_rec": (["trainer.epochs=3", "buffer.max_staleness=3", "buffer.delta=6", "buffer.delta_max=6"], 96),
}
"""pipeline_bench configurations: name -> (extra overrides, --max-tokens); B=8, G=4, 12 steps."""

KEYS = ("tokens_per_s", "samples_per_s", "trainer_idle_frac", "generator_idle_frac", "dropped_frac",
        "dropped_samples", "mean_staleness", "wasted_tokens", "batch_wait_s", "train_s")


def bench_overrides(extra: list[str], max_tokens: int, steps: int = 12, B: int = 8, G: int = 4) -> list[str]:
    """The config tools/bench/pipeline_bench.py runs (its `measure` overrides, placement aside: the cost file holds it)."""
    return ["task.name=pipeline.tasks.longtail", "generator.ignore_eos=true", f"generator.max_new_tokens={max_tokens}",
            f"buffer.batch_groups={B}", f"buffer.group_size={G}", f"run.steps={steps}", "run.eval_every=0",
            "run.warm_start_steps=0", *extra]


def bench_case(d: Path, config: str = "configs/tiny.yaml") -> tuple[str, list[str], int, int] | None:
    """(config, overrides, steps, generator devices) of the pipeline_bench output in `d`: its
    bench.json, else CASES by the directory's name (runs made before pipeline_bench wrote
    bench.json, all with one generator), else None."""
    f = d / "bench.json"
    if f.is_file():
        b = json.loads(f.read_text())
        return b["config"], bench_overrides(b["overrides"], b["max_tokens"], b["steps"], b["batch_groups"],
                                            b["group_size"]), b["steps"], b.get("generator_devices", 0)
    if d.name in CASES:
        extra, max_tokens = CASES[d.name]
        return config, bench_overrides(extra, max_tokens), 12, 0
    return None


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in KEYS}


def _sync_key(cfg) -> str:
    """Runs of the same sync configuration: sync_mode_config sets Δ, max_staleness and on_update, so
    cases differing only in those share their sync baseline (their real sync runs are pooled)."""
    c = sim_config(cfg)  # with overcommit=none the other Δ keys are inert
    return repr(dataclasses.replace(c, buffer=dataclasses.replace(c.buffer, delta=0, delta_min=0, delta_max=0)))


def _sync_scaled(costs, real_sync: dict, pred_sync: dict):
    """The costs at the speeds the real sync arm ran at: trainer costs times its train call over the
    predicted one, generator costs times its batch wait over the predicted one. The sync arm never
    overlaps training and generation, so these are each side's speed alone during the runs; the
    async arm is then predicted from them with the contention factors, never from its own figures."""
    ft, fg = real_sync["train_s"] / pred_sync["train_s"], real_sync["batch_wait_s"] / pred_sync["batch_wait_s"]
    g = costs.generator.scaled(fg)
    return dataclasses.replace(costs, trainer=costs.trainer.scaled(ft),
                               generator=dataclasses.replace(g, admit_s=g.admit_s * fg)), ft, fg


def compare(name: str, runs: dict[str, list[Path]], costs, config: str, overrides: list[str], steps: int,
            generator_devices: int = 0, disturbed_above: float = 0.0) -> dict:
    """Real (medians over `runs[mode]`) against predicted, for `config` with `overrides`. With
    disturbed_above > 0, a run whose mean train call is more than that many times the simulated one
    (contention included) is left out and listed under "disturbed": the trainer's core was busy with
    other work then (a case with "skipped" if no run of a mode is left)."""
    costs = costs.sharing(load_config(config, overrides).generator.num_generators, generator_devices)
    case = {"name": name, "config": config, "overrides": overrides, "steps": steps,
            "generator_devices": generator_devices,
            "real": {}, "predicted": {}, "predicted_from_sync_arm": {}, "rows": {}, "disturbed": []}
    for mode in ("sync", "async"):
        cfg = load_config(config, [*case["overrides"], f"run.mode={mode}"])
        res = simulate(cfg, costs, workload_from_spec("task", cfg), steps=steps)
        s = res.summary()
        kept = []
        for d in runs[mode]:
            x = real_summary(d)
            if disturbed_above and x["train_s"] > disturbed_above * s["train_s"]:
                case["disturbed"].append({"run": str(d), "train_s": x["train_s"], "predicted_train_s": s["train_s"],
                                          "tokens_per_s": x["tokens_per_s"]})
            else:
                kept.append(d)
        runs = {**runs, mode: kept}
        if not kept:
            return {"name": name, "skipped": f"every {mode} run disturbed", "disturbed": case["disturbed"]}
        summaries = [real_summary(d) for d in kept]
        case["real"][mode] = _median(summaries) | {"repeats": len(summaries)} | {
            f"{k}_{f.__name__}": f(x[k] for x in summaries)
            for k in ("tokens_per_s", "trainer_idle_frac", "dropped_frac", "train_s") for f in (min, max)}
        case["predicted"][mode] = {k: s[k] for k in KEYS} | {"staleness_hist": s["staleness_hist"]}
        case["rows"][mode] = {"simulated": res.rows_dicts(), "real": real_rows(runs[mode][0])}
    return _judge(case, costs, config)


def _judge(case: dict, costs, config: str) -> dict:
    """The prediction from the sync arm's speeds, the ratios and the targets, from case["real"] and
    case["predicted"]."""
    steps = case["steps"]
    case["predicted_from_sync_arm"] = {}
    scaled, ft, fg = _sync_scaled(costs, case["real"]["sync"], case["predicted"]["sync"])
    for mode in ("sync", "async"):
        cfg = load_config(config, [*case["overrides"], f"run.mode={mode}"])
        s2 = simulate(cfg, scaled, workload_from_spec("task", cfg), steps=steps).summary()
        case["predicted_from_sync_arm"][mode] = {k: s2[k] for k in KEYS} | {"train_scale": ft, "generator_scale": fg}
    r, p, q = case["real"], case["predicted"], case["predicted_from_sync_arm"]
    case["ratio_real"] = r["async"]["tokens_per_s"] / r["sync"]["tokens_per_s"]
    case["ratio_real_spread"] = [r["async"]["tokens_per_s_min"] / r["sync"]["tokens_per_s_max"],
                                 r["async"]["tokens_per_s_max"] / r["sync"]["tokens_per_s_min"]]
    case["ratio_predicted"] = p["async"]["tokens_per_s"] / p["sync"]["tokens_per_s"]
    case["ratio_error"] = case["ratio_predicted"] / case["ratio_real"] - 1
    case["ratio_from_sync_arm"] = q["async"]["tokens_per_s"] / q["sync"]["tokens_per_s"]
    case["ratio_error_from_sync_arm"] = case["ratio_from_sync_arm"] / case["ratio_real"] - 1
    case["ratio_within"] = abs(case["ratio_error"]) <= 0.10
    case["within"] = case["ratio_within"] and all(
        abs(p[m][k] - r[m][k]) <= 0.05 for m in ("sync", "async") for k in ("trainer_idle_frac", "dropped_frac"))
    return case


def resimulate(record: Path, costs_path: str, config: str = "configs/tiny.yaml") -> list[dict]:
    """The cases of a `--record` file predicted again from another cost file, beside their recorded
    real figures (runs measured earlier, whose directories may be gone)."""
    costs = load_costs(costs_path)
    cases = json.loads(record.read_text())["cases"]
    for case in cases:
        config = case.get("config", config)  # older records: the default config
        costs = load_costs(costs_path).sharing(load_config(config, case["overrides"]).generator.num_generators,
                                               case.get("generator_devices", 0))
        for mode in ("sync", "async"):
            cfg = load_config(config, [*case["overrides"], f"run.mode={mode}"])
            s = simulate(cfg, costs, workload_from_spec("task", cfg), steps=case["steps"]).summary()
            case["predicted"][mode] = {k: s[k] for k in KEYS} | {"staleness_hist": s["staleness_hist"]}
        r = case["real"]
        for mode in ("sync", "async"):  # older records kept only the tokens/s spread
            for k in ("trainer_idle_frac", "dropped_frac", "train_s"):
                r[mode].setdefault(f"{k}_min", r[mode][k] if r[mode]["repeats"] == 1 else float("nan"))
                r[mode].setdefault(f"{k}_max", r[mode][k] if r[mode]["repeats"] == 1 else float("nan"))
        _judge(case, costs, config)
    return cases


def collect(runs: Path, config: str = "configs/tiny.yaml") -> dict[str, dict]:
    """Per case under `runs`: its (config, overrides, steps), its async run directories, and the sync
    ones of every case with the same sync configuration (pooled)."""
    found, spec = {}, {}
    for d in sorted(p for p in runs.iterdir() if p.is_dir()):
        if (s := bench_case(d, config)) is None:
            continue
        spec[d.name] = s
        found[d.name] = {m: sorted(x.parent for x in d.glob(f"**/{m}[0-9]*/summary.json")) for m in ("sync", "async")}
    key = {n: (spec[n][0], _sync_key(load_config(spec[n][0], [*spec[n][1], "run.mode=sync"]))) for n in found}
    out = {}
    for n, r in found.items():
        pooled = [d for m, rr in found.items() if key[m] == key[n] for d in rr["sync"]]
        if pooled and r["async"]:
            out[n] = {"spec": spec[n], "sync": pooled, "async": r["async"]}
        else:
            print(f"skipped {n}: no finished {'sync' if not pooled else 'async'} run under {runs / n}")
    return out


def validate(runs: Path, costs_path: str, record: str | None, plot: str | None, disturbed_above: float = 0.0) -> int:
    """Compare the pipeline_bench runs under `runs`, or, if `runs` is a --record file, its recorded
    real figures (resimulate), with the prediction from `costs_path`."""
    costs = load_costs(costs_path)
    if runs.is_file():
        cases, plot, skipped = resimulate(runs, costs_path), None, []
    else:
        every = [compare(name, r, costs, *r["spec"], disturbed_above=disturbed_above)
                 for name, r in collect(runs).items()]
        cases = [c for c in every if "skipped" not in c]
        skipped = [c for c in every if "skipped" in c]
    if not cases:
        raise SystemExit(f"validate: no finished pipeline_bench runs (a directory with bench.json, or named one of "
                         f"{sorted(CASES)}) under {runs}")
    print(markdown_table(PLANNER_HEADER, planner_rows(cases), PLANNER_ALIGN))
    for c in skipped:
        print(f"skipped {c['name']}: {c['skipped']}")
    left = {d["run"]: d for c in cases + skipped for d in c.get("disturbed", [])}  # pooled sync runs recur
    for run, d in sorted(left.items()):
        print(f"left out (disturbed): {run}: train call {d['train_s']:.3f} s against {d['predicted_train_s']:.3f} "
              f"s simulated, {d['tokens_per_s']:.0f} tokens/s")
    if record:
        Path(record).write_text(json.dumps({"costs": Path(costs_path).name, "disturbed_above": disturbed_above,
                                            "left_out": sorted(left.values(), key=lambda d: d["run"]), "cases": [
            {k: v for k, v in c.items() if k != "rows"} for c in cases]}, indent=1))
        print(f"wrote {record}")
    if plot:
        base = Path(plot)
        for c in cases:
            p = base.with_name(f"{base.stem}_{c['name']}{base.suffix}")
            plot_runs({f"{m} {k}": rows for m in ("sync", "async") for k, rows in c["rows"][m].items()}, p,
                      f"{c['name']}: simulated (dashed) vs real")
        print(f"wrote {base.stem}_<case>{base.suffix} plots")
    return 0 if all(c["within"] for c in cases) else 1
