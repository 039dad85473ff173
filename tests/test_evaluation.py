"""Evaluation while generators are restarted: it waits (bounded) for one to serve again instead of
failing the run, reports a generator that fails it, and tries the restarted incarnation."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from pipeline.config import Config
from pipeline.driver.calls import RunError
from pipeline.driver.evaluation import Evaluation


class Fleet:
    def __init__(self) -> None:
        self.slots: dict[int, SimpleNamespace] = {}
        self.started: dict[int, int] = {}

    def live_generators(self):
        return sorted(self.slots.items())

    def restart(self, i: int, handle) -> None:
        self.started[i] = self.started.get(i, -1) + 1
        self.slots[i] = SimpleNamespace(handle=handle, incarnation=self.started[i])


def cfg(start_timeout_s: float) -> Config:
    c = Config()
    return dataclasses.replace(c, generator=dataclasses.replace(c.generator, start_timeout_s=start_timeout_s))


def test_eval_waits_for_a_restarted_generator_and_retries_one_that_failed():
    async def run():
        fleet, reports = Fleet(), []
        ev = Evaluation(cfg(10), task=None, fleet=fleet, report=lambda i, e, inc: reports.append((i, str(e))))

        async def work(handle):
            if handle == "dying":
                fleet.slots.pop(0)  # the supervisor takes it out, then brings incarnation 1 back later
                asyncio.get_running_loop().call_later(0.3, fleet.restart, 0, "fresh")
                raise RuntimeError("engine core died")
            return f"served by {handle}"

        asyncio.get_running_loop().call_later(0.3, fleet.restart, 0, "dying")  # none serving at first
        assert await ev._on_a_generator(work) == "served by fresh"
        assert reports == [(0, "engine core died")]
    asyncio.run(run())


def test_a_failure_seen_after_the_restart_is_charged_to_the_old_incarnation():
    """The supervisor can restart a generator (the same slot, incarnation + 1) before the eval's call
    to the old one returns its error: the eval reports incarnation 0 (not the new one, which would be
    restarted for nothing) and serves from incarnation 1 (a run once waited start_timeout_s here)."""
    async def run():
        fleet, reports = Fleet(), []
        fleet.restart(0, "dying")
        ev = Evaluation(cfg(2), task=None, fleet=fleet, report=lambda i, e, inc: reports.append((i, str(e), inc)))

        async def work(handle):
            if handle == "dying":
                slot = fleet.slots[0]
                slot.handle, slot.incarnation = "fresh", 1  # restarted in place, as Fleet's MeshSlot is
                raise RuntimeError("stopped by client")
            return f"served by {handle}"
        assert await ev._on_a_generator(work) == "served by fresh"
        assert reports == [(0, "stopped by client", 0)]
    asyncio.run(run())


def test_eval_without_any_generator_fails_after_the_restart_bound_naming_the_key():
    ev = Evaluation(cfg(0.5), task=None, fleet=Fleet(), report=lambda i, e, inc: None)
    with pytest.raises(RunError, match=r"no generator is serving after waiting generator.start_timeout_s=0s"):
        asyncio.run(ev._on_a_generator(lambda h: None))


def test_a_generator_that_keeps_failing_is_tried_twice_then_named():
    async def run():
        fleet = Fleet()
        fleet.restart(0, "bad")
        ev = Evaluation(cfg(5), task=None, fleet=fleet, report=lambda i, e, inc: fleet.restart(0, "bad"))

        async def work(handle):
            raise ValueError("prompt 3 is malformed")
        with pytest.raises(RunError, match="failed it, twice; the last error: prompt 3 is malformed"):
            await ev._on_a_generator(work)
    asyncio.run(run())


def test_the_probe_after_an_eval_reuses_its_sampled_requests_and_draws_only_the_rest():
    """Sample k of held-out prompt j has seed task.seed + k * n + j, the seed of the eval's sampled
    request k * n + j; a generator whose completion is a function of (prompt, seed) gives the probe the
    same rewards with the eval's requests reused as drawn afresh, on all prompts and on the first few,
    and is asked only for the ones the eval did not draw."""
    from pipeline.config import TaskConfig
    from pipeline.tasks import load_task

    class Generate:
        def __init__(self):
            self.asked: list[tuple[str, int]] = []

        def call_one(self, prompts, max_new_tokens, temperature=0.0, seed=0):
            seeds = seed if isinstance(seed, list) else [seed + i for i in range(len(prompts))]
            assert len(seeds) == len(prompts)

            async def answer():
                out = []
                for it, s in zip(prompts, seeds):
                    s = s if temperature > 0 else -1
                    self.asked.append((it.prompt, s))
                    # right (the reversed word) on about half of the (prompt, seed) pairs
                    right = it.prompt[4:-1][::-1]
                    out.append(right if (s * 7 + len(it.prompt)) % 3 else right + "x")
                return out
            return answer()

    async def run(reuse: bool, prompts: int):
        c = Config()
        c = dataclasses.replace(c, task=dataclasses.replace(c.task, eval_prompts=6, eval_samples=2, eval_k=2, seed=5))
        task = load_task(c.task.name, TaskConfig(**{**c.task.__dict__}))
        gen = SimpleNamespace(generate_eval=Generate())
        fleet = Fleet()
        fleet.restart(0, gen)
        ev = Evaluation(c, task=task, fleet=fleet, report=lambda i, e, inc: None)
        await ev.evaluate()
        evals = list(gen.generate_eval.asked)
        probe = await ev.probe(5, reuse_eval=reuse, prompts=prompts)
        return probe, gen.generate_eval.asked[len(evals):], evals

    fresh, asked_fresh, evals = asyncio.run(run(False, 0))
    reused, asked_reused, _ = asyncio.run(run(True, 0))
    assert reused == fresh and len(fresh) == 6 and all(len(r) == 5 for r in fresh)
    assert len({r for rs in fresh for r in rs}) > 1  # the rewards tell requests apart
    assert asked_fresh[:12] == evals[6:]  # the eval's sampled pass (after its 6 greedy) is the probe's k < 2
    assert len(asked_fresh) == 30 and asked_reused == asked_fresh[12:]  # 6 prompts x 2 eval samples reused
    assert sorted(s for _, s in asked_reused) == list(range(5 + 12, 5 + 30))
    # the first 2 prompts: the same rewards as those prompts' in the full probe, 2 x 3 requests asked
    few, asked_few, _ = asyncio.run(run(True, 2))
    few_fresh, asked_few_fresh, _ = asyncio.run(run(False, 2))
    assert few == few_fresh == fresh[:2]
    assert len(asked_few_fresh) == 10 and sorted(asked_few) == sorted(a for a in asked_fresh[12:] if a in asked_few_fresh)
    assert len(asked_few) == 6 and {p for p, _ in asked_few} == {p for p, _ in evals[:2]}
