"""Held-out evaluation on a generator, scored by the task's reward.

    ev = Evaluation(cfg, task, fleet, report=supervisor.report)
    metrics = await ev.evaluate()     # eval/reward, eval/reward_greedy, eval/skipped_prompts, eval/rejected/*
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Callable

from pipeline.config import Config
from pipeline.driver.calls import RunError, call_within
from pipeline.driver.fleet import Fleet
from pipeline.generator.rewards import RewardScorer
from pipeline.tasks import RewardRejected, take

log = logging.getLogger(__name__)

EVAL_SAMPLES = 4


class Evaluation:
    """Contract: `evaluate` runs the task's held-out prompts (task.eval_prompts) on the first live
    generator; one that fails is reported (`report(i, error)`, to its supervisor) and the next live
    one is tried. `eval/reward` samples EVAL_SAMPLES completions per prompt at the training
    temperature (the policy's expected reward, what RL optimises); `eval/reward_greedy` is the
    greedy completion's reward. Faults stay local: prompts a generator could not serve come back
    None (counted as skipped), completions whose reward cannot be used are counted by reason and left
    out of the mean. The caller decides which weights are evaluated (the eval hook first waits for
    the push in flight).

    Example:
        ev = Evaluation(cfg, task, fleet, report=lambda i, e: None)
        await sync.wait()
        print((await ev.evaluate())["eval/reward"])
    """

    def __init__(self, cfg: Config, task: Any, fleet: Fleet, report: Callable[[int, BaseException], None]):
        self.cfg, self.task, self.fleet, self.report = cfg, task, fleet, report

    async def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        items = take(self.task, cfg.task.seed, "eval", cfg.task.eval_prompts)
        prompts = [i.prompt for i in items]
        n = cfg.generator.max_new_tokens
        live = self.fleet.live_generators()
        for k, (i, slot) in enumerate(live):  # a generator dying meanwhile: the next
            gen = slot.handle
            try:  # the items, not just their prompts: a multi-turn task's environment gets them as in training
                greedy = await call_within("generate_eval", gen.generate_eval.call_one(items, n))
                sampled = await call_within("generate_eval", gen.generate_eval.call_one(
                    items * EVAL_SAMPLES, n, cfg.generator.temperature, cfg.task.seed))
                break
            except Exception as e:
                if k == len(live) - 1:
                    raise
                log.warning("eval on generator%d failed (%s); trying the next", i, e)
                self.report(i, e)
        else:
            raise RunError("evaluate: no generator is serving (all are being restarted)")
        scorer = RewardScorer(self.task, cfg.task.reward_timeout_s, cfg.task.reward_workers)
        rejected: Counter = Counter()

        async def one(prompt: str, completion: str) -> float | None:
            try:
                return await scorer.score(prompt, completion)
            except RewardRejected as e:
                rejected[e.reason] += 1
                return None

        async def score(outs: list) -> float:
            got = await asyncio.gather(*(one(p, o) for p, o in zip(prompts * EVAL_SAMPLES, outs) if o is not None))
            ok = [r for r in got if r is not None]
            return sum(ok) / len(ok) if ok else float("nan")

        out = {"eval/reward": await score(sampled), "eval/reward_greedy": await score(greedy),
               "eval/skipped_prompts": float(sum(o is None for o in greedy))}
        return out | {f"eval/rejected/{k}": float(v) for k, v in sorted(rejected.items())}
