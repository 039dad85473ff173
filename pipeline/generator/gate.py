"""UpdateGate: a weight update of a running generator, under one of three strategies (generator.on_update).

Ordering contract of `update(v, load, mode)`:
- keep:  pause(keep, caches kept) -> load -> label v -> resume. Frozen requests continue; their
         later tokens carry v. Prefix caching is off in this mode (engine_args), since cached blocks
         of the old weights would otherwise be reused by new requests.
- abort: close the gate -> pause(abort) -> load -> label v -> resume -> open the gate. Each aborted
         trajectory resubmits prompt + its tokens so far (re-prefill counted).
- drain: close the gate -> pause(wait) (in-flight finish on the old weights) -> load -> label v ->
         resume -> open the gate. Every trajectory has one version.
With trainer.lora, a request that reached the engine during the update carries the old adapter and
would run after resume under v's label: every training request still in the engine is aborted
before resume and sent again.
`load()` both loads v and labels the engine's later steps with it (load_into_vllm's finish does; with
generator.shadow_weights it is weightsync.swap_into_vllm: v was loaded into the worker's second copy
while generating, at stage time, and only the swap and the label happen under the pause);
the keep pause skips AsyncLLM's 20 ms courtesy sleep (weightsync.load.pause_keep), which would
otherwise lengthen every update's stall. A failed update trips the generator's Fault and leaves the
engine paused and the gate closed: every later call raises.

Resubmission. `epoch` counts update boundaries as a seqlock counts writes: it is incremented when an
update begins and again when it ends, so it is odd while one runs. A segment takes the epoch when it
passes the gate (`enter`); when its request comes back aborted, `resend(epoch)` is true iff an update
began since, or is running now: such an abort is the update's (its pause, or its late LoRA abort)
and the trajectory is submitted again on the new weights. Any other abort is a stage end's save, or
unexplained.

Who waits for whom: submissions wait at a closed gate (bounded by generator.request_timeout_s per
closing); the update waits for the engine's pause (drain: for in-flight requests, bounded the same
way) and for `load` (its own bound, weight_sync.timeout_s). At most one update runs at a time (the
actor's endpoint is serial).

Example:
    gate = UpdateGate(engine, cfg.generator, fault)
    epoch = await gate.enter("g3-s0")                   # before each segment is submitted
    finish = ...                                        # the segment's request
    if finish == "abort" and gate.resend(epoch): ...    # submit prompt + tokens so far again
    paused_s = await gate.update(v, lambda: load_into_vllm(engine.llm, receiver, v, timeout_s), "abort")
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Awaitable, Callable

from pipeline.config import GeneratorConfig
from pipeline.generator.engine import Engine, Fault
from pipeline.weightsync.load import pause_keep

__all__ = ["UpdateGate", "Keep", "Abort", "Drain", "STRATEGIES"]


class Keep:
    """Freeze requests in place (KV caches kept); they go on after resume under the new version."""

    name, closes_gate = "keep", False

    async def pause(self, engine: Engine, g: GeneratorConfig) -> None:
        await engine.control(pause_keep(engine.llm), "pause")


class Abort:
    """Abort every request (each returns what it sampled); trajectories resubmit on the new weights."""

    name, closes_gate = "abort", True

    async def pause(self, engine: Engine, g: GeneratorConfig) -> None:
        await engine.control(engine.llm.pause_generation(mode="abort", clear_cache=True), "pause")


class Drain:
    """Let in-flight requests finish on the old weights, then pause."""

    name, closes_gate = "drain", True

    async def pause(self, engine: Engine, g: GeneratorConfig) -> None:
        await engine.control(engine.llm.pause_generation(mode="wait", clear_cache=True), "drain",
                             g.request_timeout_s, "generator.request_timeout_s")


STRATEGIES = {s.name: s for s in (Keep(), Abort(), Drain())}


class UpdateGate:
    """See the module docstring. `version` is the served version."""

    def __init__(self, engine: Engine, g: GeneratorConfig, fault: Fault):
        self.engine, self.g, self.fault = engine, g, fault
        self.version = 0
        self.epoch = 0  # odd while an update runs
        self._open = asyncio.Event()
        self._open.set()

    async def enter(self, what: str) -> int:
        """Wait until no update holds the gate closed; the epoch to hand to `resend` later."""
        while not self._open.is_set():  # opened, then closed by the next update before we woke: wait again
            try:
                await asyncio.wait_for(self._open.wait(), self.g.request_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{what}: weight update kept requests waiting over "
                                   f"{self.g.request_timeout_s:.0f}s") from None
        return self.epoch

    def resend(self, epoch: int) -> bool:
        """Whether a request that passed the gate at `epoch` and came back aborted was aborted by an
        update (one began since, or one is running), so it must be submitted again."""
        return self.epoch != epoch or self.epoch % 2 == 1

    def strategy(self, version: int, mode: str | None):
        """The strategy for an update to `version` (generator.on_update unless `mode`); ValueError if
        the update cannot be done on this engine."""
        if version <= self.version:
            raise ValueError(f"generator {self.fault.gid}: update to version {version}, already serving {self.version}")
        mode = mode or self.g.on_update
        if mode not in STRATEGIES:
            raise ValueError(f"update: on_update={mode!r}; allowed: 'keep', 'abort', 'drain'")
        if mode == "keep" and self.g.on_update != "keep":
            # The engine was built with prefix caching, whose old-weight blocks `keep` cannot clear.
            raise ValueError(f"update: on_update='keep' needs an engine built with generator.on_update='keep' "
                             f"(this one has {self.g.on_update!r})")
        return STRATEGIES[mode]

    async def update(self, version: int, load: Callable[[], Awaitable[None]], mode: str | None = None) -> float:
        """Apply the strategy around `load()`, which must load `version` and label the engine with
        it; returns the seconds generation was held. ValueError (nothing done) for an update this
        engine cannot do; any failure after that trips the Fault and raises."""
        strategy = self.strategy(version, mode)
        t0 = time.monotonic()
        self.epoch += 1
        if strategy.closes_gate:
            self._open.clear()
        try:
            await strategy.pause(self.engine, self.g)
            # the load has its own bound (weight_sync.timeout_s); a dead engine would leave it waiting for it
            await self.engine.control(load(), "weight load", math.inf, "weight_sync.timeout_s")
            if self.engine.lora_request is not None and self.engine.requests:
                await self.engine.abort_requests()  # they carry the old adapter: resent (`resend`)
            await self.engine.control(self.engine.llm.resume_generation(), "resume")
        except BaseException as e:
            self.fault.trip(RuntimeError(f"weight update to version {version} failed ({type(e).__name__}: {e}); "
                                         f"engine left paused, weights possibly mixed"))
            raise
        self.version = version
        self.epoch += 1
        self._open.set()
        return time.monotonic() - t0
