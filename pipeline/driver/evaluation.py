"""Held-out evaluation on a generator, scored by the task's reward.

    ev = Evaluation(cfg, task, fleet, report=supervisor.report)
    metrics = await ev.evaluate()     # eval/reward, eval/reward_greedy, eval/pass@k, eval/mean@k,
                                      # eval/skipped_prompts, eval/rejected/*
    rewards = await ev.probe(8)       # per held-out prompt, the rewards of 8 samples (one RL group's worth)
    rewards = await ev.probe(8, reuse_eval=True)   # the same, the last evaluate's samples reused (same weights)
    rewards = await ev.probe(8, True, prompts=8)    # the same on the first 8 held-out prompts
    pass_at_k(n=10, c=3, k=4)         # 1 - C(7, 4)/C(10, 4) = 0.8333...
"""

from __future__ import annotations

import asyncio
import time
import logging
from collections import Counter
from math import comb
from typing import Any, Callable

from pipeline.config import Config
from pipeline.driver.calls import RunError, call_within
from pipeline.driver.fleet import Fleet
from pipeline.generator.rewards import RewardScorer
from pipeline.tasks import RewardRejected, check_reward, take
from pipeline.types import Scored

log = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate (Chen et al. 2021) of the chance that at least one of k samples drawn
    without replacement from n, c of them correct, is correct: 1 - C(n-c, k) / C(n, k). Needs n >= k."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: n={n}, c={c}, k={k}; need 0 <= c <= n and 1 <= k <= n")
    return 1.0 - comb(n - c, k) / comb(n, k)


def at_k(per_prompt: list[list[float]], k: int) -> dict[str, float]:
    """eval/pass@k and eval/mean@k over prompts, each given the usable rewards of its samples. A
    sample passes with full reward (>= 1; rewards are in [0, 1]). mean@k is a prompt's mean reward
    (the expected mean of k of its samples), averaged over prompts. A prompt with fewer than k usable
    samples (rejected or skipped) is left out of both; NaN if no prompt is left."""
    full = [r for r in per_prompt if len(r) >= k]
    if not full:
        return {"eval/pass@k": float("nan"), "eval/mean@k": float("nan")}
    return {"eval/pass@k": sum(pass_at_k(len(r), sum(x >= 1.0 for x in r), k) for r in full) / len(full),
            "eval/mean@k": sum(sum(r) / len(r) for r in full) / len(full)}


