"""Rewards and counters of a generator: RewardScorer (a task's reward or environment calls, off the
event loop), RolloutStats (what `stats()` reports) and the reject-rate rule that ends a run.

Faults stay local. A prompt that is empty, too long or cannot be tokenised fails its group
(`RolloutStats.fail`, counted in "failed"); a reward that raises, is not a number, is NaN/inf or
runs past task.reward_timeout_s (`RewardScorer`) rejects its sample and so its group
(`RolloutStats.reject`, counted in "rejected"). Both go into a window of the last REJECT_WINDOW
finished samples; `reject_rate_problem` turns a rejected fraction above task.max_reject_frac
(once REJECT_MIN_SAMPLES were seen) into the message that ends the run.

Contract: a snapshot has a bounded size whatever the run's length: per-update pause times and
per-sample reward latencies are windows of the last RECENT values (with a running count and mean
over the whole run for the pauses); counters grow, lists do not.

Example:
    scorer = RewardScorer(task, timeout_s=30.0, workers=4)
    reward = await scorer.score(prompt, completion)     # float, or RewardRejected with a reason
    stats = RolloutStats()
    stats.accept(); stats.paused(0.4); stats.reward_latency_s.append(0.02)
    problem = reject_rate_problem(stats.snapshot(), max_frac=0.5)   # None, or why the run must end
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from pipeline.tasks import RewardRejected, Task
from pipeline.types import Prompt

__all__ = ["RewardScorer", "RolloutStats", "reject_rate_problem", "REJECT_WINDOW", "REJECT_MIN_SAMPLES", "RECENT"]

REJECT_WINDOW = 200  # finished samples per generator the reject rate is measured over
REJECT_MIN_SAMPLES = 20  # the rate is judged only once this many were seen
LOGGED_REJECTS = 5  # the first rejected samples of a generator are logged with prompt and completion
RECENT = 256  # pause times and reward latencies a snapshot carries (the most recent ones)


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

    async def score(self, prompt: Prompt, completion: str) -> float:
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
    updates: int = 0  # weight updates applied
    pause_total_s: float = 0.0  # their pauses, summed over the run
    pauses_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # the last pauses (seconds)
    turns: int = 0  # model turns of finished multi-turn rollouts
    obs_truncated: int = 0  # environment observations cut to task.max_obs_tokens
    failed: Counter = field(default_factory=Counter)  # bad requests (prompts) by reason
    rejected: Counter = field(default_factory=Counter)  # rejected rewards by reason
    eval_skipped: Counter = field(default_factory=Counter)  # eval prompts skipped, by reason
    errors: deque = field(default_factory=lambda: deque(maxlen=20))
    recent: deque = field(default_factory=lambda: deque(maxlen=REJECT_WINDOW))  # reason, or None if accepted
    reward_latency_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # EOS -> reward, recent samples
    first_token_version: int | None = None  # the policy version of the first token this engine returned
    _busy_since: float | None = None

    def running(self, on: bool) -> None:
        now = time.monotonic()
        if on and self._busy_since is None:
            self._busy_since = now
        elif not on and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def paused(self, seconds: float) -> None:
        """A weight update paused generation for `seconds`."""
        self.updates += 1
        self.pause_total_s += seconds
        self.pauses_s.append(seconds)

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
            "updates": self.updates,
            "pause_s": list(self.pauses_s),  # the last RECENT updates
            "pause_s_mean": self.pause_total_s / self.updates if self.updates else 0.0,
            "failed": dict(self.failed),
            "rejected": dict(self.rejected),
            "eval_skipped": dict(self.eval_skipped),
            "errors": list(self.errors),
            "recent_samples": len(self.recent),
            "recent_rejected_frac": sum(reasons.values()) / len(self.recent) if self.recent else 0.0,
            "recent_reasons": dict(reasons),
            "recent_top_reason": reasons.most_common(1)[0][0] if reasons else None,
            "reward_latency_s": list(self.reward_latency_s),  # the last RECENT samples
            "first_token_version": self.first_token_version,
        }
