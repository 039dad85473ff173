"""`python -m tools.plan recommend`: generators per trainer rank, max_staleness, Δ bounds and update mode for a target.

    python -m tools.plan recommend configs/tiny.yaml --costs tools/plan/data/costs_here.json --lengths task \
        --max-idle 0.15 --max-stale 0.5 task.name=pipeline.tasks.longtail generator.ignore_eos=true

Targets: trainer idle below --max-idle, at most --max-stale of the trained samples off-policy
(staleness >= 1) and at most --max-dropped of the finished samples dropped (their tokens wasted).
--total-devices D: D devices (GPUs) for trainer ranks and generators together: every split into
R = D // (k+1) trainer ranks (k = 1..--max-generators) and D - R generators is a candidate, and the cost file's trainer
figures are read as one rank's (per_token_s and step_per_token_s divided by R: data parallel). Without it,
trainer.num_ranks ranks, the cost file's trainer as a whole, and k·ranks generators.
--generator-devices D: the hardware runs D generators at full speed (one GPU each, or this
machine's cores for generators); with more, each generator's costs scale by k/D, as engines
sharing a device do (0: every generator brings its own device).

The search, each point a simulated run of --steps steps (pipeline/sim/):

 1. generators per trainer rank k = 1..--max-generators and max_staleness η = 0..4, with keep
    updates and Δ = η·B (the most over-commitment the staleness bound lets through): the smallest
    k, then the smallest η, that meets every target (with --total-devices, where every split
    uses the same devices: the fastest split that meets them); none does: the point that misses them least
    (the sum of each miss relative to its bound), naming what it misses.
 2. update mode keep / abort / drain at that (k, η): the fastest that still meets the targets.
 3. Δ: fixed Δ = 0 .. η·B; Δ bounds [0, Δ*] with Δ* the smallest Δ within 3% of the best
    tokens/s (adaptive Δ decays to delta_min on a reward plateau and grows towards Δ* while
    the reward rises; a Δ above η·B is inert, see pipeline/buffer.py).
Each choice is printed with the simulated figures that made it.

Example:
    rec = plan(cfg, load_costs(p), "task", steps=20, max_idle=0.15, max_stale=1.0, max_dropped=0.2, max_gens=4)
    rec["num_generators"], rec["max_staleness"], rec["on_update"], rec["delta_max"]
"""

from __future__ import annotations

import dataclasses

from pipeline.config import load_config
from pipeline.sim import load_costs, simulate, workload_from_spec

ETAS = (0, 1, 2, 3, 4)


def _sim(cfg, costs, lengths: str, steps: int, devices: int = 0, **changes) -> dict:
    g = {k[2:]: v for k, v in changes.items() if k.startswith("g_")}
    b = {k[2:]: v for k, v in changes.items() if k.startswith("b_")}
    c = dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator, **g),
                            buffer=dataclasses.replace(cfg.buffer, **b))
    costs = costs.sharing(c.generator.num_generators, devices)
    s = simulate(c, costs, workload_from_spec(lengths, c), steps=steps).summary()
    return {k: s[k] for k in ("tokens_per_s", "trainer_idle_frac", "generator_idle_frac", "stale_frac",
                              "dropped_frac", "mean_staleness", "wasted_tokens")}


def _line(tag: str, s: dict) -> str:
    return (f"  {tag:<28} {s['tokens_per_s']:9.0f} tok/s  trainer idle {s['trainer_idle_frac']:5.2f}  generator idle "
            f"{s['generator_idle_frac']:5.2f}  stale {s['stale_frac']:5.2f}  dropped {s['dropped_frac']:5.2f}")


