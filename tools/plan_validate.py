"""`tools/plan.py validate`: the simulator's prediction beside tools/pipeline_bench.py runs measured here.

    # the real runs, one configuration at a time under the lock (~90 s each):
    flock /tmp/rl-heavy.lock python tools/pipeline_bench.py --repeats 1 --steps 12 --out bench_out/val/e3_s2 \
        trainer.epochs=3 buffer.max_staleness=2
    python tools/plan.py validate bench_out/val --costs tools/plan_data/costs_here.json \
        --record tools/plan_data/validation.json --plot docs/img/planner_validation.png

Every directory under RUNS named in CASES holds one configuration's pipeline_bench output
(sync0/, async0/, ..., and more repeats in subdirectories, e.g. rep2/sync0/); it is simulated from
the cost file with the same config (CASES gives its overrides) and the task's own lengths. Per configuration: async/sync tokens/s
ratio (target: within 10% of the real one), trainer idle and dropped fraction per mode (within
0.05 absolute). Real figures are medians over the repeats; cases whose sync configuration is the
same (sync mode sets Δ, max_staleness and on_update itself) share their real sync runs. A second
prediction scales the trainer's costs to each run's own mean train time: the trainer's core is
shared with other work here, and that column shows what is left once its speed is known. --record writes it all (the real figures
too) so tests/test_planner.py can check the prediction without running anything heavy.
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
    """The config tools/pipeline_bench.py runs (its `measure` overrides, placement aside: the cost file holds it)."""
    return ["task.name=pipeline.tasks.longtail", "generator.ignore_eos=true", f"generator.max_new_tokens={max_tokens}",
            f"buffer.batch_groups={B}", f"buffer.group_size={G}", f"run.steps={steps}", "run.eval_every=0",
            "run.warm_start_steps=0", *extra]


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in KEYS}


def _sync_key(cfg) -> str:
    """Runs of the same sync configuration: sync_mode_config sets Δ, max_staleness and on_update, so
    cases differing only in those share their sync baseline (their real sync runs are pooled)."""
    c = sim_config(cfg)  # with overcommit=none the other Δ keys are inert
    return repr(dataclasses.replace(c, buffer=dataclasses.replace(c.buffer, delta=0, delta_min=0, delta_max=0)))


def _train_scaled(costs, real_train_s: float, predicted_train_s: float):
    """The costs with the trainer's figures scaled so the mean train call matches a real run's: the
    prediction as it would be on that run's machine load (the trainer core is shared here)."""
    f = real_train_s / predicted_train_s
    t = costs.trainer
    return dataclasses.replace(costs, trainer=dataclasses.replace(
        t, step_base_s=t.step_base_s * f, epoch_base_s=t.epoch_base_s * f, per_token_s=t.per_token_s * f))


