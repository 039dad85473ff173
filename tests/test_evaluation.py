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
        ev = Evaluation(cfg(10), task=None, fleet=fleet, report=lambda i, e: reports.append((i, str(e))))

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


def test_eval_without_any_generator_fails_after_the_restart_bound_naming_the_key():
    ev = Evaluation(cfg(0.5), task=None, fleet=Fleet(), report=lambda i, e: None)
    with pytest.raises(RunError, match=r"no generator is serving after waiting generator.start_timeout_s=0s"):
        asyncio.run(ev._on_a_generator(lambda h: None))


def test_a_generator_that_keeps_failing_is_tried_twice_then_named():
    async def run():
        fleet = Fleet()
        fleet.restart(0, "bad")
        ev = Evaluation(cfg(5), task=None, fleet=fleet, report=lambda i, e: fleet.restart(0, "bad"))

        async def work(handle):
            raise ValueError("prompt 3 is malformed")
        with pytest.raises(RunError, match="failed it, twice; the last error: prompt 3 is malformed"):
            await ev._on_a_generator(work)
    asyncio.run(run())