def plan(cfg, costs, lengths: str, steps: int, max_idle: float, max_stale: float, max_dropped: float,
         max_gens: int, devices: int = 0, total: int = 0) -> dict:
    """The search of the module docstring; returns the choice and every simulated point (printed as it goes)."""
    B = cfg.buffer.batch_groups

    if total:  # (trainer ranks, generators) using every device, generators per rank rising
        ranks = sorted({total // (k + 1) for k in range(1, max_gens + 1)} - {0}, reverse=True)
        splits = [(R, total - R) for R in ranks]
    else:
        splits = [(cfg.trainer.num_ranks, k * cfg.trainer.num_ranks) for k in range(1, max_gens + 1)]
    if not splits:
        raise ValueError(f"recommend: no split of --total-devices {total} has at most {max_gens} generators per rank")

    def run(i: int, **changes) -> dict:
        R, n = splits[i]
        c = costs
        if total:  # the cost file's trainer is one rank's: R data-parallel ranks share each step's tokens
            t = costs.trainer
            c = dataclasses.replace(costs, trainer=dataclasses.replace(
                t, per_token_s=t.per_token_s / R, step_per_token_s=t.step_per_token_s / R))
        return _sim(cfg, c, lengths, steps, devices, g_num_generators=n, **changes)

    def name(i: int) -> str:
        R, n = splits[i]
        return f"{n / R:.3g}/rank ({n} gen, {R} rank)"

    def within(s: dict) -> bool:
        return s["stale_frac"] <= max_stale and s["dropped_frac"] <= max_dropped

    def ok(s: dict) -> bool:
        return s["trainer_idle_frac"] < max_idle and within(s)
    print(f"1. generators per trainer rank x max_staleness (keep updates, Δ = η·B = {B}·η), {steps} steps each:")
    grid = {}
    for k in range(len(splits)):
        for eta in ETAS:
            s = grid[k, eta] = run(k, g_on_update="keep",
                                    b_max_staleness=eta, b_overcommit="fixed", b_delta=eta * B)
            print(_line(f"{name(k)} η={eta}", s) + ("   <- meets both" if ok(s) else ""))
        if not total and any(ok(grid[k, e]) for e in ETAS):
            break  # more generators per rank only cost devices
    meeting = [key for key, s in grid.items() if ok(s)]
    if meeting and total:  # the devices are paid for either way: the fastest split that meets the targets
        k, eta = max(meeting, key=lambda key: (grid[key]["tokens_per_s"], -key[1]))
        why = (f"the most trained tokens/s ({grid[k, eta]['tokens_per_s']:.0f}) among the splits of {total} devices "
               f"meeting every target (trainer idle {grid[k, eta]['trainer_idle_frac']:.2f} < {max_idle}, stale "
               f"fraction {grid[k, eta]['stale_frac']:.2f} <= {max_stale}, dropped {grid[k, eta]['dropped_frac']:.2f} "
               f"<= {max_dropped})")
    elif meeting:  # each generator is one more device: the fewest that bring the trainer's idle under the target
        k, eta = min(meeting)
        why = (f"the fewest generators per rank that bring trainer idle under {max_idle:.0%} "
               f"({grid[k, eta]['trainer_idle_frac']:.2f}), with the smallest max_staleness that does it at "
               f"that count (stale fraction {grid[k, eta]['stale_frac']:.2f} <= {max_stale}, dropped "
               f"{grid[k, eta]['dropped_frac']:.2f} <= {max_dropped})")
    else:
        def miss(s: dict) -> float:  # how far a point is from the targets, each relative to its bound
            return (max(0.0, s["trainer_idle_frac"] - max_idle) / max_idle + max(0.0, s["stale_frac"] - max_stale)
                    / max(max_stale, 1e-9) + max(0.0, s["dropped_frac"] - max_dropped) / max(max_dropped, 1e-9))
        k, eta = min(grid, key=lambda key: (round(miss(grid[key]), 3), key))
        s = grid[k, eta]
        missed = [f"{what} {s[key]:.2f} > {bound}" for what, key, bound in (
            ("trainer idle", "trainer_idle_frac", max_idle), ("stale fraction", "stale_frac", max_stale),
            ("dropped", "dropped_frac", max_dropped)) if s[key] > bound]
        limit = "generation" if s["generator_idle_frac"] < 0.1 else "training or the push"
        why = (f"no point meets every target; this one misses them least ({', '.join(missed)}); its generators "
               f"are idle {s['generator_idle_frac']:.2f}, so {limit} limits it")
    print(f"   -> {name(k)}, max_staleness={eta}: {why}")
    print(f"2. update mode at {name(k)}, η={eta}:")
    modes = {m: run(k, g_on_update=m, b_max_staleness=eta,
                     b_overcommit="fixed", b_delta=eta * B) for m in ("keep", "abort", "drain")}
    for m, s in modes.items():
        print(_line(m, s))
    good = [m for m in modes if ok(modes[m])] or list(modes)
    mode = max(good, key=lambda m: modes[m]["tokens_per_s"])
    print(f"   -> on_update={mode}: the most tokens/s{' among those meeting the targets' if meeting else ''}")
    print(f"3. over-commitment Δ at {name(k)}, η={eta}, {mode}:")
    deltas = sorted({0, *range(0, eta * B + 1, max(1, B // 4)), eta * B})
    dres = {d: run(k, g_on_update=mode, b_max_staleness=eta,
                    b_overcommit="fixed" if d else "none", b_delta=d) for d in deltas}
    for d, s in dres.items():
        print(_line(f"Δ={d}", s))
    best = max(s["tokens_per_s"] for s in dres.values())
    dmax = min(d for d, s in dres.items() if s["tokens_per_s"] >= 0.97 * best)
    print(f"   -> Δ in [0, {dmax}]: Δ={dmax} is within 3% of the best tokens/s ({best:.0f}); beyond it more "
          f"over-commitment only adds staleness")
    R, n = splits[k]
    rec = {"generators_per_rank": n / R, "num_generators": n, "trainer_ranks": R, "max_staleness": eta, "on_update": mode,
           "delta_min": 0, "delta_max": dmax, "meets_targets": bool(meeting), "figures": dres[dmax]}
    print(f"\nrecommended: trainer.num_ranks={R} generator.num_generators={n} buffer.max_staleness={eta} generator.on_update={mode} "
          f"buffer.overcommit=adaptive buffer.delta_min=0 buffer.delta_max={dmax} buffer.delta={dmax}"
          f"{'' if meeting else '   (targets NOT met: see step 1)'}")
    print(_line("predicted (fixed Δ=Δ*)", dres[dmax]))
    return rec


def recommend(a) -> int:
    cfg = load_config(a.config, a.overrides)
    rec = plan(cfg, load_costs(a.costs), a.lengths, a.steps, a.max_idle, a.max_stale, a.max_dropped,
               a.max_generators, a.generator_devices, a.total_devices)
    return 0 if rec["meets_targets"] else 1
