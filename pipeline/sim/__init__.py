"""The planner's simulator: the whole pipeline on a simulated clock around the real replay buffer.

    costs.py      the cost file (every component named, checked)
    workload.py   prompt and response lengths (task, rollouts.jsonl, lognormal) and the reward curve
    generator.py  SimGenerator: N' slots, fluid decoding, keep / abort / drain, carry-over
    pipeline.py   simulate(): trainer loop, publish (sync / async), push (rolling), the buffer itself
    report.py     pipeline_bench's figures for a simulated or a real run, and the comparison plot

`python -m tools.plan` drives it (simulate, calibrate, validate, recommend, papers); docs/planner.md says how
far to trust it.

Pure Python: no Monarch, no vLLM.

Example:
    cfg = load_config("configs/tiny.yaml", ["run.mode=async"])
    res = simulate(cfg, load_costs("tools/plan/data/costs_here.json"), workload_from_spec("lognormal:12,1,96", cfg))
    res.summary()["tokens_per_s"], res.summary()["staleness_hist"]
"""

from pipeline.sim.costs import CostFileError, Costs, costs_from_dict, load_costs
from pipeline.sim.pipeline import UnmodelledConfig, check_modelled, simulate
from pipeline.sim.report import SimResult, real_summary
from pipeline.sim.workload import RewardCurve, WorkloadError, reward_from_spec, workload_from_spec

__all__ = ["CostFileError", "Costs", "costs_from_dict", "load_costs", "UnmodelledConfig", "check_modelled",
           "simulate", "SimResult", "real_summary", "RewardCurve", "WorkloadError", "reward_from_spec",
           "workload_from_spec"]
