"""`python -m tools.plan papers`: published async/sync speedups, reproduced from each paper's stated setup and costs.

    python -m tools.plan papers                       # every tools/plan/data/papers/*.yaml, ~1 min
    python -m tools.plan papers --only verl           # one scenario

A scenario file (YAML) states what the paper gives and what had to be assumed:

    name, reported: [low, high], source        the claim and where it is stated
    stated: [...], assumed: [...]              prose, printed with the result
    scale: 8                                    simulate 1/scale of the cluster: generators, batch
                                                and trainer shrink together (all data parallel), so
                                                per-step times are unchanged
    lengths: lognormal:MEDIAN,SIGMA,CAP,PROMPT  response lengths
    overrides: [...]                            config keys for both arms (over configs/tiny.yaml)
    costs: {...}                                a whole cost file (pipeline/sim/costs.py)
    arms: {sync: {overrides, costs}, async: {overrides, costs}}   per-arm changes (costs merged)
    fit: {param: median|sigma, target: sync.batch_wait_s|..., value: 177.9, lo, hi}
                                                optional: one unknown of the workload solved by
                                                bisection so the simulated sync arm matches a
                                                stated figure; the async arm is then a prediction
    implied: {cost: trainer.step_base_s, lo, hi}   optional, for a paper that does not state a cost
                                                the speedup hinges on: the value of that cost (in
                                                both arms, scaled alike) at which the simulated
                                                speedup equals the reported one, to set beside
                                                what the paper's setup makes plausible

The speedup is the ratio of trained tokens/s (async over sync), as the papers compare time for the
same number of samples.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from pipeline.config import load_config
from pipeline.sim import costs_from_dict, simulate, workload_from_spec

_KEYS = {"name", "reported", "source", "stated", "assumed", "scale", "lengths", "overrides", "costs", "arms", "fit",
         "implied"}


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in (b or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _lengths(spec: str, **change) -> str:
    head, args = spec.split(":", 1)
    vals = args.split(",")
    for i, k in enumerate(("median", "sigma", "cap", "prompt")):
        if k in change:
            vals[i] = f"{change[k]:g}"
    return f"{head}:{','.join(vals)}"


def run_arm(sc: dict, arm: str, steps: int, lengths: str) -> dict:
    a = sc["arms"][arm]
    where = f"{sc['_file']}: arms.{arm}"
    cfg = load_config("configs/tiny.yaml", [*sc.get("overrides", []), *a.get("overrides", []), f"run.mode={arm}"])
    costs = costs_from_dict(_merge(sc["costs"], a.get("costs", {})), where)
    return simulate(cfg, costs, workload_from_spec(lengths, cfg), steps=steps).summary()


def solve(sc: dict, steps: int) -> tuple[str, str]:
    """The lengths spec after the scenario's fit (if any), and a line saying what was fitted."""
    fit, lengths = sc.get("fit"), sc["lengths"]
    if not fit:
        return lengths, ""
    arm, key = fit["target"].split(".")
    lo, hi = float(fit["lo"]), float(fit["hi"])
    for _ in range(18):  # the target grows with the median / sigma of the lengths
        mid = (lo * hi) ** 0.5
        got = run_arm(sc, arm, steps, _lengths(lengths, **{fit["param"]: mid}))[key]
        lo, hi = (mid, hi) if got < fit["value"] else (lo, mid)
    value = (lo * hi) ** 0.5
    lengths = _lengths(lengths, **{fit["param"]: value})
    return lengths, f"fitted {fit['param']}={value:.4g} so that the simulated {fit['target']} = {fit['value']}"


def _with_cost(sc: dict, cost: str, value: float) -> dict:
    """The scenario with `cost` (section.key) set to `value` in the base costs and scaled alike in
    every arm that overrides it."""
    sec, key = cost.split(".")
    out = copy.deepcopy(sc)
    base = out["costs"][sec][key]
    out["costs"][sec][key] = value
    for arm in out["arms"].values():
        over = (arm or {}).get("costs", {}).get(sec, {})
        if key in over:
            over[key] = over[key] * value / base if base else value
    return out