def compare(name: str, runs: dict[str, list[Path]], costs, config: str = "configs/tiny.yaml") -> dict:
    """Real (medians over `runs[mode]`) against predicted, for the configuration CASES[name]."""
    extra, max_tokens = CASES[name]
    steps = 12
    case = {"name": name, "overrides": bench_overrides(extra, max_tokens, steps), "steps": steps,
            "real": {}, "predicted": {}, "predicted_at_run_train_speed": {}, "rows": {}}
    for mode in ("sync", "async"):
        summaries = [real_summary(d) for d in runs[mode]]
        case["real"][mode] = _median(summaries) | {"repeats": len(summaries),
                                                  "tokens_per_s_min": min(x["tokens_per_s"] for x in summaries),
                                                  "tokens_per_s_max": max(x["tokens_per_s"] for x in summaries)}
        cfg = load_config(config, [*case["overrides"], f"run.mode={mode}"])
        res = simulate(cfg, costs, workload_from_spec("task", cfg), steps=steps)
        s = res.summary()
        case["predicted"][mode] = {k: s[k] for k in KEYS} | {"staleness_hist": s["staleness_hist"]}
        scaled = _train_scaled(costs, case["real"][mode]["train_s"], s["train_s"])
        s2 = simulate(cfg, scaled, workload_from_spec("task", cfg), steps=steps).summary()
        case["predicted_at_run_train_speed"][mode] = {k: s2[k] for k in KEYS} | {"train_scale": scaled.trainer.per_token_s / costs.trainer.per_token_s}
        case["rows"][mode] = {"simulated": res.rows_dicts(), "real": real_rows(runs[mode][0])}
    r, p, q = case["real"], case["predicted"], case["predicted_at_run_train_speed"]
    case["ratio_real"] = r["async"]["tokens_per_s"] / r["sync"]["tokens_per_s"]
    case["ratio_real_spread"] = [r["async"]["tokens_per_s_min"] / r["sync"]["tokens_per_s_max"],
                                 r["async"]["tokens_per_s_max"] / r["sync"]["tokens_per_s_min"]]
    case["ratio_predicted"] = p["async"]["tokens_per_s"] / p["sync"]["tokens_per_s"]
    case["ratio_error"] = case["ratio_predicted"] / case["ratio_real"] - 1
    case["ratio_at_run_train_speed"] = q["async"]["tokens_per_s"] / q["sync"]["tokens_per_s"]
    case["ratio_error_at_run_train_speed"] = case["ratio_at_run_train_speed"] / case["ratio_real"] - 1
    case["within"] = abs(case["ratio_error"]) <= 0.10 and all(
        abs(p[m][k] - r[m][k]) <= 0.05 for m in ("sync", "async") for k in ("trainer_idle_frac", "dropped_frac"))
    return case


def table(cases: list[dict]) -> str:
    lines = ["| configuration | runs sync / async | async/sync real (range) | predicted | error | at the runs' train speed "
             "| trainer idle sync real / pred | async real / pred | dropped async real / pred | within targets |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cases:
        r, p = c["real"], c["predicted"]
        lo, hi = c["ratio_real_spread"]
        lines.append(f"| {c['name']} | {r['sync']['repeats']} / {r['async']['repeats']} | {c['ratio_real']:.2f}x "
                     f"({lo:.2f}..{hi:.2f}) | {c['ratio_predicted']:.2f}x | {c['ratio_error']:+.0%} | "
                     f"{c['ratio_at_run_train_speed']:.2f}x ({c['ratio_error_at_run_train_speed']:+.0%}) | "
                     f"{r['sync']['trainer_idle_frac']:.2f} / {p['sync']['trainer_idle_frac']:.2f} | "
                     f"{r['async']['trainer_idle_frac']:.2f} / {p['async']['trainer_idle_frac']:.2f} | "
                     f"{r['async']['dropped_frac']:.2f} / {p['async']['dropped_frac']:.2f} | "
                     f"{'yes' if c['within'] else 'no'} |")
    return "\n".join(lines)


def collect(runs: Path, config: str = "configs/tiny.yaml") -> dict[str, dict[str, list[Path]]]:
    """Per case under `runs`: its async run directories, and the sync ones of every case with the same
    sync configuration (pooled)."""
    found = {}
    for d in sorted(p for p in runs.iterdir() if p.is_dir() and p.name in CASES):
        found[d.name] = {m: sorted(x.parent for x in d.glob(f"**/{m}[0-9]*/summary.json")) for m in ("sync", "async")}
    key = {n: _sync_key(load_config(config, [*bench_overrides(*CASES[n]), "run.mode=sync"])) for n in found}
    out = {}
    for n, r in found.items():
        pooled = [d for m, rr in found.items() if key[m] == key[n] for d in rr["sync"]]
        if pooled and r["async"]:
            out[n] = {"sync": pooled, "async": r["async"]}
        else:
            print(f"skipped {n}: no finished {'sync' if not pooled else 'async'} run under {runs / n}")
    return out


def validate(runs: Path, costs_path: str, record: str | None, plot: str | None) -> int:
    costs = load_costs(costs_path)
    cases = [compare(name, r, costs) for name, r in collect(runs).items()]
    if not cases:
        raise SystemExit(f"validate: no finished pipeline_bench runs named {sorted(CASES)} under {runs}")
    print(table(cases))
    if record:
        Path(record).write_text(json.dumps({"costs": Path(costs_path).name, "cases": [
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
