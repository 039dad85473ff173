"""Prompt sources for a generator proc in a measurement: stand-ins for the replay buffer that a
GeneratorActor admits from and sends rollouts to (tools.bench.gen_bench, the planner's calibration).
They live here, not in a tool, so that a proc spawned for them imports them by this module's name.

    src = procs.spawn("src", TimedSource, group_size, cfg)
    await src.feed.call_one(items)
    n, seconds, gaps = await wait_wave(src, len(items) * group_size, 120, "generator wave")
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from monarch.actor import Actor, concurrent_endpoint, endpoint

from pipeline.config import Config
from pipeline.placement import apply, buffer_placement
from pipeline.types import PromptGroup, PromptItem


class ListSource(Actor):
    """Admits groups from a list of prompts and counts rollouts (a minimal stand-in for the buffer).
    Its admit waits for work the way the replay buffer's does (an event, up to wait_s), so an idle
    generator does not poll: polling would load the generator's core and slow the decoding measured."""

    def __init__(self, group_size: int):
        self.items: deque[PromptItem] = deque()
        self.group_size, self.next_id, self.count, self.tokens = group_size, 0, 0, 0
        self.has_work = asyncio.Event()

    @endpoint
    async def feed(self, items: list[PromptItem]) -> None:
        self.items.extend(items)
        self.count = self.tokens = 0
        self.has_work.set()

    async def next_item(self, wait_s: float) -> PromptItem | None:
        """The next prompt, waiting up to wait_s for a feed; None if none came."""
        if not self.items:
            self.has_work.clear()
            try:
                await asyncio.wait_for(self.has_work.wait(), wait_s)
            except asyncio.TimeoutError:
                return None
        return self.items.popleft() if self.items else None

    @concurrent_endpoint
    async def admit(self, wait_s: float, lessee=None) -> PromptGroup | None:
        item = await self.next_item(wait_s)
        if item is None:
            return None
        self.admitted()
        self.next_id += 1
        return PromptGroup(self.next_id, item, self.group_size, admitted_version=0)

    @endpoint
    async def add(self, rollout, lessee=None) -> None:
        self.count += 1
        self.tokens += len(rollout.completion_tokens)
        self.added()

    def admitted(self) -> None:
        """Called as a group is admitted (a subclass times it)."""

    def added(self) -> None:
        """Called as a rollout arrives (a subclass times it)."""

    @endpoint
    async def release(self, group_id: int, lessee=None) -> bool:
        return True

    @endpoint
    async def progress(self) -> tuple[int, int]:
        return self.count, self.tokens


class TimedSource(ListSource):
    """ListSource that also times a wave: from its first admit to its last rollout. Pinned to `cpus`
    (the generator's cores, where a run places the replay buffer: buffer.cpus), so the messages it
    answers load the generator's cores as the buffer's do in a run."""

    def __init__(self, group_size: int, cfg: Config | None = None):
        super().__init__(group_size)
        if cfg is not None:
            apply(buffer_placement(cfg))

    @endpoint
    async def feed(self, items: list[PromptItem]) -> None:
        self.items.extend(items)
        self.count = self.tokens = 0
        self.t_first = self.t_last = None
        self.admits: list[float] = []
        self.has_work.set()

    def admitted(self) -> None:
        self.admits.append(time.monotonic())
        if self.t_first is None:
            self.t_first = time.monotonic()

    def added(self) -> None:
        self.t_last = time.monotonic()

    @endpoint
    async def wave(self) -> tuple[int, float, list[float]]:
        """(rollouts received, first admit to last rollout, gaps between consecutive admits)."""
        gaps = [b - a for a, b in zip(self.admits, self.admits[1:])]
        return self.count, (self.t_last - self.t_first) if self.t_last and self.t_first else float("nan"), gaps


async def wait_wave(src, n: int, timeout_s: float, what: str) -> tuple[int, float, list[float]]:
    """Poll a TimedSource until `n` rollouts of the wave it was fed have arrived; its wave()."""
    deadline = time.monotonic() + timeout_s
    while (c := await src.wave.call_one())[0] < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {c[0]} of {n} rollouts after {timeout_s:.0f} s")
        await asyncio.sleep(0.01)
    return c
