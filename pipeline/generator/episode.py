"""Episodes: one trajectory's life, from an admitted group to the buffer (or back to it).

    admit -> [segment | environment turn]* -> slot freed -> reward -> add     (a rollout)
                                                         -> carried           (a stage end's save)
                                                         -> reject / release  (a fault of its own)

A model turn is one or more segments (vLLM requests): each passes the update gate first, and one
that an update aborted is submitted again with prompt + tokens so far (UpdateGate.resend). With an
environment (task.env, pipeline/generator/envs.py) turns alternate with observations until the
environment ends the episode or a limit is reached. The reward and the teacher's log-probs come
from Scoring (scoring.py).

Contract:
  * `generate` holds the trajectory's slot; `deliver` / `failed` run after the scheduler freed it, so
    the next request starts before this one's reward is computed.
  * Faults stay with their group: a bad request fails it (RolloutStats.fail); a reward or
    environment that cannot be used rejects the sample and gives the group back (reject); a group
    is released at the source once, and its other samples are dropped. Anything else (the engine,
    the source failing) trips the generator's Fault.
  * A trajectory whose stage ended with carry_over=save returns "saved" at its next gate passage
    (or when its request comes back aborted) and resumes its current turn in the next stage.
  * Every reward-model stream ends: `forget` releases whatever `deliver` did not finish.
  * Evaluation (GeneratorCore.generate_eval) plays the same episodes through `play`, with a turn
    function of its own (greedy or seeded sampling) and environment workers of its own.

Example:
    eps = Episodes(cfg, 0, engine, gate, stats, fault)
    trajs = eps.trajectories(group)                     # RequestError: fail_group(...) instead
    finish = await eps.generate(trajs[0], stage)        # stage: .source, .saving (the StageScheduler)
    await eps.deliver(trajs[0], finish, stage)          # reward, then stage.source.add(rollout)
    eps.forget(trajs[0])
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Awaitable, Callable, Protocol

from pipeline.config import Config
from pipeline.generator.engine import Engine, Fault
from pipeline.generator.gate import UpdateGate
from pipeline.generator.reward_client import RewardModelClient
from pipeline.generator.rewards import RewardScorer, RolloutStats
from pipeline.generator.scoring import Scoring
from pipeline.generator.trajectory import (RequestError, Trajectory, WorkSource, check_prompt, check_request,
                                           spans_to_versions)
from pipeline.generator.envs import env_scored, turn_rewards
from pipeline.tasks import RewardRejected, load_task
from pipeline.tokens import ObservationFrame, PromptError, encode_completion, encode_prompt, observation_frame
from pipeline.types import Prompt, PromptGroup

log = logging.getLogger(__name__)

__all__ = ["Episodes", "Stage", "SAVED"]

SAVED = "saved"  # the finish of a trajectory cut by a stage end with carry_over=save


class Stage(Protocol):
    """What an episode sees of the stage it runs in (StageScheduler)."""

    source: WorkSource

    @property
    def saving(self) -> bool: ...


class Episodes(Scoring):
    """See the module docstring. `task`, `cfg` and `rm` are read at each use."""

    def __init__(self, cfg: Config, generator_id: int, engine: Engine, gate: UpdateGate, stats: RolloutStats,
                 fault: Fault):
        self.cfg, self.g, self.gid = cfg, cfg.generator, generator_id
        self.engine, self.gate, self.stats, self.fault = engine, gate, stats, fault
        self.task = load_task(cfg.task.name, cfg.task)
        self.scorer = RewardScorer(self.task, cfg.task.reward_timeout_s, cfg.task.reward_workers)
        # environment calls get their own workers, two per rollout in flight (one more for a call
        # still running past its timeout): a hung tool does not starve rewards or other rollouts at once
        self.env_calls = RewardScorer(self.task, cfg.task.env_timeout_s, 2 * cfg.generator.concurrency)
        self.eval_env_calls = RewardScorer(self.task, cfg.task.env_timeout_s, 2 * cfg.generator.concurrency)
        rc = cfg.reward_model  # with a reward model: its client, unusable (scores wait) until attached
        self.rm = RewardModelClient(None, rc.chunk_tokens, rc.timeout_s, f"g{generator_id}/") if rc.path else None
        tc = cfg.teacher  # with a teacher (on-policy distillation): its client, attached like the reward model's
        self.teacher = RewardModelClient(None, tc.chunk_tokens, tc.timeout_s, f"g{generator_id}/",
                                         kind="teacher") if tc.hf_dir else None
        self.teacher_counts = {"tokens": 0, "top1": 0, "wait_s": 0.0, "scored": 0}
        self.sending = 0  # finished trajectories being rewarded / sent to the source
        self._dead: set[int] = set()  # groups given back to the source
        self.seq = itertools.count()  # request ids, unique in this engine

    # ---------------------------------------------------------------- admission

    def prompt_tokens(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's token ids (a str as it is, messages through the chat template); RequestError if
        it cannot be tokenised, is empty or leaves no room."""
        try:  # the warm start's and every other path's way too (pipeline.tokens)
            ids = tuple(encode_prompt(self.engine.tok, prompt, self.cfg.task.enable_thinking))
        except Exception as e:
            raise RequestError("prompt_not_tokenizable", f"{type(e).__name__}: {e}") from e
        check_prompt(len(ids), self.g.max_model_len)
        return ids

    def frame(self, prompt: Prompt) -> ObservationFrame:
        """What wraps an observation in a rollout of `prompt` (envs.py); RequestError if it cannot."""
        try:
            return observation_frame(self.engine.tok, prompt, self.cfg.task.enable_thinking)
        except PromptError as e:
            raise RequestError("prompt_not_tokenizable", str(e)) from e

    def trajectories(self, group: PromptGroup) -> list[Trajectory]:
        """The group's samples, ready to start; RequestError if its prompt cannot be served."""
        ids = self.prompt_tokens(group.item.prompt)
        tids = self.teacher_tokens(group.item, ids) if self.teacher is not None else ()
        return [Trajectory(group, i, ids, teacher_prompt=tids) for i in range(group.group_size)]

    def dead(self, group_id: int) -> bool:
        return group_id in self._dead

    # ---------------------------------------------------------------- generation (holds a slot)

    async def generate(self, traj: Trajectory, stage: Stage) -> str:
        """The trajectory's turns until its episode ends: the last finish reason, or SAVED."""
        return await self.play(traj, lambda t: self._segments(t, stage), self.env_calls)

    async def _segments(self, traj: Trajectory, stage: Stage) -> str:
        """One model turn: segments until it finishes; SAVED if a stage end carried it over."""
        while True:
            epoch = await self.gate.enter(traj.key)
            if stage.saving:
                return SAVED
            room = self.turn_room(traj, min(traj.group.item.max_new_tokens or self.g.max_new_tokens,
                                            self.g.max_new_tokens))
            if traj.tokens and room < 1:
                return "length"  # a resumed partial (or a later turn) that already fills its budget
            rid = f"gen{self.gid}-{traj.key}-{next(self.seq)}"
            finish = await self._segment(traj, rid, room)
            if finish != "abort":
                return finish
            if self.gate.resend(epoch):  # an update's abort: resend it on the new weights
                continue
            if stage.saving:
                return SAVED
            raise RuntimeError(f"{traj.key}: request {rid} was aborted by the engine for no known reason")

    def turn_room(self, traj: Trajectory, budget: int) -> int:
        """Tokens the current model turn may still add: its budget, the context, and for a multi-turn
        rollout task.max_total_tokens."""
        room = min(budget - len(traj.turn_tokens()), self.g.max_model_len - len(traj.context()))
        if self.task.env is not None:
            room = min(room, self.cfg.task.max_total_tokens - len(traj.tokens))
        return room

    async def play(self, traj: Trajectory, turn: Callable[[Trajectory], Awaitable[str]],
                   calls: RewardScorer) -> str:
        """Model turns (each `await turn(traj)`) and, for a task with an environment, observations
        between them, until the environment ends the episode or a limit is reached. Returns the last
        turn's finish reason, or SAVED (the trajectory resumes its current turn). RewardRejected
        (env_raised, env_timeout, env_bad_observation) if the environment fails."""
        if self.task.env is None:
            return await turn(traj)
        tc = self.cfg.task
        if traj.env is None:
            traj.env = await calls.call(self.task.env, traj.group.item, kind="env")
        while True:
            finish = await turn(traj)
            if finish == SAVED or self.dead(traj.group.group_id):
                return finish  # carried over; or a sibling gave the group back: no more turns for it
            traj.turns += 1
            # room after an observation of at least one token for one more model token
            left = min(tc.max_total_tokens - len(traj.tokens), self.g.max_model_len - len(traj.context()))
            text = self.engine.tok.decode(traj.turn_tokens(), skip_special_tokens=True)
            if traj.turns >= tc.max_turns or left < 2:
                if env_scored(traj.env):  # its reward needs the last turn too; what it shows next is dropped
                    await calls.call(traj.env.step, text, kind="env")
                return finish
            obs = await calls.call(traj.env.step, text, kind="env")
            if obs is None:
                return finish
            if not isinstance(obs, str):
                raise RewardRejected("env_bad_observation", f"step returned {type(obs).__name__}, "
                                                            "not a str (an observation) or None (the end)")
            frame = self.frame(traj.group.item.prompt)
            head = frame.head_after(traj.tokens[-1] if traj.tokens else None)
            ids = encode_completion(self.engine.tok, obs)
            room = min(tc.max_obs_tokens, left - 1 - len(head) - len(frame.tail))  # a token for the next turn
            if room < 0:
                return finish  # a chat observation's frame alone does not fit: the episode ends here
            if len(ids) > room:
                ids = ids[:room]
                self.stats.obs_truncated += 1
            traj.extend_env([*head, *ids, *frame.tail], (len(head), len(frame.tail)))

    async def _segment(self, traj: Trajectory, rid: str, max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        check_request(len(traj.prompt_tokens), max_tokens, self.g.temperature, self.g.max_model_len)
        before = traj.reprefill_tokens
        traj.begin_segment()
        self.stats.reprefill_tokens += traj.reprefill_tokens - before
        # FINAL_ONLY: tokens, logprobs and engine-side version spans arrive once, with no per-token
        # Python work in this process; an aborted request still returns everything it sampled.
        # With a streaming reward model the tokens arrive as they are sampled (DELTA) and go on to it
        # in chunks (reward_client.py); the version spans still come with the final output.
        rm, teacher = self.rm, self.teacher
        rm_stream = rm is not None and rm.chunk > 0
        t_stream = teacher is not None and teacher.chunk > 0
        stream = rm_stream or t_stream
        sp = SamplingParams(max_tokens=max_tokens, temperature=self.g.temperature, logprobs=0,
                            ignore_eos=self.g.ignore_eos, stop_token_ids=self.engine.stop_ids(),
                            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        requests = self.engine.requests
        requests[traj.key] = rid
        final = None
        ids: list[int] = []
        lps: list[float] = []
        context = traj.context()
        t_context = traj.teacher_context() if t_stream else []
        try:
            async with asyncio.timeout(self.g.request_timeout_s):
                async for out in self.engine.llm.generate({"prompt_token_ids": context}, sp, request_id=rid,
                                                          **self.engine.lora_kw()):
                    final = out
                    if stream:
                        c = out.outputs[0]
                        ids += c.token_ids
                        lps += [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
                        if rm_stream:
                            rm.feed(traj.key, context, ids)
                        if t_stream:
                            teacher.feed(traj.key, t_context, ids, len(traj.teacher_prompt))
        except TimeoutError:
            raise TimeoutError(f"{traj.key}: request {rid} took over {self.g.request_timeout_s:.0f}s "
                               "(generator.request_timeout_s)") from None
        except ValueError as e:  # vLLM's input validation (VLLMValidationError is a ValueError)
            raise RequestError("rejected_by_engine", f"{traj.key}: {e}") from e
        finally:  # out of the engine (a multi-turn rollout may now wait for its environment)
            if requests.get(traj.key) == rid:
                del requests[traj.key]
        if final is None or not final.finished:
            raise RuntimeError(f"{traj.key}: request {rid} ended without a final output")
        c = final.outputs[0]
        if not stream:
            ids = list(c.token_ids)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)] if ids else []
        versions = spans_to_versions(c.weight_versions, len(ids))
        traj.extend(ids, lps, versions)
        self.stats.tokens += len(ids)
        if self.stats.first_token_version is None and len(versions):  # a joining generator's proof of its label
            self.stats.first_token_version = int(versions[0])
        return str(c.finish_reason)

    # ---------------------------------------------------------------- the end (the slot is free)

    async def deliver(self, traj: Trajectory, finish: str, stage: Stage) -> None:
        """Reward a finished trajectory (off the event loop, bounded by task.reward_timeout_s, and/or
        by the reward model) and send it. A reward that cannot be used rejects the sample."""
        gid = traj.group.group_id
        if self.dead(gid):
            return  # a sibling failed and the group was released at the buffer
        self.sending += 1
        try:
            completion = self.transcript(traj)
            eos = time.monotonic()
            try:
                parts = [self.reward(traj, completion)]
                if self.teacher is not None:
                    parts.append(self.teacher_logprobs(traj, eos))
                res = await asyncio.gather(*parts, return_exceptions=True)
                for r in res:
                    if isinstance(r, BaseException):
                        raise r
                reward = res[0]
                self.stats.reward_latency_s.append(time.monotonic() - eos)
            except RewardRejected as e:
                await self._reject(traj, completion, e, stage)
                return
            if self.dead(gid):
                return  # a sibling was rejected while this one was scored
            rollout = traj.to_rollout(completion, finish, reward, self.gid,
                                      teacher_logprobs=res[1] if self.teacher is not None else None,
                                      turn_rewards=turn_rewards(traj.env))
            self.stats.rollouts += 1
            self.stats.turns += traj.turns
            self.stats.accept()
            await stage.source.add(rollout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.fault.trip(RuntimeError(f"{traj.key}: sending the rollout failed: {type(e).__name__}: {e}"))
        finally:
            self.sending -= 1

    async def failed(self, traj: Trajectory, err: Exception, stage: Stage) -> None:
        """A generation that raised: a bad request fails its group, an environment's failure rejects
        the sample (unless a sibling already gave the group back), anything else breaks the generator."""
        gid = traj.group.group_id
        if isinstance(err, RequestError):
            await self.fail_group(gid, err, f"group {gid} sample {traj.sample_idx}", stage)
        elif isinstance(err, RewardRejected):
            if not self.dead(gid):
                await self._reject(traj, self.transcript(traj), err, stage)
        else:
            self.fault.trip(RuntimeError(f"{traj.key}: generation failed: {type(err).__name__}: {err}"))

    async def close_env(self, traj: Trajectory, calls: RewardScorer | None = None) -> None:
        """End a finished episode's environment (its close(), on a worker thread, bounded by
        task.env_timeout_s; a failure is logged, never the rollout's). Not for a carried-over one."""
        env, traj.env = traj.env, None
        if env is None or not callable(getattr(env, "close", None)):
            return
        try:
            await (calls or self.env_calls).call(env.close, kind="env")
        except Exception as e:
            log.warning("generator %d: closing the environment of %s failed: %s", self.gid, traj.key, e)

    async def fail_group(self, group_id: int, err: RequestError, where: str, stage: Stage) -> None:
        """Count a bad request and give its group back to the buffer; the engine keeps serving."""
        self.stats.fail(err.reason, f"{where}: {err}")
        await self._release_group(group_id, stage)

    async def _reject(self, traj: Trajectory, completion: str, err: RewardRejected, stage: Stage) -> None:
        """Count a sample whose reward cannot be used (the first few logged in full) and give its
        group back: a group missing a sample has no unbiased baseline, so it is dropped whole."""
        gid = traj.group.group_id
        if self.stats.reject(err.reason, f"group {gid} sample {traj.sample_idx}: {err}"):
            log.warning("generator %d: sample rejected, group %d given back (%s); prompt=%r completion=%r",
                        self.gid, gid, err, traj.group.item.prompt, completion)
        await self._release_group(gid, stage)

    async def _release_group(self, gid: int, stage: Stage) -> None:
        """Give group `gid` back to the buffer (dropped as failed), once; later siblings are ignored."""
        if gid in self._dead:
            return
        self._dead.add(gid)
        try:
            await stage.source.release(gid)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.fault.trip(RuntimeError(f"releasing failed group {gid} at the buffer failed: {e}"))

    def forget(self, traj: Trajectory) -> None:
        """Free the reward model's and the teacher's streams of a trajectory that ended here (scored,
        carried, rejected)."""
        if self.rm is not None:
            self.rm.release(traj.key)
        if self.teacher is not None:
            self.teacher.release(traj.key)
