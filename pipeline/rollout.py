"""Engine-side rollout bookkeeping, free of vLLM and Monarch: trajectories, input checks, rewards, stats.

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

Faults stay local. A prompt that is empty, too long or cannot be tokenised fails its group
(`RolloutStats.fail`, counted in "failed"); a reward that raises, is not a number, is NaN/inf or
runs past task.reward_timeout_s (`RewardScorer`) rejects its sample and so its group
(`RolloutStats.reject`, counted in "rejected"). Both go into a window of the last REJECT_WINDOW
finished samples; `reject_rate_problem` turns a rejected fraction above task.max_reject_frac
(once REJECT_MIN_SAMPLES were seen) into the message that ends the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from pipeline.tasks import RewardRejected, Task
from pipeline.types import ENV_VERSION, PromptGroup, Rollout

__all__ = ["RequestError", "Trajectory", "RolloutStats", "RewardScorer", "WorkSource", "spans_to_versions",
           "check_prompt", "check_request", "reject_rate_problem", "REJECT_WINDOW", "REJECT_MIN_SAMPLES"]

REJECT_WINDOW = 200  # finished samples per generator the reject rate is measured over
REJECT_MIN_SAMPLES = 20  # the rate is judged only once this many were seen
LOGGED_REJECTS = 5  # the first rejected samples of a generator are logged with prompt and completion


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
    env: object = None  # multi-turn: this rollout's environment (pipeline/envs.py), made before turn 1
    turns: int = 0  # model turns finished
    turn_start: int = 0  # index in `tokens` where the current model turn began

    @property
    def key(self) -> str:
        return f"g{self.group.group_id}-s{self.sample_idx}"

    def context(self) -> list[int]:
        """What the next segment is conditioned on: the prompt and every token generated so far."""
        return list(self.prompt_tokens) + self.tokens

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

    def extend_env(self, token_ids: list[int]) -> None:
        """Append an environment observation (not sampled: version ENV_VERSION, logprob 0) and start
        the next model turn after it."""
        self.tokens.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([ENV_VERSION] * len(token_ids))
        self.turn_start = len(self.tokens)

    def to_rollout(self, completion: str, finish_reason: str, reward: float, generator_id: int) -> Rollout:
        r = Rollout(group_id=self.group.group_id, sample_idx=self.sample_idx, prompt=self.group.item.prompt,
                    prompt_tokens=self.prompt_tokens, completion=completion, completion_tokens=tuple(self.tokens),
                    logprobs=tuple(self.logprobs), versions=tuple(self.versions), finish_reason=finish_reason,
                    reward=reward, generator_id=generator_id, reprefill_tokens=self.reprefill_tokens,
                    started_at=self.started_at, finished_at=time.monotonic())
        r.validate()
        return r


class RewardScorer:
    """Runs `task.reward` off the event loop: on daemon threads, at most `workers` at once, each call
    bounded by `timeout_s` (task.reward_timeout_s).

        scorer = RewardScorer(task, timeout_s=30.0, workers=4)
        reward = await scorer.score(prompt, completion)   # float, or RewardRejected with a reason

    A Python thread cannot be killed, so a reward past its timeout keeps its worker until it
    returns (`overdue` counts those). Waiting for a free worker is bounded by the same timeout, so
    rewards that hang for good make every later call a reward_timeout too, and the reject rate
    stops the run. Daemon threads: a hung reward never holds up process exit.
    """

    def __init__(self, task: Task, timeout_s: float, workers: int):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"RewardScorer: timeout_s={timeout_s}, workers={workers}; need > 0 and >= 1")
        self.task, self.timeout_s = task, timeout_s
        self._slots = asyncio.Semaphore(workers)
        self.overdue = 0

    async def score(self, prompt: str, completion: str) -> float:
        return await self.call(self.task.reward, prompt, completion)

    async def call(self, fn, *args, kind: str = "reward"):
        """`fn(*args)` on a worker thread, bounded by the scorer's timeout; a failure raises
        RewardRejected with reason `<kind>_raised` or `<kind>_timeout` (an environment's calls use
        kind="env"). A RewardRejected that `fn` raises is passed on as it is."""
        t = self.timeout_s
        key = "task.reward_timeout_s" if kind == "reward" else f"task.{kind}_timeout_s"
        try:
            await asyncio.wait_for(self._slots.acquire(), t)
        except asyncio.TimeoutError:
            raise RewardRejected(f"{kind}_timeout", f"no {kind} worker free within {t:g}s ({key}); "
                                                    f"{self.overdue} {kind} call(s) still running past it") from None
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        late = False

        def finished(result: tuple) -> None:  # on the loop, when the thread returns
            nonlocal late
            self._slots.release()
            if late:
                self.overdue -= 1
            if not done.done():
                done.set_result(result)

        def run() -> None:
            try:
                result = (fn(*args), None)
            except BaseException as e:  # anything the plug-in raises is that sample's fault
                result = (None, e)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(finished, result)

        threading.Thread(target=run, name=kind, daemon=True).start()
        try:
            value, err = await asyncio.wait_for(asyncio.shield(done), t)
        except asyncio.TimeoutError:
            if not done.done():
                late = True
                self.overdue += 1
            raise RewardRejected(f"{kind}_timeout", f"{kind} still running after {t:g}s ({key})") from None
        if isinstance(err, RewardRejected):
            raise err
        if err is not None:
            raise RewardRejected(f"{kind}_raised", f"{type(err).__name__}: {err}") from err
        return value


def reject_rate_problem(snapshot: dict, max_frac: float) -> str | None:
    """Why a generator's recent rejections should end the run (a `RolloutStats.snapshot()` with more
    than `max_frac` of its last REJECT_WINDOW samples rejected, REJECT_MIN_SAMPLES seen), else None."""
    n, frac = snapshot["recent_samples"], snapshot["recent_rejected_frac"]
    if n < REJECT_MIN_SAMPLES or frac <= max_frac:
        return None
    last = snapshot["errors"][-1] if snapshot["errors"] else ""
    return (f"{frac:.0%} of its last {n} samples were rejected, above task.max_reject_frac={max_frac:g}; "
            f"top reason {snapshot['recent_top_reason']} (recent: {snapshot['recent_reasons']}); last: {last[:300]}")


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
    turns: int = 0  # model turns of finished multi-turn rollouts
    obs_truncated: int = 0  # environment observations cut to task.max_obs_tokens
    failed: Counter = field(default_factory=Counter)  # bad requests (prompts) by reason
    rejected: Counter = field(default_factory=Counter)  # rejected rewards by reason
    eval_skipped: Counter = field(default_factory=Counter)  # eval prompts skipped, by reason
    errors: deque = field(default_factory=lambda: deque(maxlen=20))
    recent: deque = field(default_factory=lambda: deque(maxlen=REJECT_WINDOW))  # reason, or None if accepted
    reward_latency_s: deque = field(default_factory=lambda: deque(maxlen=512))  # EOS -> reward, recent samples
    _busy_since: float | None = None

    def running(self, on: bool) -> None:
        now = time.monotonic()
        if on and self._busy_since is None:
            self._busy_since = now
        elif not on and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def fail(self, reason: str, message: str) -> None:
        """A request that could not be served (its group is given back)."""
        self.failed[reason] += 1
        self.errors.append(message)
        self.recent.append(reason)

    def reject(self, reason: str, message: str) -> bool:
        """A finished sample whose reward could not be used (its group is given back); True for the
        first LOGGED_REJECTS, which the caller logs in full."""
        self.rejected[reason] += 1
        self.errors.append(message)
        self.recent.append(reason)
        return sum(self.rejected.values()) <= LOGGED_REJECTS

    def accept(self) -> None:
        """A finished sample with a usable reward."""
        self.recent.append(None)

    def recent_reasons(self) -> Counter:
        return Counter(r for r in self.recent if r is not None)

    def snapshot(self) -> dict:
        reasons = self.recent_reasons()
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
            "turns": self.turns,
            "obs_truncated": self.obs_truncated,
            "updates": len(self.pauses_s),
            "pause_s": list(self.pauses_s),
            "pause_s_mean": sum(self.pauses_s) / len(self.pauses_s) if self.pauses_s else 0.0,
            "failed": dict(self.failed),
            "rejected": dict(self.rejected),
            "eval_skipped": dict(self.eval_skipped),
            "errors": list(self.errors),
            "recent_samples": len(self.recent),
            "recent_rejected_frac": sum(reasons.values()) / len(self.recent) if self.recent else 0.0,
            "recent_reasons": dict(reasons),
            "recent_top_reason": reasons.most_common(1)[0][0] if reasons else None,
            "reward_latency_s": list(self.reward_latency_s),
        }
