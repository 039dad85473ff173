"""Engine-side rollout bookkeeping, free of vLLM and Monarch: trajectories, input checks, stats.

A `Trajectory` is one sample (group_id, sample_idx) of an admitted PromptGroup. It is generated in
one or more *segments* (vLLM requests): a weight update under `abort`, or a stage end under
`carry_over=save`, ends a segment early, and the next segment is submitted with prompt + all tokens
so far, so generation resumes conditioned on exactly those tokens. Each segment appends its tokens,
behaviour logprobs and per-token versions; older tokens never change.

Per-token versions come from the engine itself: vLLM labels every engine step with the weight
version it ran (`update_weight_version`) and returns, for a finished request, the spans
`[start, end) -> version` of its output tokens (`CompletionOutput.weight_versions`). That is exact
even for tokens sampled just before a pause whose outputs reach the client after it.

    traj = Trajectory.new(group, sample_idx, prompt_tokens)
    traj.extend(token_ids, logprobs, spans_to_versions(spans, len(token_ids)))
    rollout = traj.to_rollout(completion_text, finish_reason, reward, generator_id)
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from pipeline.types import PromptGroup, Rollout

__all__ = ["RequestError", "Trajectory", "RolloutStats", "WorkSource", "spans_to_versions", "check_request"]


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


def check_request(prompt_len: int, max_tokens: int, temperature: float, top_p: float, max_model_len: int) -> None:
    """Raise RequestError for input vLLM must never see: empty or over-long prompt, bad sampling values."""
    if prompt_len == 0:
        raise RequestError("empty_prompt", "prompt has no tokens")
    if prompt_len >= max_model_len:
        raise RequestError("prompt_too_long", f"prompt has {prompt_len} tokens; the context holds {max_model_len} "
                                              "and at least one must be left for the completion")
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise RequestError("bad_sampling_params", f"max_tokens={max_tokens!r}; allowed: integer >= 1")
    if not (math.isfinite(temperature) and 0 <= temperature <= 10):
        raise RequestError("bad_sampling_params", f"temperature={temperature!r}; allowed: 0 <= t <= 10")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise RequestError("bad_sampling_params", f"top_p={top_p!r}; allowed: 0 < p <= 1")


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

    @property
    def key(self) -> str:
        return f"g{self.group.group_id}-s{self.sample_idx}"

    def context(self) -> list[int]:
        """What the next segment is conditioned on: the prompt and every token generated so far."""
        return list(self.prompt_tokens) + self.tokens

    def begin_segment(self) -> None:
        """Count a resubmission's re-prefill (the earlier tokens are processed again)."""
        if self.segments > 0:
            self.reprefill_tokens += len(self.prompt_tokens) + len(self.tokens)
        self.segments += 1

    def extend(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise RuntimeError(f"{self.key}: segment has {len(token_ids)} tokens, {len(logprobs)} logprobs, "
                               f"{len(versions)} versions")
        self.tokens.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def to_rollout(self, completion: str, finish_reason: str, reward: float, generator_id: int) -> Rollout:
        r = Rollout(group_id=self.group.group_id, sample_idx=self.sample_idx, prompt=self.group.item.prompt,
                    prompt_tokens=self.prompt_tokens, completion=completion, completion_tokens=tuple(self.tokens),
                    logprobs=tuple(self.logprobs), versions=tuple(self.versions), finish_reason=finish_reason,
                    reward=reward, generator_id=generator_id, reprefill_tokens=self.reprefill_tokens,
                    started_at=self.started_at, finished_at=time.monotonic())
        r.validate()
        return r


@dataclass
class RolloutStats:
    """Counters behind the generator's `stats()` endpoint."""

    groups: int = 0
    tokens: int = 0
    rollouts: int = 0
    reprefill_tokens: int = 0
    carried_samples: int = 0
    carried_tokens: int = 0
    busy_s: float = 0.0
    pauses_s: list[float] = field(default_factory=list)
    failed: Counter = field(default_factory=Counter)
    errors: deque = field(default_factory=lambda: deque(maxlen=20))
    _busy_since: float | None = None

    def running(self, on: bool) -> None:
        now = time.monotonic()
        if on and self._busy_since is None:
            self._busy_since = now
        elif not on and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def fail(self, reason: str, message: str) -> None:
        self.failed[reason] += 1
        self.errors.append(message)

    def snapshot(self) -> dict:
        busy = self.busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
        return {
            "groups": self.groups,
            "tokens": self.tokens,
            "rollouts": self.rollouts,
            "tokens_per_s": self.tokens / busy if busy > 0 else 0.0,
            "busy_s": busy,
            "reprefill_tokens": self.reprefill_tokens,
            "carried_samples": self.carried_samples,
            "carried_tokens": self.carried_tokens,
            "updates": len(self.pauses_s),
            "pause_s": list(self.pauses_s),
            "pause_s_mean": sum(self.pauses_s) / len(self.pauses_s) if self.pauses_s else 0.0,
            "failed": dict(self.failed),
            "errors": list(self.errors),
        }
