"""Messages that cross actor boundaries: frozen dataclasses, picklable, no Monarch imports.

Token layout contract (shared by the buffer, which builds batches, and the trainer, which consumes
them): a sample is `prompt_tokens + completion_tokens`, right-padded to the batch length `T`.
Per-token tensors are indexed by *token position*: `loss_mask[i, t] = 1` iff token `t` of sample `i`
is a completion token, and `behaviour_logprobs[i, t]` / `versions[i, t]` describe that token (the
sampler's logprob of `input_ids[i, t]` given `input_ids[i, :t]`, and the policy version that sampled
it). The trainer's logits at position `t - 1` predict token `t`, so it compares
`log_softmax(logits[:, :-1]).gather(input_ids[:, 1:])` with `behaviour_logprobs[:, 1:]` under
`loss_mask[:, 1:]`. Padding and prompt positions hold logprob 0 and version -1.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch


Prompt = str | list[dict[str, str]]
"""A task's prompt: a str (tokenised as it is) or a list of chat messages {"role": ..., "content": ...}
(rendered by the checkpoint's chat template; pipeline/tokens.py). A prompt travels as the task gave
it (to the reward, in rollouts and in checkpoints: plain lists and dicts, so it pickles as is)."""


def prompt_key(prompt: Prompt) -> str | tuple[str, str]:
    """A prompt as a dict key (a task's answers by prompt): a str itself, messages their canonical JSON."""
    return prompt if isinstance(prompt, str) else ("messages", json.dumps(prompt, sort_keys=True))


ENV_VERSION = -1
"""Version of a token the environment wrote (a multi-turn observation): not sampled, not trained."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt from a task's source; `uid` is unique within one pass over a split (epochs repeat it)."""

    uid: int
    prompt: Prompt
    answer: str = ""
    max_new_tokens: int = 0  # per-prompt generation budget; 0 = generator.max_new_tokens (which also caps it)
    columns: tuple[tuple[str, str], ...] = ()  # a dataset row's other columns (teacher.context reads them)

    def fields(self) -> dict[str, str]:
        """What a teacher.context template may name: the row's columns, `answer`, and `prompt` (the
        prompt's text: a str prompt itself, a chat prompt's last user turn)."""
        p = self.prompt if isinstance(self.prompt, str) else next(
            (m.get("content", "") for m in reversed(self.prompt) if m.get("role") == "user"), "")
        return {**dict(self.columns), "answer": self.answer, "prompt": p}


class Scored(str):
    """An eval completion (its text) whose environment scored the episode (OpenEnv): `reward` is that
    score, used instead of the task's reward() (pipeline/driver/evaluation.py)."""

    def __new__(cls, text: str, reward: float):
        obj = super().__new__(cls, text)
        obj.reward = reward
        return obj

    def __reduce__(self):  # crosses actor boundaries with its reward
        return (Scored, (str(self), self.reward))


@dataclass(frozen=True)
class PromptGroup:
    """A prompt admitted by the buffer; the generators sample it `group_size` times."""

    group_id: int
    item: PromptItem
    group_size: int
    admitted_version: int
    admitted_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Rollout:
    """One finished (or carried-over partial) sample with per-token provenance.

    `logprobs[k]` and `versions[k]` belong to `completion_tokens[k]`. In a multi-turn rollout the
    completion interleaves model turns and environment observations: an environment token has
    version ENV_VERSION (-1) and logprob 0, is fed to the model as context and never trained on.
    """

    group_id: int
    sample_idx: int
    prompt: Prompt
    prompt_tokens: tuple[int, ...]
    completion: str
    completion_tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str
    reward: float = 0.0
    generator_id: int = 0
    reprefill_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float = field(default_factory=time.monotonic)
    teacher_logprobs: tuple[float, ...] | None = None
    """With a teacher (on-policy distillation): its log-prob of each completion token, 0 on
    environment tokens; None without one."""
    turn_rewards: tuple[float, ...] = ()
    """An environment that scores its episodes (OpenEnv): the reward each step returned; () otherwise."""

    def validate(self) -> None:
        """Raise ValueError naming what is wrong; used by every receiver before it stores."""
        n = len(self.completion_tokens)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"rollout group={self.group_id} sample={self.sample_idx}: completion_tokens ({n}), "
                f"logprobs ({len(self.logprobs)}) and versions ({len(self.versions)}) differ in length"
            )
        if not self.prompt_tokens:
            raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: empty prompt_tokens")
        if not math.isfinite(self.reward):
            raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: reward is {self.reward}")
        if any(not math.isfinite(x) for x in self.logprobs):
            raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: non-finite behaviour logprob")
        if any(v < ENV_VERSION for v in self.versions):
            raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: negative policy version")
        if self.teacher_logprobs is not None:
            if len(self.teacher_logprobs) != n:
                raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: {len(self.teacher_logprobs)} "
                                 f"teacher logprobs for {n} completion tokens")
            if any(not math.isfinite(x) or x > 0 for x in self.teacher_logprobs):
                raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: a teacher logprob that "
                                 "is not finite or is above 0")
        if any(v == ENV_VERSION and lp != 0.0 for v, lp in zip(self.versions, self.logprobs)):
            raise ValueError(f"rollout group={self.group_id} sample={self.sample_idx}: an environment token "
                             "(version -1) with a behaviour logprob")

    @property
    def num_model_tokens(self) -> int:
        """Completion tokens the policy sampled (what generation cost; observations left out)."""
        return sum(1 for v in self.versions if v != ENV_VERSION)

    @property
    def model_versions(self) -> list[int]:
        """Versions of the tokens the policy sampled (environment tokens left out)."""
        return [v for v in self.versions if v != ENV_VERSION]

    @property
    def min_version(self) -> int | None:
        """Oldest policy that sampled any token; None for a rollout without model tokens (fresh)."""
        return min(self.model_versions, default=None)

    @property
    def max_version(self) -> int | None:
        return max(self.model_versions, default=None)


