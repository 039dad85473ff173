"""Trajectory: one sample being generated, free of vLLM and Monarch; the input checks it must pass.

A `Trajectory` is one sample (group_id, sample_idx) of an admitted PromptGroup. It is generated in
one or more *segments* (vLLM requests): a weight update under `abort`, or a stage end under
`carry_over=save`, ends a segment early, and the next segment is submitted with prompt + all tokens
so far, so generation resumes conditioned on exactly those tokens. Each segment appends its tokens,
behaviour logprobs and per-token versions; older tokens never change. A multi-turn rollout appends
environment observations between model turns (`extend_env`, pipeline/generator/envs.py); a chat
rollout's observation comes in its template's frame, whose tokens are context but not transcript
text (`transcript_tokens`: what the reward reads).

Per-token versions come from the engine itself: vLLM labels every engine step with the weight
version it ran (`update_weight_version`) and returns, for a finished request, the spans
`[start, end) -> version` of its output tokens (`CompletionOutput.weight_versions`). That is exact
even for tokens sampled just before a pause whose outputs reach the client after it.

Contract: a trajectory only grows (tokens, logprobs and versions stay aligned, or `extend` raises);
`context()` is what the next segment is conditioned on; a prompt or request that vLLM must never see
raises RequestError (`check_prompt`, `check_request`) with the short reason it is counted under.

Example:
    check_prompt(len(prompt_tokens), max_model_len)              # at admission: RequestError if bad
    traj = Trajectory(group, sample_idx, prompt_tokens)
    traj.begin_segment()                                         # counts a resubmission's re-prefill
    traj.extend(token_ids, logprobs, spans_to_versions(spans, len(token_ids)))
    rollout = traj.to_rollout(completion_text, finish_reason, reward, generator_id)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from pipeline.types import ENV_VERSION, PromptGroup, Rollout

__all__ = ["RequestError", "Trajectory", "WorkSource", "spans_to_versions", "check_prompt", "check_request"]


class RequestError(ValueError):
    """One request cannot be served (bad input); `reason` is a short key used for counting."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message

    def __reduce__(self):  # crosses actor boundaries: pickle with both arguments
        return (type(self), (self.reason, self.message))


class WorkSource(Protocol):
    """Where prompt groups come from and rollouts go (the replay buffer's endpoints in production)."""

    async def admit(self, wait_s: float) -> PromptGroup | None: ...

    async def add(self, rollout: Rollout) -> None: ...

    async def release(self, group_id: int) -> bool: ...


def check_prompt(prompt_len: int, max_model_len: int) -> None:
    """Raise RequestError for a prompt vLLM must never see: empty, or leaving no room to generate."""
    if prompt_len == 0:
        raise RequestError("empty_prompt", "prompt has no tokens")
    if prompt_len >= max_model_len:
        raise RequestError("prompt_too_long", f"prompt has {prompt_len} tokens; the context holds {max_model_len} "
                                              "and at least one must be left for the completion")


def check_request(prompt_len: int, max_tokens: int, temperature: float, max_model_len: int) -> None:
    """Raise RequestError for input vLLM must never see: empty or over-long prompt, bad sampling values."""
    check_prompt(prompt_len, max_model_len)
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise RequestError("bad_sampling_params", f"max_tokens={max_tokens!r}; allowed: integer >= 1")
    if not (math.isfinite(temperature) and 0 <= temperature <= 10):
        raise RequestError("bad_sampling_params", f"temperature={temperature!r}; allowed: 0 <= t <= 10")


def spans_to_versions(spans: Iterable | None, num_tokens: int) -> list[int]:
    """Per-token versions from vLLM's WeightVersionSpan list (`version`, `start`, `end`) of one request."""
    if num_tokens == 0:
        return []
    if spans is None:
        raise RuntimeError(f"vLLM returned {num_tokens} tokens without weight-version spans; "
                           "the engine's weight version was never set")
    out: list[int] = []
    for s in spans:
        if s.start != len(out) or s.end < s.start:
            raise RuntimeError(f"vLLM weight-version spans are not contiguous: {list(spans)}")
        out.extend([int(s.version)] * (s.end - s.start))
    if len(out) != num_tokens:
        raise RuntimeError(f"vLLM weight-version spans cover {len(out)} tokens, the output has {num_tokens}")
    return out


