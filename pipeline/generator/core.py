"""GeneratorCore: one generator (a vLLM engine fed by the replay buffer), wired from its roles.

    engine.py     Engine      the vLLM AsyncLLM: start, bounded control calls, LoRA adapters, stop
    scheduler.py  StageScheduler   N' slots of a stage, carried partials first
    episode.py    Episodes    one trajectory: segments, environment turns, reward, reject or release
    scoring.py    Scoring     Episodes' base: the reward, the reward model's score, the teacher's log-probs
    gate.py       UpdateGate  a weight update under keep / abort / drain; the epoch for resubmission
    engine.py     Fault       the broken state every role trips and every endpoint checks

State machine of a generator (each event is one call of this class; actors/generator.py maps its
endpoints onto them one to one):

    state                  event                             next state
    new                    start_engine                      idle
    idle, saved            begin_stage(source)               generating
    generating             end_stage(keep)                   idle
    generating             end_stage(save)                   saved
    generating             end_stage(.., resume_on_update)   parked (idle or saved, a stage asked for)
    idle, saved, generating  update(v)                       updating -> the same state
    parked                 update(v)                         updating -> generating (the asked-for stage)
    any                    a failure (Fault.trip)            broken
    any                    close                             closed

States:
    new         constructed, no engine: every call but stats, watch and close raises GeneratorBroken
    idle        no stage: nothing is admitted; requests of a stage ended with carry_over=keep run to
                their end and are sent
    generating  a stage: N' trajectories in flight from the stage's source (scheduler RUNNING)
    saved       a stage ended with carry_over=save: its trajectories are partials, resumed first by
                the next stage (scheduler SAVED)
    parked      a stage ended with resume_on_update: `update` begins the next one on the same source
                once the new weights serve, so partials resume on them (CoPRIS)
    updating    the gate holds: keep freezes requests in the engine, abort and drain close the gate to
                new segments; the stage, if any, goes on around it
    broken      the Fault was tripped (engine core died, admission or generation loop failed, an
                update or a stage end failed): calls raise; stats report it; watch returns its text
    closed      the engine is stopped: calls raise
Transitions are explicit: a stage begins only in begin_stage, or in update when parked (the stage
asked for at the last stage end); neither the scheduler nor the gate starts one.

Contract: stats (`snapshot`) and `watch` answer in every state and never wait for an update or a
stage end; updates are serial (the actor's endpoint is); `close` cancels the stage's work, then
stops the engine. Logic only: no Monarch here (actors/generator.py wraps it).

Example:
    core = GeneratorCore(cfg, generator_id=0)
    await core.start_engine(vllm_engine_kwargs())   # idle, serving version 0
    core.begin_stage(source)                        # generating: rollouts stream to source.add()
    await core.update(1, load)                      # updating (generator.on_update), then generating
    await core.end_stage(60, "save", resume_on_update=True)   # parked: partials held
    await core.update(2, load)                      # the stage begins again on version 2, partials first
    texts = await core.generate_eval(["rev abc="], 8)
    await core.close()
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from pipeline.config import Config
from pipeline.generator.engine import Engine, Fault, GeneratorBroken
from pipeline.generator.envs import env_scored
from pipeline.generator.episode import Episodes
from pipeline.generator.gate import UpdateGate
from pipeline.generator.rewards import RolloutStats
from pipeline.generator.scheduler import StageScheduler
from pipeline.generator.trajectory import RequestError, Trajectory, WorkSource, check_request
from pipeline.tasks import RewardRejected
from pipeline.types import Prompt, PromptGroup, PromptItem, Scored

__all__ = ["GeneratorCore"]


class GeneratorCore:
    """See the module docstring."""

    def __init__(self, cfg: Config, generator_id: int):
        self.cfg, self.g, self.gid = cfg, cfg.generator, generator_id
        self.fault = Fault(generator_id)
        self.stats = RolloutStats()
        self.engine = Engine(cfg, generator_id, self.fault)
        self.gate = UpdateGate(self.engine, cfg.generator, self.fault)
        self.episodes = Episodes(cfg, generator_id, self.engine, self.gate, self.stats, self.fault)
        self.scheduler = StageScheduler(cfg.generator, generator_id, self.engine, self.episodes, self.stats,
                                        self.fault)
        self._next_stage: WorkSource | None = None  # parked: the stage asked for at the last stage end

    @property
    def version(self) -> int:
        return self.gate.version

    @property
    def source(self) -> WorkSource | None:
        return self.scheduler.source

    def attach_reward_model(self, handle, prefix: str) -> None:
        """Score with the reward model behind `handle` (actors/reward_model.py); a later call (its
        restart) replaces the handle. `prefix` makes this generator's stream ids unique."""
        rm = self.episodes.rm
        if rm is None:
            raise RuntimeError(f"generator {self.gid}: attach_reward_model without reward_model.path")
        rm.prefix = prefix
        rm.set_handle(handle)

    def attach_teacher(self, handle, prefix: str) -> None:
        """Take per-token log-probs from the teacher behind `handle` (actors/teacher.py); a later call
        (its restart) replaces the handle."""
        t = self.episodes.teacher
        if t is None:
            raise RuntimeError(f"generator {self.gid}: attach_teacher without teacher.hf_dir")
        t.prefix = prefix
        t.set_handle(handle)

    async def start_engine(self, extra_engine_kwargs: dict | None = None, version: int = 0) -> dict:
        """new -> idle: the engine on model_dir(cfg.model), serving those weights as `version`."""
        info = await self.engine.start(extra_engine_kwargs, version)
        self.gate.version = version
        return info

    async def load_lora(self, receiver, version: int, timeout_s: float) -> None:
        """The `load` of an update under trainer.lora (Engine.load_lora)."""
        await self.engine.load_lora(receiver, version, timeout_s)

    async def reload(self, hf_dir: str, timeout_s: float) -> None:
        """idle -> idle: the engine serves the HF export in `hf_dir` in place, under the same version
        (the warm start's weights before RL; Engine.reload). Refused while a stage runs."""
        self.check()
        if self.scheduler.running:
            raise RuntimeError(f"generator {self.gid}: reload while generating (end the stage first)")
        await self.engine.reload(hf_dir, self.version, timeout_s)

    def check(self) -> None:
        """Raise if the generator is broken, not started or closed (called by every endpoint)."""
        self.fault.check()
        if self.engine.llm is None:
            raise GeneratorBroken(f"generator {self.gid}: engine not started (call setup first) or shut down")

    def begin_stage(self, source: WorkSource) -> None:
        """idle | saved -> generating: N' requests in flight from `source`, carried partials first."""
        self.check()
        self._next_stage = None  # begun by hand (a skipped step): no update may begin it again
        self.scheduler.begin(source)

    async def end_stage(self, timeout_s: float, carry_over: str | None = None, resume_on_update: bool = False) -> dict:
        """generating -> idle (carry_over=keep: in-flight requests run on and are sent when done) or
        saved (save: they are cut into partials for the next stage). `carry_over` overrides
        generator.carry_over for this call. resume_on_update: parked, the next successful `update`
        begins the next stage on the same source (partials first). No stage running: nothing."""
        self.check()
        if not self.scheduler.running:
            return self.scheduler.counts()
        info = await self.scheduler.end(carry_over or self.g.carry_over, timeout_s)
        self.check()
        self._next_stage = self.scheduler.source if resume_on_update else None
        return info

    async def update(self, version: int, load: Callable[[], Awaitable[None]], on_update: str | None = None) -> int:
        """Apply the strategy (generator.on_update, or `on_update` for this call) around `load()`, which
        must load `version` and label the engine with it (UpdateGate); then, if parked, begin the
        stage asked for. Returns the served version or raises."""
        self.check()
        self.stats.paused(await self.gate.update(version, load, on_update))
        if self._next_stage is not None:
            self.begin_stage(self._next_stage)
        return version

    async def generate_eval(self, prompts: list[Prompt | PromptItem], max_new_tokens: int, temperature: float = 0.0,
                            seed: int | list[int] = 0) -> list[str | None]:
        """Completions for evaluation: greedy by default, else sampled at `temperature` with per-prompt
        seeds `seed + i`, or `seed[i]` given a list, one per prompt (reproducible for fixed weights). A prompt that is empty, too long, cannot be
        tokenised or is refused by the engine gets None, counted in stats()["eval_skipped"] by reason;
        bad sampling values raise RequestError at once, any other failure after the others finish.
        `prompts` are PromptItems (a multi-turn task's environment gets the item, as in training) or
        prompts (a str or messages). The episodes are training's (Episodes.play) with a turn of their own; a
        multi-turn task's run at most 2 N' at a time, with environment workers of their own, so
        evaluation never takes the training rollouts' workers."""
        from vllm import SamplingParams

        self.check()
        check_request(1, max_new_tokens, temperature, self.g.max_model_len)  # the sampling values
        if isinstance(seed, list) and len(seed) != len(prompts):
            raise RequestError("bad_seeds", f"generate_eval: {len(seed)} seeds for {len(prompts)} prompts")
        seeds = seed if isinstance(seed, list) else [seed + i for i in range(len(prompts))]
        eps, engine = self.episodes, self.engine
        items = [p if isinstance(p, PromptItem) else PromptItem(uid=i, prompt=p) for i, p in enumerate(prompts)]
        limit = asyncio.Semaphore(2 * self.g.concurrency if eps.task.env is not None else len(items) or 1)

        async def one(i: int, item: PromptItem) -> str:
            async with limit:
                traj = Trajectory(PromptGroup(-1, item, 1, self.version), 0, eps.prompt_tokens(item.prompt))
                try:
                    await eps.play(traj, lambda t: turn(i, t), eps.eval_env_calls)
                    text = eps.transcript(traj)  # as the reward reads a training rollout
                    if env_scored(traj.env):  # an environment that scored its episode (OpenEnv)
                        return Scored(text, await eps.env_reward(traj))
                    return text
                finally:
                    if traj.env is not None:
                        await eps.close_env(traj, eps.eval_env_calls)

        async def turn(i: int, t: Trajectory) -> str:  # a multi-turn task's eval runs its environment too
            room = eps.turn_room(t, max_new_tokens)
            if room < 1:
                return "length"
            sp = SamplingParams(max_tokens=room, temperature=temperature, stop_token_ids=list(engine.special.stop),
                                seed=seeds[i] + 7919 * t.turns if temperature > 0 else None)
            final = None
            try:
                async with asyncio.timeout(self.g.request_timeout_s):
                    async for out in engine.llm.generate({"prompt_token_ids": t.context()}, sp,
                                                         request_id=f"eval{self.gid}-{next(eps.seq)}-{i}",
                                                         **engine.lora_kw()):
                        final = out
            except ValueError as e:  # vLLM's input validation (VLLMValidationError is a ValueError)
                raise RequestError("rejected_by_engine", str(e)) from e
            ids = list(final.outputs[0].token_ids)
            t.extend(ids, [0.0] * len(ids), [self.version] * len(ids))
            return str(final.outputs[0].finish_reason)

        skip = (RequestError, RewardRejected)  # a bad prompt; an environment that failed on this prompt
        results = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)), return_exceptions=True)
        for r in results:
            if isinstance(r, skip):
                self.stats.eval_skipped[r.reason] += 1
        bad = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException) and not isinstance(r, skip)]
        if bad:
            raise RuntimeError("; ".join(f"eval prompt {i} ({str(items[i].prompt)[:40]!r}): {type(r).__name__}: {r}"
                                         for i, r in bad)) from bad[0][1]
        return [None if isinstance(r, skip) else r for r in results]

    def snapshot(self) -> dict:
        """The stats endpoint's answer (RolloutStats plus where every trajectory is); bounded in size."""
        llm = self.engine.llm
        if not self.fault.tripped and llm is not None and llm.errored:
            # the engine died without its core exiting (its output handler failed)
            self.fault.trip(RuntimeError(f"vLLM engine core is dead: {llm.dead_error}"))
        s = self.stats.snapshot()
        c = self.scheduler.counts()
        s.update(generator_id=self.gid, version=self.version, in_flight=c["running"], sending=self.episodes.sending,
                 in_engine=len(self.engine.requests), pending=c["pending"], carried=c["carried"],
                 admitting=self.scheduler.running, error=str(self.fault.error) if self.fault.tripped else None,
                 **self.engine.liveness(),
                 reward_model=self.episodes.rm.snapshot() if self.episodes.rm is not None else None,
                 teacher={**self.episodes.teacher.snapshot(), **self.episodes.teacher_counts}
                 if self.episodes.teacher is not None else None)
        return s

    async def watch(self) -> str:
        """Return the failure's text once this generator is broken (at once if it is already)."""
        return await self.fault.wait()

    async def close(self) -> None:
        """Cancel the stage's work, release the reward model's streams, stop the engine."""
        await self.scheduler.close()
        if self.episodes.rm is not None:
            await self.episodes.rm.close()
        await self.engine.stop()
