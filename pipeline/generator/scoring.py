"""Scoring a trajectory: the completion as the reward reads it, the task's reward (or its environment's),
the reward model's score, and the teacher's prompt and log-probs (on-policy distillation).

The reward is the task's reward() of the whole completion and/or the reward model's score of the whole
token sequence, computed off the event loop. Scoring is a base of Episodes (episode.py), which sets
the clients and the state it reads.
"""

from __future__ import annotations

import asyncio
import time

from pipeline.config import Config
from pipeline.generator.engine import Engine
from pipeline.generator.envs import env_scored
from pipeline.generator.reward_client import RewardModelClient
from pipeline.generator.rewards import RewardScorer
from pipeline.generator.trajectory import RequestError, Trajectory
from pipeline.tasks import RewardRejected, check_reward
from pipeline.tokens import encode_prompt

__all__ = ["Scoring"]


class Scoring:
    """What Episodes scores a trajectory with; it sets these attributes (Episodes.__init__)."""

    cfg: Config
    engine: Engine
    scorer: RewardScorer  # the task's reward(), on workers of its own
    rm: RewardModelClient | None  # the reward model's client (reward_model.path)
    teacher: RewardModelClient | None  # the teacher's client (teacher.hf_dir)
    teacher_counts: dict  # tokens, top1, wait_s, scored: the teacher's figures so far

    def teacher_tokens(self, item, ids: tuple[int, ...]) -> tuple[int, ...]:
        """The teacher's prompt: the student's, with teacher.context filled in from the item's columns
        (pipeline/teacher.py teacher_prompt); RequestError if a column is missing or it cannot be encoded."""
        from pipeline.teacher import teacher_prompt

        template = self.cfg.teacher.context
        if not template:
            return ids
        try:
            context = template.format(**item.fields())
        except (KeyError, IndexError, ValueError) as e:
            raise RequestError("teacher_context", f"teacher.context={template!r} cannot be filled from item "
                               f"{item.uid} (columns: {', '.join(item.fields())}): {type(e).__name__}: {e}") from e
        try:
            return tuple(encode_prompt(self.engine.tok, teacher_prompt(item.prompt, context),
                                       self.cfg.task.enable_thinking))
        except Exception as e:
            raise RequestError("prompt_not_tokenizable", f"the teacher's prompt: {type(e).__name__}: {e}") from e

    def transcript(self, traj: Trajectory) -> str:
        """The completion as text for the reward: model turns and observations, special tokens (the
        end of turn) and chat frames left out."""
        return self.engine.tok.decode(traj.transcript_tokens(), skip_special_tokens=True)

    async def reward(self, traj: Trajectory, completion: str) -> float:
        """The task's reward(); with a reward model, reward_model.weight * its score of the whole
        rollout + reward_model.task_weight * reward() (computed at once). RewardRejected if unusable."""
        rc = self.cfg.reward_model
        own = self.env_reward(traj) if env_scored(traj.env) else self.scorer.score(traj.group.item.prompt, completion)
        if not rc.path:
            return await own
        parts = [self.rm.finish(traj.key, traj.context())]
        if rc.task_weight:
            parts.append(own)
        else:
            own.close()
        res = await asyncio.gather(*parts, return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException):
                raise r
        return rc.weight * res[0] + (rc.task_weight * res[1] if rc.task_weight else 0.0)

    async def env_reward(self, traj: Trajectory) -> float:
        """The episode's reward as its environment scored it (an Env with reward(), envs.py), checked."""
        try:
            value = traj.env.reward()
        except RewardRejected:
            raise
        except Exception as e:
            raise RewardRejected("reward_raised", f"the environment's reward(): {type(e).__name__}: {e}") from e
        return check_reward(value)

    async def teacher_logprobs(self, traj: Trajectory, eos: float) -> tuple[float, ...]:
        """The teacher's log-prob of each completion token (0 on environment tokens), from its stream
        of teacher prompt + completion. RewardRejected (teacher_*) if it cannot give them."""
        from pipeline.types import ENV_VERSION

        r = await self.teacher.finish(traj.key, traj.teacher_context())
        lps, top1 = r["logprobs"], r["top1"]
        n, skip = len(traj.tokens), len(traj.teacher_prompt) - 1  # lps[i] is token i + 1's
        if len(lps) != skip + n:
            raise RewardRejected("teacher_failed", f"the teacher returned {len(lps)} log-probs for a sequence "
                                 f"of {skip + n + 1} tokens")
        own = [v != ENV_VERSION for v in traj.versions]
        out = tuple(lp if m else 0.0 for lp, m in zip(lps[skip:], own))
        c = self.teacher_counts
        c["tokens"] += sum(own)
        c["top1"] += sum(t for t, m in zip(top1[skip:], own) if m)
        c["wait_s"] += time.monotonic() - eos
        c["scored"] += 1
        return out
