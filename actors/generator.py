"""GeneratorActor: one vLLM AsyncLLM engine in a Monarch actor, fed by the replay buffer.

Protocol (the controller drives it; `buf` is the ReplayBufferActor mesh):

    gens = procs.spawn("gen", GeneratorActor, cfg, generator_id)   # one actor per engine
    await gens.setup.call()                                        # start the engine (start_timeout_s)
    await gens.attach_weights.call(handle)                         # builds (or replaces) the WeightReceiver
    await gens.start_generation.call(buf)                          # N' requests in flight from buf.admit()
    await gens.stage_weights.call(v)                               # transport -> staging; generation goes on
    await gens.apply_weights.call(v)                               # on_update strategy around the vLLM load
    await gens.end_stage.call()                                    # carry_over: keep running | save partials
    texts = await gens.generate_eval.call_one(prompts, 32)         # greedy, for held-out eval
    await gens.stats.call_one()                                    # version, in-flight, tokens/s, pauses...
    await gens.shutdown.call()                                     # engine.shutdown(): no child left

Finished rollouts (with reward from the task plug-in) go to `buf.add` one at a time; a request
with bad input is counted in stats()["failed"] and its group is handed back with `buf.release`.
The order of stage/apply across generators (rolling, collective) is pipeline.weightsync.sync.WeightSync's.
The logic lives in pipeline/rollout_engine.py; this file only adapts it to Monarch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from monarch.actor import Actor, concurrent_endpoint, endpoint

from pipeline.config import Config
from pipeline.rollout_engine import RolloutEngine
from pipeline.types import PromptGroup, Rollout

__all__ = ["GeneratorActor", "MeshSource"]


class MeshSource:
    """The WorkSource protocol over a buffer actor mesh (anything with admit/add/release endpoints)."""

    def __init__(self, mesh, generator_id: int):
        self.mesh, self.generator_id = mesh, generator_id

    async def admit(self, wait_s: float) -> PromptGroup | None:
        return await self.mesh.admit.call_one(wait_s, self.generator_id)

    async def add(self, rollout: Rollout) -> None:
        await self.mesh.add.call_one(rollout)

    async def release(self, group_id: int) -> bool:
        return await self.mesh.release.call_one(group_id)


class GeneratorActor(Actor):
    def __init__(self, cfg: Config, generator_id: int):
        self.cfg = cfg
        self.core = RolloutEngine(cfg, generator_id)
        self.receiver = None

    @endpoint
    async def setup(self) -> dict:
        """Start the vLLM engine on model_dir(cfg.model); it serves version 0."""
        from pipeline.weightsync import vllm_engine_kwargs

        return await self.core.start_engine(vllm_engine_kwargs())

    @endpoint
    async def start_generation(self, buffer) -> None:
        """Begin a stage: keep generator.concurrency requests in flight, carried-over partials first."""
        self.core.begin_stage(MeshSource(buffer, self.core.gid))

    @endpoint
    async def end_stage(self, carry_over: str | None = None, resume_on_update: bool = False) -> dict:
        """Stop admitting; per carry_over (default generator.carry_over), let in-flight requests
        finish (keep) or save them as partials resumed first next stage (save). With
        resume_on_update the next stage starts by itself once the next weight version is loaded."""
        return await self.core.end_stage(self.cfg.generator.request_timeout_s, carry_over, resume_on_update)

    @endpoint
    async def attach_weights(self, handle) -> None:
        """Build the WeightReceiver for a sender's handle; a later call replaces it (new transport)."""
        from pipeline.weightsync import WeightReceiver

        self.core.check()
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver(handle, self.core.gid)
        self.receiver.loaded_version = self.core.version

    @concurrent_endpoint
    async def stage_weights(self, version: int) -> float:
        """Bring `version` into this generator's staging through the transport; generation goes on
        meanwhile (a concurrent endpoint, so stats keep answering during a long transfer). Seconds."""
        self.core.check()
        if self.receiver is None:
            raise RuntimeError(f"generator {self.core.gid}: stage_weights before attach_weights")
        await self.receiver.pull(version)
        return self.receiver.last_timing["pull_s"]

    @endpoint
    async def apply_weights(self, version: int, on_update: str | None = None) -> int:
        """Load the staged `version` into vLLM under the on_update strategy; returns the served version."""
        from pipeline.weightsync import load_into_vllm

        self.core.check()
        if self.receiver is None:
            raise RuntimeError(f"generator {self.core.gid}: apply_weights before attach_weights")
        timeout_s = self.cfg.weight_sync.timeout_s
        return await self.core.update(
            version, lambda: load_into_vllm(self.core.engine, self.receiver, version, timeout_s), on_update)

    @endpoint
    async def load_checkpoint(self, hf_dir: str, version: int, on_update: str | None = None) -> int:
        """Serve the weights of an HF checkpoint directory as `version`, through the same staging and
        vLLM load path as a trainer push (a same-host shm sender of its own), under the strategy."""
        from pipeline.model import load_hf_state_dict
        from pipeline.weightsync import WeightReceiver, WeightSender, load_into_vllm

        self.core.check()
        sd = load_hf_state_dict(Path(hf_dir))
        ws = dataclasses.replace(self.cfg.weight_sync, transport="shm")
        sender = WeightSender(ws, sd, num_receivers=1)
        receiver = WeightReceiver(sender.handle(), 0)
        try:
            await asyncio.gather(sender.push(sd, version), receiver.pull(version))
            return await self.core.update(
                version, lambda: load_into_vllm(self.core.engine, receiver, version, ws.timeout_s), on_update)
        finally:
            receiver.close()
            sender.close()

    @endpoint
    async def version(self) -> int:
        self.core.check()
        return self.core.version

    @endpoint
    async def stats(self) -> dict:
        """version, in_flight, tokens, tokens_per_s, reprefill_tokens, pause_s (per update), failed by reason."""
        return self.core.snapshot()

    @endpoint
    async def generate_eval(self, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
                            seed: int = 0) -> list[str]:
        return await self.core.generate_eval(prompts, max_new_tokens, temperature, seed)

    @endpoint
    async def shutdown(self) -> None:
        await self.core.close()
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