@dataclass(frozen=True)
class Batch:
    """What the trainer consumes: padded tensors plus per-sample metadata (see module docstring)."""

    input_ids: torch.Tensor  # [N, T] int64
    loss_mask: torch.Tensor  # [N, T] float32, 1 on completion tokens
    behaviour_logprobs: torch.Tensor  # [N, T] float32
    versions: torch.Tensor  # [N, T] int64, -1 off completion
    advantages: torch.Tensor  # [N] float32
    rewards: torch.Tensor  # [N] float32
    group_ids: tuple[int, ...]
    trainer_version: int  # version the batch was built for (staleness reference)
    truncated: torch.Tensor | None = None  # [N] bool: the sample hit its length budget (finish_reason 'length')
    teacher_logprobs: torch.Tensor | None = None  # [N, T] float32 like behaviour_logprobs: the teacher's (OPD)
    max_len: int = 0  # the most completion tokens a sample may have (aggregation=constant's normaliser):
    # generator.max_new_tokens, or task.max_total_tokens for multi-turn rollouts; 0: generator.max_new_tokens

    def __post_init__(self) -> None:
        n, t = self.input_ids.shape if self.input_ids.dim() == 2 else (-1, -1)
        if n <= 0:
            raise ValueError(f"Batch: input_ids must be a non-empty [N, T] tensor, got {tuple(self.input_ids.shape)}")
        for name in ("loss_mask", "behaviour_logprobs", "versions", "teacher_logprobs"):
            if getattr(self, name) is None:
                continue
            shape = tuple(getattr(self, name).shape)
            if shape != (n, t):
                raise ValueError(f"Batch: {name} has shape {shape}, expected {(n, t)} like input_ids")
        for name in ("advantages", "rewards"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n,):
                raise ValueError(f"Batch: {name} has shape {shape}, expected {(n,)}")
        if len(self.group_ids) != n:
            raise ValueError(f"Batch: {len(self.group_ids)} group_ids for {n} samples")
        if self.truncated is not None and tuple(self.truncated.shape) != (n,):
            raise ValueError(f"Batch: truncated has shape {tuple(self.truncated.shape)}, expected {(n,)}")

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def staleness(self) -> torch.Tensor:
        """Per-sample staleness = trainer_version - oldest token version ([N] int64)."""
        big = torch.iinfo(torch.int64).max
        v = torch.where(self.versions >= 0, self.versions, torch.full_like(self.versions, big))
        oldest = v.min(dim=1).values
        oldest = torch.where(oldest == big, torch.full_like(oldest, self.trainer_version), oldest)
        return self.trainer_version - oldest


@dataclass(frozen=True)
class WeightVersion:
    """Announces that weights of `version` are published under plan `plan_hash`."""

    version: int
    plan_hash: str
    num_buckets: int
    total_bytes: int
    published_at: float = field(default_factory=time.monotonic)
