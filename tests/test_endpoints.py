"""actors/endpoints.py on real Monarch procs: serial endpoints keep their order without holding up a
concurrent probe, and a reply to a caller stopped meanwhile is dropped instead of failing the actor
that replies (the real ReplayBufferActor, as a supervisor's restart of a generator leaves it).

    .venv/bin/python -m pytest -q tests/test_endpoints.py
"""

from __future__ import annotations

import asyncio

import pytest
from monarch.actor import Actor, concurrent_endpoint, endpoint, this_host

from actors.endpoints import reply_droppable, serial
from actors.replay_buffer import ReplayBufferActor
from pipeline.config import BufferConfig, Config

pytestmark = pytest.mark.slow


class Serial(Actor):
    def __init__(self):
        self.log: list[tuple[str, str]] = []

    @serial
    async def work(self, tag: str, seconds: float) -> str:
        self.log.append(("in", tag))
        await asyncio.sleep(seconds)
        self.log.append(("out", tag))
        return tag

    @concurrent_endpoint
    async def probe(self) -> list:
        return list(self.log)


class Droppy(Actor):
    @reply_droppable
    async def plus_one(self, x: int) -> int:
        if x < 0:
            raise ValueError(f"negative: {x}")
        return x + 1


class Lessee(Actor):
    """A generator's part: holds a long buffer.admit call, as a generator's admission loop does."""

    @endpoint
    async def hold_admit(self, buf, wait_s: float) -> None:
        self.call = asyncio.ensure_future(buf.admit.call_one(wait_s, (0, 0)))


@pytest.fixture(scope="module")
def procs():
    a = this_host().spawn_procs(per_host={"procs": 1})
    b = this_host().spawn_procs(per_host={"procs": 1})
    yield a, b
    a.stop().get()
    b.stop().get()


def test_serial_endpoints_run_in_order_one_at_a_time_while_a_probe_answers(procs):
    actor = procs[0].spawn("serial", Serial)

    async def go():
        calls = [asyncio.ensure_future(actor.work.call_one(t, 0.6)) for t in "abc"]
        await asyncio.sleep(0.3)
        seen = await asyncio.wait_for(actor.probe.call_one(), 5)  # while "a" runs, "b" and "c" queued
        return seen, await asyncio.gather(*calls), await actor.probe.call_one()

    seen, results, log = asyncio.run(go())
    assert seen == [("in", "a")]
    assert results == ["a", "b", "c"]
    assert log == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b"), ("in", "c"), ("out", "c")]


def test_reply_droppable_answers_and_forwards_the_callers_error(procs):
    actor = procs[0].spawn("droppy", Droppy)
    assert actor.plus_one.call_one(1).get() == 2
    with pytest.raises(Exception, match="negative: -1"):
        actor.plus_one.call_one(-1).get()
    assert actor.plus_one.call_one(x=5).get() == 6  # still serving after the error


def test_buffer_survives_a_reply_to_a_stopped_lessee(procs):
    """A supervisor's graceful restart stops a generator actor while its admit waits in the buffer;
    the buffer's reply then has nobody to go to. Monarch 0.7 failed the buffer for it (the run ended:
    'a trainer or buffer mesh failed'); now the reply is dropped and the buffer goes on serving."""
    cfg = Config(buffer=BufferConfig(group_size=2, batch_groups=1, delta=0, delta_max=0, overcommit="none"))
    buf = procs[0].spawn("buf_bounce", ReplayBufferActor, cfg, 0)
    lessee = procs[1].spawn("lessee", Lessee)

    async def go():
        assert (await buf.admit.call_one(0.0, (1, 0))) is not None  # the only admission slot: admit now waits
        await lessee.hold_admit.call_one(buf, 1.5)
        await asyncio.sleep(0.3)
        await lessee.stop()
        await asyncio.sleep(2.5)  # the admit's wait ends and its reply (None) goes to the stopped actor
        return await asyncio.wait_for(buf.stats.call_one(), 10)

    stats = asyncio.run(go())
    assert stats["in_flight_groups"] == 1, stats
