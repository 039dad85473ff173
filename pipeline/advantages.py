"""Rewards into advantages: GRPO's group baseline and DAPO's overlong shaping of the rewards that go into it.

ReplayBufferCore (pipeline/buffer.py) applies them when a group finishes: each sample's task reward plus
its `rollout_shaping` penalty, then `group_advantages` over the group (a group whose rewards stay equal
gets advantage 0). `overlong_shaping` builds the buffer's `Overlong` budgets from a whole Config.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from pipeline.types import ENV_VERSION, Rollout

__all__ = ["group_advantages", "overlong_penalty", "Overlong", "overlong_shaping", "model_turns", "rollout_shaping"]

_STD_EPS = 1e-6


def group_advantages(rewards: list[float], normalize_std: bool) -> list[float]:
    """GRPO: reward minus the group mean, optionally over the (unbiased) group std."""
    mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if normalize_std and len(rewards) > 1:
        std = math.sqrt(sum(a * a for a in adv) / (len(rewards) - 1))
        adv = [a / (std + _STD_EPS) for a in adv]
    return adv


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, added to a response's reward: 0 up to budget − buffer tokens,
    then falling linearly to −penalty at the budget (and −penalty beyond it); 0 when buffer is 0."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -penalty if length > budget else penalty * ((budget - buffer) - length) / buffer


class Overlong(NamedTuple):
    """The length budgets a rollout is cut by, for DAPO's overlong shaping and Dr. GRPO's constant
    normaliser (`overlong_shaping` builds it from a Config)."""

    turn: int
    """A model turn's budget: generator.max_new_tokens (a prompt's own max_new_tokens when smaller)."""
    buffer: int
    """trainer.overlong_buffer: the penalty ramps over a budget's last this-many tokens (0: no shaping)."""
    penalty: float
    """trainer.overlong_penalty: the penalty at the end of a budget."""
    total: int = 0
    """Multi-turn: task.max_total_tokens, the episode's budget of completion tokens (model and
    environment together); 0: single-turn."""


def overlong_shaping(cfg, multi_turn: bool = False) -> Overlong:
    """ReplayBufferCore's `overlong` from a whole Config (generator.max_new_tokens, trainer.overlong_*,
    and task.max_total_tokens when the task has an environment: `multi_turn`)."""
    return Overlong(cfg.generator.max_new_tokens, cfg.trainer.overlong_buffer, cfg.trainer.overlong_penalty,
                    cfg.task.max_total_tokens if multi_turn else 0)


def model_turns(r: Rollout) -> list[int]:
    """Lengths of a rollout's model turns: its runs of model tokens between environment tokens (a
    single-turn rollout: one, its whole completion)."""
    runs, n = [], 0
    for v in r.versions:
        if v == ENV_VERSION:
            if n:
                runs.append(n)
            n = 0
        else:
            n += 1
    return runs + [n] if n or not runs else runs


def rollout_shaping(r: Rollout, turn_budget: int, o: Overlong) -> float:
    """DAPO's overlong penalty of one rollout against the budgets that cut it: each model turn against
    its turn budget and, for a multi-turn rollout, all its completion tokens (model and environment)
    against task.max_total_tokens; the most negative of them (0 when buffer is 0)."""
    if o.buffer <= 0:
        return 0.0
    x = min(overlong_penalty(n, turn_budget, o.buffer, o.penalty) for n in model_turns(r))
    if o.total > 0:
        x = min(x, overlong_penalty(len(r.completion_tokens), o.total, min(o.buffer, o.total - 1), o.penalty))
    return x