class Evaluation:
    """Contract: `evaluate` runs the task's held-out prompts (task.eval_prompts) on the first live
    generator; one that fails is reported (`report(i, error)`, to its supervisor) and the next live
    one is tried. `eval/reward` samples task.eval_samples (n) completions per prompt at the training
    temperature (the policy's expected reward, what RL optimises); `eval/reward_greedy` is the
    greedy completion's reward; `eval/pass@k` and `eval/mean@k` (k = task.eval_k) are estimated from
    each prompt's n samples (`at_k`). Faults stay local: prompts a generator could not serve come back
    None (counted as skipped), completions whose reward cannot be used are counted by reason and left
    out of the mean. The caller decides which weights are evaluated (the eval hook first waits for
    the push in flight).

    Example:
        ev = Evaluation(cfg, task, fleet, report=lambda i, e, inc: None)
        await sync.wait()
        print((await ev.evaluate())["eval/reward"])
    """

    def __init__(self, cfg: Config, task: Any, fleet: Fleet, report: Callable[[int, BaseException, int], None]):
        self.cfg, self.task, self.fleet, self.report = cfg, task, fleet, report
        self._sampled: list[float | None] = []  # the last evaluate's sampled rewards, in request order

    async def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        items = self.items()
        greedy, sampled = await self._on_a_generator(lambda gen: self._greedy_and_sampled(gen, items))
        rejected: Counter = Counter()
        sampled_r = await self._score(items * cfg.task.eval_samples, sampled, rejected)
        self._sampled = sampled_r
        greedy_r = await self._score(items, greedy, rejected)
        per_prompt = [[r for r in sampled_r[i::len(items)] if r is not None] for i in range(len(items))]
        out = {"eval/reward": _mean(sampled_r), "eval/reward_greedy": _mean(greedy_r),
               "eval/skipped_prompts": float(sum(o is None for o in greedy))} | at_k(per_prompt, cfg.task.eval_k)
        return out | {f"eval/rejected/{k}": float(v) for k, v in sorted(rejected.items())}

    async def probe(self, samples: int, reuse_eval: bool = False, prompts: int = 0) -> list[list[float]]:
        """Per held-out prompt, the usable rewards of `samples` completions sampled at the training
        temperature (no greedy pass): what a group of that size would get in RL. The warm start's
        stopping rule and the pre-flight line read it (pipeline/driver/learning_signal.py). `prompts`:
        the first this many held-out prompts (0: all of them).

        Sample k of held-out prompt j is drawn with seed task.seed + k * n + j (n: all held-out prompts),
        the seed of `evaluate`'s sampled request k * n + j, so `reuse_eval` (the caller's word that the
        weights are those of the last `evaluate`, as after a fresh run's step-0 eval) takes that pass's
        rewards for samples k < task.eval_samples and samples only the rest: the same requests, not drawn
        twice, with or without reuse and on any subset of prompts."""
        items = self.items()
        n = len(items)
        used = items[:prompts] if prompts else items
        have = self._sampled if reuse_eval else []
        rewards: dict[tuple[int, int], float | None] = {}
        rest: list[tuple[int, int]] = []
        for k in range(samples):
            for j in range(len(used)):
                if k * n + j < len(have):
                    rewards[j, k] = have[k * n + j]
                else:
                    rest.append((j, k))
        if rest:
            seeds = [self.cfg.task.seed + k * n + j for j, k in rest]
            asked = [used[j] for j, _ in rest]
            outs = await self._on_a_generator(lambda gen: call_within("generate_eval", gen.generate_eval.call_one(
                asked, self.cfg.generator.max_new_tokens, self.cfg.generator.temperature, seeds)))
            rewards.update(zip(rest, await self._score(asked, outs, Counter())))
        return [[r for k in range(samples) if (r := rewards[j, k]) is not None] for j in range(len(used))]

    def items(self) -> list:
        """The held-out prompts: the first task.eval_prompts of the eval split (may be empty)."""
        return take(self.task, self.cfg.task.seed, "eval", self.cfg.task.eval_prompts)

    async def _greedy_and_sampled(self, gen: Any, items: list) -> tuple[list, list]:
        # the items, not just their prompts: a multi-turn task's environment gets them as in training
        n, cfg = self.cfg.generator.max_new_tokens, self.cfg
        greedy = await call_within("generate_eval", gen.generate_eval.call_one(items, n))
        sampled = await call_within("generate_eval", gen.generate_eval.call_one(
            items * cfg.task.eval_samples, n, cfg.generator.temperature, cfg.task.seed))
        return greedy, sampled

    async def _on_a_generator(self, work: Callable[[Any], Any]) -> Any:
        """`work(handle)` on the first live generator; one that fails is reported (the supervisor
        restarts it) and the next tried. With every generator being restarted, or every one failing,
        it waits for one to serve again (at most generator.start_timeout_s, a restart's own bound)
        and tries once more."""
        last: BaseException | None = None
        failed: set[tuple[int, int]] = set()  # (generator, incarnation): a restarted one is tried again
        for _ in range(2):
            for i, slot in await self._serving(failed):  # a generator dying meanwhile: the next
                inc = slot.incarnation  # read now: the supervisor may restart it while `work` waits
                try:
                    return await work(slot.handle)
                except Exception as e:
                    log.warning("eval on generator%d failed (%s); trying the next", i, e)
                    self.report(i, e, inc)
                    failed.add((i, inc))
                    last = e
        raise RunError(f"evaluate: every serving generator failed it, twice; the last error: {last}") from last

    async def _serving(self, failed: set[tuple[int, int]]) -> list:
        """The live generators but those that already failed this evaluation in their incarnation."""
        bound = self.cfg.generator.start_timeout_s
        deadline = time.monotonic() + bound
        while not (live := [(i, s) for i, s in self.fleet.live_generators() if (i, s.incarnation) not in failed]):
            if time.monotonic() >= deadline:
                raise RunError(f"evaluate: no generator is serving after waiting generator.start_timeout_s="
                               f"{bound:.0f}s for one to be restarted")
            await asyncio.sleep(0.2)  # the supervisor restarts generators in its own task
        return live

    async def _score(self, items: list, outs: list, rejected: Counter) -> list[float | None]:
        """Each completion's reward by the task; None for one the generator could not serve (None)
        or whose reward cannot be used (counted in `rejected` by reason)."""
        cfg = self.cfg
        scorer = RewardScorer(self.task, cfg.task.reward_timeout_s, cfg.task.reward_workers)

        async def one(prompt: Any, completion: str | None) -> float | None:
            if completion is None:
                return None
            try:
                if isinstance(completion, Scored):  # its environment scored the episode (OpenEnv)
                    return check_reward(completion.reward)
                return await scorer.score(prompt, completion)
            except RewardRejected as e:
                rejected[e.reason] += 1
                return None

        return list(await asyncio.gather(*(one(it.prompt, o) for it, o in zip(items, outs))))


def _mean(rewards: list[float | None]) -> float:
    ok = [r for r in rewards if r is not None]
    return sum(ok) / len(ok) if ok else float("nan")