@dataclass
class Trajectory:
    """A sample being generated, possibly across several segments and weight versions."""

    group: PromptGroup
    sample_idx: int
    prompt_tokens: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    reprefill_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    env: object = None  # multi-turn: this rollout's environment (pipeline/generator/envs.py), made before turn 1
    turns: int = 0  # model turns finished
    turn_start: int = 0  # index in `tokens` where the current model turn began
    framing: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in `tokens` of chat frames
    teacher_prompt: tuple[int, ...] = ()  # with a teacher: its prompt (the student's, plus teacher.context)

    @property
    def key(self) -> str:
        return f"g{self.group.group_id}-s{self.sample_idx}"

    def context(self) -> list[int]:
        """What the next segment is conditioned on: the prompt and every token generated so far."""
        return list(self.prompt_tokens) + self.tokens

    def teacher_context(self) -> list[int]:
        """The teacher's stream so far: its prompt and every token generated or observed."""
        return list(self.teacher_prompt) + self.tokens

    def begin_segment(self) -> None:
        """Count a resubmission's re-prefill (the earlier tokens are processed again): a segment that
        continues a turn cut short (an abort, a carried-over partial), not a multi-turn rollout's
        next turn, whose context is what any multi-turn engine processes."""
        if self.segments > 0 and self.turn_tokens():
            self.reprefill_tokens += len(self.prompt_tokens) + len(self.tokens)
        self.segments += 1

    def extend(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise RuntimeError(f"{self.key}: segment has {len(token_ids)} tokens, {len(logprobs)} logprobs, "
                               f"{len(versions)} versions")
        self.tokens.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def turn_tokens(self) -> list[int]:
        """The current model turn's tokens so far."""
        return self.tokens[self.turn_start:]

    def extend_env(self, token_ids: list[int], frame: tuple[int, int] = (0, 0)) -> None:
        """Append an environment observation (not sampled: version ENV_VERSION, logprob 0) and start
        the next model turn after it. `frame`: how many of `token_ids` at its start and at its end
        are the chat template's frame (pipeline.tokens.ObservationFrame), not the observation."""
        start, head, tail = len(self.tokens), *frame
        self.framing += [(a, b) for a, b in ((start, start + head), (start + len(token_ids) - tail,
                                                                     start + len(token_ids))) if b > a]
        self.tokens.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([ENV_VERSION] * len(token_ids))
        self.turn_start = len(self.tokens)

    def transcript_tokens(self) -> list[int]:
        """`tokens` without the chat frames: the model turns and observations, decoded for the reward."""
        if not self.framing:
            return self.tokens
        keep, at = [], 0
        for a, b in self.framing:
            keep += self.tokens[at:a]
            at = b
        return keep + self.tokens[at:]

    def to_rollout(self, completion: str, finish_reason: str, reward: float, generator_id: int,
                   teacher_logprobs: tuple[float, ...] | None = None, turn_rewards: tuple[float, ...] = ()) -> Rollout:
        r = Rollout(group_id=self.group.group_id, sample_idx=self.sample_idx, prompt=self.group.item.prompt,
                    prompt_tokens=self.prompt_tokens, completion=completion, completion_tokens=tuple(self.tokens),
                    logprobs=tuple(self.logprobs), versions=tuple(self.versions), finish_reason=finish_reason,
                    reward=reward, generator_id=generator_id, reprefill_tokens=self.reprefill_tokens,
                    started_at=self.started_at, finished_at=time.monotonic(), teacher_logprobs=teacher_logprobs,
                    turn_rewards=turn_rewards)
        r.validate()
        return r
