"""GeneratorActor: one vLLM AsyncLLM engine in a Monarch actor, fed by the replay buffer.

Protocol (the controller drives it; `buf` is the ReplayBufferActor mesh):

    gens = procs.spawn("gen", GeneratorActor, cfg, generator_id)   # one actor per engine
    await gens.setup.call()                                        # placement, then the engine (start_timeout_s)
    await gens.attach_weights.call(handle)                         # builds (or replaces) the WeightReceiver
    await gens.attach_reward_model.call(rm)                        # with reward_model.path: score with it
    await gens.start_generation.call(buf)                          # N' requests in flight from buf.admit()
    await gens.stage_weights.call(v)                               # transport -> staging (shadow_weights: and
                                                                   # into the shadow copy); generation goes on
    await gens.apply_weights.call(v)                               # on_update strategy around the vLLM load
                                                                   # (shadow_weights: around the swap)
    sums = await gens.served_checksums.call_one()                  # weight_sync.verify: what the engine serves
    await gens.end_stage.call()                                    # carry_over: keep running | save partials
    texts = await gens.generate_eval.call_one(prompts, 32)         # greedy, for held-out eval
    await gens.stats.call_one()                                    # version, in-flight, tokens/s, pauses...
    await gens.shutdown.call()                                     # engine.shutdown(): no child left
    why = await gens.watch.call_one()                              # long-held: returns once it breaks

Finished rollouts (with reward from the task plug-in) go to `buf.add` one at a time; a request
with bad input is counted in stats()["failed"] and its group is handed back with `buf.release`.
The order of stage/apply across generators (rolling, collective) is pipeline.weightsync.sync.WeightSync's.
The control endpoints (setup ... generate_eval) are serial (actors/endpoints.py): one at a time, in
arrival order, while stats, watch, stage_weights, attach_reward_model and shutdown answer beside them.
The logic lives in pipeline/generator/ (GeneratorCore, whose docstring holds the state machine);
this file only adapts it to Monarch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os

from monarch.actor import concurrent_endpoint

from actors.base import PipelineActor
from actors.endpoints import serial
from pipeline.config import Config
from pipeline.generator.core import GeneratorCore
from pipeline.placement import Placement, apply, generator_placements
from pipeline.procs import descendants, me
from pipeline.types import PromptGroup, Rollout
from pipeline.weightsync import load_into_vllm, load_shadow, swap_into_vllm
from pipeline.weightsync.verify import corrupt_served, served_checksums

__all__ = ["GeneratorActor", "MeshSource", "stream_prefix"]


def stream_prefix(generator_id: int, incarnation: int) -> str:
    """The reward-model stream ids of one generator incarnation start with this."""
    return f"g{generator_id}r{incarnation}/"


class MeshSource:
    """The WorkSource protocol over a buffer actor mesh (anything with admit/add/release endpoints).
    Every call is bounded by generator.call_timeout_s (admit: plus its own wait). A call is never
    abandoned midway when its caller is cancelled (shutdown): the buffer would be left replying to a
    port nobody holds, which Monarch counts as the buffer's failure. `drain` waits for them."""

    def __init__(self, mesh, lessee: tuple[int, int], timeout_s: float):
        self.mesh, self.lessee, self.timeout_s = mesh, lessee, timeout_s
        self.generator_id = lessee[0]
        self._outstanding: set[asyncio.Future] = set()

    async def _call(self, what: str, aw, extra_s: float = 0.0):
        call = asyncio.ensure_future(asyncio.wait_for(aw, self.timeout_s + extra_s))
        self._outstanding.add(call)
        call.add_done_callback(self._outstanding.discard)
        try:
            return await asyncio.shield(call)
        except asyncio.TimeoutError:
            raise TimeoutError(f"generator {self.generator_id}: buffer.{what} did not answer within "
                               f"{self.timeout_s + extra_s:.0f}s (generator.call_timeout_s)") from None

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for calls still on their way, e.g. after the callers were cancelled."""
        if self._outstanding:
            await asyncio.wait(set(self._outstanding), timeout=timeout_s)

    async def admit(self, wait_s: float) -> PromptGroup | None:
        return await self._call("admit", self.mesh.admit.call_one(wait_s, self.lessee), wait_s)

    async def add(self, rollout: Rollout) -> None:
        await self._call("add", self.mesh.add.call_one(rollout, self.lessee))

    async def release(self, group_id: int) -> bool:
        return await self._call("release", self.mesh.release.call_one(group_id, self.lessee))


class GeneratorActor(PipelineActor):
    def __init__(self, cfg: Config, generator_id: int, incarnation: int = 0):
        super().__init__(cfg.run.log_level)  # this proc, and (through VLLM_LOGGING_LEVEL) its engine's
        self.cfg = cfg
        self.incarnation = incarnation  # how many times generator `generator_id` was restarted before this one
        self.core = GeneratorCore(cfg, generator_id)
        self.receiver = None

    @serial
    async def setup(self, version: int = 0, placement: Placement | None = None) -> dict:
        """Place this proc (default: as the only generator on its host, pipeline/placement.py; the
        engine's processes inherit it), then start the vLLM engine on model_dir(cfg.model), serving
        those weights as `version` (a restarted generator starts on the trainer's latest export).
        Reports the placement, this proc's pid and its engine processes, so a supervisor can clean
        up after a hard kill."""
        from pipeline.weightsync import vllm_engine_kwargs

        lone = generator_placements(self.cfg, [0], 0)[0]
        placed = apply(placement or dataclasses.replace(lone, role=f"generator{self.core.gid}"))
        info = await self.core.start_engine(vllm_engine_kwargs(), version)
        placed["engine_core"] = info.pop("engine_core")  # its cores and threads, as the engine reports them
        return {**info, "placement": placed, "procs": [me(), *descendants(os.getpid())]}

    @serial
    async def start_generation(self, buffer) -> None:
        """Begin a stage: keep generator.concurrency requests in flight, carried-over partials first."""
        self.core.begin_stage(MeshSource(buffer, (self.core.gid, self.incarnation), self.cfg.generator.call_timeout_s))

    @serial
    async def end_stage(self, carry_over: str | None = None, resume_on_update: bool = False) -> dict:
        """Stop admitting; per carry_over (default generator.carry_over), let in-flight requests
        finish (keep) or save them as partials resumed first next stage (save). With
        resume_on_update the next stage starts by itself once the next weight version is loaded."""
        return await self.core.end_stage(self.cfg.generator.request_timeout_s, carry_over, resume_on_update)

    @serial
    async def attach_weights(self, handle, rank: int | None = None) -> None:
        """Build the WeightReceiver for a sender's handle as receiver `rank` (default: the generator
        id); a later call replaces it (a new transport or group)."""
        from pipeline.weightsync import WeightReceiver

        self.core.check()
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver(handle, self.core.gid if rank is None else rank)
        self.receiver.loaded_version = self.core.version

    @concurrent_endpoint  # only swaps a handle: must not queue behind a drain or an eval
    async def attach_reward_model(self, handle) -> None:
        """Score rollouts with the reward model behind `handle` (actors/reward_model.py); a later
        call, after the reward model's restart, replaces it. This generator's stream ids start
        with g<id>r<incarnation>/, which the controller releases when this generator dies."""
        self.core.attach_reward_model(handle, stream_prefix(self.core.gid, self.incarnation))

    @concurrent_endpoint
    async def attach_teacher(self, handle) -> None:
        """Take the teacher's per-token log-probs (actors/teacher.py) for every rollout; a later call,
        after the teacher's restart, replaces it. Stream ids as attach_reward_model's."""
        self.core.attach_teacher(handle, stream_prefix(self.core.gid, self.incarnation))

    @concurrent_endpoint
    async def stage_weights(self, version: int) -> dict[str, float]:
        """Bring `version` into this generator's staging through the transport; generation goes on
        meanwhile (a concurrent endpoint, so stats keep answering during a long transfer). Returns
        the receiver's `last_timing`: pull_s, bytes moved, full_bytes, delta_ranks (receiver.py)."""
        self.core.check()
        if self.receiver is None:
            raise RuntimeError(f"generator {self.core.gid}: stage_weights before attach_weights")
        await self.receiver.pull(version)
        if self._shadow:  # the engine's worker loads it into its second copy while generation goes on
            engine = self.core.engine
            self.receiver.last_timing["shadow_load_s"] = await engine.control(
                load_shadow(engine.llm, self.receiver, version, self.cfg.weight_sync.timeout_s), "shadow load",
                math.inf, "weight_sync.timeout_s")
        return dict(self.receiver.last_timing)

    @property
    def _shadow(self) -> bool:
        """Whether full-weight pushes go through the engine's shadow copy (generator.shadow_weights)."""
        return self.cfg.generator.shadow_weights and not self.cfg.trainer.lora.rank

    @serial
    async def apply_weights(self, version: int, on_update: str | None = None, corrupt_first: bool = False) -> int:
        """Load the staged `version` into vLLM under the on_update strategy; returns the served version.
        With shadow weights the load is the swap of the copy stage_weights loaded. `corrupt_first`
        (weight_sync.verify's start-up check): every served weight is corrupted first, inside the same
        pause, so no token is sampled from it and only the load can undo it; with shadow weights the
        corruption drops the copy too, and the copy is loaded again, under the pause, from a clone of
        the corrupted weights (pipeline/weightsync/worker.py), so the swap serves only what the push wrote."""
        self.core.check()
        if self.receiver is None:
            raise RuntimeError(f"generator {self.core.gid}: apply_weights before attach_weights")
        timeout_s = self.cfg.weight_sync.timeout_s
        if self.cfg.trainer.lora.rank:  # the push carries adapters: a new LoRA of the engine (pipeline/lora.py)
            return await self.core.update(
                version, lambda: self.core.load_lora(self.receiver, version, timeout_s), on_update)
        llm = self.core.engine.llm

        async def load() -> None:
            if corrupt_first:
                await corrupt_served(llm, timeout_s)
                if self._shadow:  # the copy staged before the corruption is gone: load a clone of the corrupted one
                    await load_shadow(llm, self.receiver, version, timeout_s)
            if self._shadow:  # staged into the copy already: the swap
                await swap_into_vllm(llm, self.receiver, version, timeout_s)
            else:
                await load_into_vllm(llm, self.receiver, version, timeout_s)

        return await self.core.update(version, load, on_update)

    @serial  # queued behind apply_weights, so it reads a finished load
    async def served_checksums(self) -> tuple[dict[str, str], dict[str, list[str]]]:
        """What the engine serves now: vLLM name -> checksum (wire form) and the HF names each fused
        parameter concatenates (pipeline/weightsync/served.py)."""
        self.core.check()
        t = self.cfg.weight_sync.timeout_s
        tensors, parts = await self.core.engine.control(served_checksums(self.core.engine.llm, t), "served checksums",
                                                        t, "weight_sync.timeout_s")
        return {k: v.to_wire() for k, v in tensors.items()}, parts

    @serial
    async def reload_weights(self, hf_dir: str) -> None:
        """Serve the HF export in `hf_dir` (the trainer's, this model's shape) in place, before any
        stage began, under the same version: the auto warm start's chunks (pipeline/driver/warm_start.py)."""
        await self.core.reload(hf_dir, self.cfg.weight_sync.timeout_s)

    @serial
    async def version(self) -> int:
        self.core.check()
        return self.core.version

    @concurrent_endpoint  # answers while an update is in progress: the supervisor's probe must not queue
    async def stats(self) -> dict:
        """version, in_flight, tokens, tokens_per_s, reprefill_tokens, pause_s (the last updates'), failed by reason."""
        return self.core.snapshot()

    @serial
    async def generate_eval(self, prompts: list, max_new_tokens: int, temperature: float = 0.0,
                            seed: int | list[int] = 0) -> list[str]:
        return await self.core.generate_eval(prompts, max_new_tokens, temperature, seed)

    @concurrent_endpoint  # not serial: it must not wait behind an eval or a stage end; it ends them
    async def shutdown(self) -> None:
        await self.core.close()
        if isinstance(self.core.source, MeshSource):
            await self.core.source.drain(self.cfg.generator.admit_wait_s + self.cfg.generator.call_timeout_s)
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    @concurrent_endpoint  # long-held: must not hold up (or queue behind) any other call
    async def watch(self) -> str:
        """Return the failure's text once this generator breaks (its engine core dies, a generation
        or admission loop fails, an update or a stage end fails; at once if it is broken already),
        so a supervisor learns of a failure without polling."""
        return await self.core.watch()