def implied(sc: dict, steps: int, lengths: str) -> str:
    """The value of sc['implied']['cost'] at which the simulated speedup is the reported mid-point."""
    imp = sc["implied"]
    target = sum(sc["reported"]) / 2
    lo, hi = float(imp["lo"]), float(imp["hi"])
    what = imp["cost"]
    on_lengths = what.startswith("lengths.")  # lengths.sigma / lengths.median: the workload, not a cost

    def speedup(v: float) -> float:
        s2, ln = (sc, _lengths(lengths, **{what.split(".")[1]: v})) if on_lengths else (_with_cost(sc, what, v), lengths)
        return run_arm(s2, "async", steps, ln)["tokens_per_s"] / run_arm(s2, "sync", steps, ln)["tokens_per_s"]
    rising = speedup(hi) > speedup(lo)  # a heavier tail helps async; a dearer trainer hides less generation
    for _ in range(10):
        mid = (lo * hi) ** 0.5
        above = speedup(mid) > target
        lo, hi = (lo, mid) if above == rising else (mid, hi)
    value = (lo * hi) ** 0.5
    if value >= 0.99 * float(imp["hi"]) or value <= 1.01 * float(imp["lo"]):
        return f"no {what} in [{imp['lo']}, {imp['hi']}] gives {target:.2f}x with the other assumptions"
    assumed = (dict(zip(("median", "sigma", "cap", "prompt"), lengths.split(":")[1].split(",")))[what.split(".")[1]]
               if on_lengths else sc["costs"][what.split(".")[0]][what.split(".")[1]])
    return f"the reported {target:.2f}x needs {what} = {value:.3g} (assumed {assumed})"


def load_scenario(path: Path) -> dict:
    sc = yaml.safe_load(path.read_text())
    unknown = set(sc) - _KEYS
    missing = {"name", "reported", "source", "lengths", "costs", "arms"} - set(sc)
    if unknown or missing:
        raise ValueError(f"{path}: " + (f"unknown keys {sorted(unknown)} " if unknown else "") +
                         (f"missing keys {sorted(missing)}" if missing else ""))
    sc["_file"] = str(path)
    return sc


def papers(a) -> int:
    files = sorted(Path(a.dir).glob("*.yaml"))
    if getattr(a, "only", None):
        files = [f for f in files if a.only in f.stem]
    rows = []
    for f in files:
        sc = load_scenario(f)
        lengths, fitted = solve(sc, a.steps)
        res = {arm: run_arm(sc, arm, a.steps, lengths) for arm in ("sync", "async")}
        speedup = res["async"]["tokens_per_s"] / res["sync"]["tokens_per_s"]
        lo, hi = sc["reported"]
        rows.append((sc["name"], lo, hi, speedup))
        print(f"\n== {sc['name']}  ({sc['source']})")
        for s in sc.get("stated", []):
            print(f"   stated:  {s}")
        for s in sc.get("assumed", []):
            print(f"   assumed: {s}")
        if fitted:
            print(f"   {fitted}")
        if sc.get("implied"):
            print(f"   implied: {implied(sc, a.steps, lengths)}")
        for arm, s in res.items():
            print(f"   {arm:<6} step {s['wall_s'] / s['steps']:8.1f} s  wait {s['batch_wait_s']:7.1f} s  train "
                  f"{s['train_s']:7.1f} s  trainer idle {s['trainer_idle_frac']:.2f}  generator idle "
                  f"{s['generator_idle_frac']:.2f}  staleness {s['mean_staleness']:.2f}  dropped {s['dropped_frac']:.2f}")
        print(f"   async/sync: simulated {speedup:.2f}x, reported {lo}-{hi}x")
    print("\n| paper | reported | simulated |\n|---|---:|---:|")
    for name, lo, hi, sp in rows:
        print(f"| {name} | {lo}-{hi}x | {sp:.2f}x |")
    return 0
