"""DifficultyFilter: online difficulty filtering of the prompt stream (no Monarch).

GRPO learns only from groups whose rewards differ: a prompt the policy always solves (or never
does) gives every sample the same reward, zero advantage, and costs a group's generation for
nothing. As in DAPO, AReaL, slime and prime-rl, the filter counts such groups per prompt (keyed by
pipeline.types.prompt_key) and sets aside a prompt whose last `set_aside_after` groups all had equal
rewards, all the same one (the buffer sets it to ceil(buffer.set_aside_samples / G) groups); the
prompts drawn instead are the ones that carry signal, or that have not shown yet.

Life of a prompt (k = consecutive set-asides of it so far, R = retry_after):

    admit(prompt, v) -> True          unknown, or fewer than set_aside_after flat groups in a row
    observe(prompt, rewards, v)       flat at the streak's reward: streak + 1 (at another: streak 1);
                                      a reward spread: forgotten (streak 0, k 0)
    streak == set_aside_after         set aside until version v + R·2^min(k, MAX_DOUBLINGS)
    admit(prompt, v') -> False        skipped while v' is before that version
    admit(prompt, v') -> True         retried once it is due: one more flat group sets it aside again
                                      for twice as long, a spread forgets it

Contracts:
- Where it lives: one filter per run, owned by the replay buffer core, which sees every finished
  group (from every generator) and whose actor draws every prompt from the one PromptStream for all
  generators. So the state is central: N generators change nothing, and a generator that dies
  loses nothing of it. Groups dropped before they finish (stale, failed) teach it nothing.
- Epochs: the stream is unchanged, every prompt is drawn once per epoch; a set-aside one is passed
  over (counted in `prompts_skipped`) until it is due, then admitted as a retry. So a finite split's
  prompts all come back within an epoch of their retry version (nothing is starved), and with
  run.epochs an epoch still means one pass over every prompt. An infinite source of fresh prompts
  rarely repeats one; the filter then only forgets: it tracks at most MAX_TRACKED prompts, dropping
  the least recently seen (a forgotten prompt is admitted like a new one).
- Liveness: admit() returns False at most 2·(set-aside prompts) + 1 times in a row. More skips in a
  row than that cannot happen while some prompt is not set aside (one epoch draws each set-aside
  prompt once, two epochs' seam twice), so then every prompt drawn is set aside: the filter
  warns with the counts (how many at which reward: solved, or out of reach; at most once per
  WARN_EVERY steps, else at INFO) and admits every prompt until a group shows a reward spread again. A batch is never starved and the draw loop
  never spins.
- Versions are the buffer's trainer versions (steps), so retry delays mean the same in sync and
  async mode. state_dict() holds everything; a checkpoint from before the filter loads as empty.

Example:
    f = DifficultyFilter(set_aside_after=2, retry_after=4)
    f.observe("7+8=", [1.0] * 8, version=0); f.observe("7+8=", [1.0] * 8, version=1)
    assert not f.admit("7+8=", version=2)      # set aside until version 1 + 4
    assert f.admit("7+8=", version=5)          # due: retried
    item = f.draw(stream, version)             # the actor's draw: the next prompt admitted, or None
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from dataclasses import astuple, dataclass
from typing import Hashable, Iterator, Sequence

from pipeline.types import Prompt, PromptItem, prompt_key

__all__ = ["DifficultyFilter", "MAX_TRACKED", "MAX_DOUBLINGS"]

log = logging.getLogger(__name__)

MAX_TRACKED = 100_000
"""Prompts the filter remembers (those with a flat streak); beyond it the least recently seen goes."""
MAX_DOUBLINGS = 4
"""A prompt set aside again and again waits at most retry_after·2^4 versions between retries."""
SIGNAL_WINDOW = 256
"""Recent groups over which `signal_share` is measured."""
WARN_EVERY = 100
"""Steps between two warnings that every prompt is set aside (a flickering spread would repeat it)."""


@dataclass
class _Entry:
    streak: int = 0  # groups in a row with equal rewards
    value: float = 0.0  # the reward they all had (the last flat group's)
    until: int | None = None  # set aside until this version; None: admitted
    times: int = 0  # consecutive set-asides (the retry delay doubles with each)
    trial: bool = False  # admitted as a retry, its group not seen yet


class DifficultyFilter:
    """Per-prompt flat-group streaks, set-asides and retries; the contracts are the module docstring's.
    Plain Python, no I/O but one log line when every prompt is set aside; the buffer core owns one."""

    def __init__(self, set_aside_after: int, retry_after: int):
        """`set_aside_after` flat groups in a row set a prompt aside (0: the filter is off, admit
        is always True); it is retried after `retry_after` versions, doubling per repeat."""
        if set_aside_after < 0 or retry_after < 1:
            raise ValueError(f"difficulty filter: set_aside_after={set_aside_after} must be >= 0 and "
                             f"retry_after={retry_after} >= 1")
        self.after, self.retry_after = set_aside_after, retry_after
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._aside = 0  # entries with `until` set
        self._run = 0  # admit() calls in a row that returned False
        self.saturated = False  # every prompt drawn was set aside: admitting all (module docstring)
        self.groups = self.groups_with_signal = 0
        self.set_aside = self.retried = self.retried_with_signal = self.skipped = self.forced = 0
        self.saturations = 0
        self._warned_at: int | None = None  # version of the last saturation warning (not checkpointed)
        self._recent: deque[bool] = deque(maxlen=SIGNAL_WINDOW)

    @property
    def enabled(self) -> bool:
        return self.after > 0

    @property
    def aside_now(self) -> int:
        return self._aside

    def admit(self, prompt: Prompt, version: int) -> bool:
        """Whether to admit a group for `prompt`, drawn at trainer version `version` (False: skip it
        and draw the next). Never False more than 2·aside_now + 1 times in a row."""
        e = self._entries.get(prompt_key(prompt)) if self.enabled else None
        if e is None or e.until is None:
            self._run = 0
            return True
        if version >= e.until:  # due: one more group decides
            e.until, e.trial = None, True
            self._aside -= 1
            self.retried += 1
            self._run = 0
            return True
        if self.saturated:
            self.forced += 1
            return True
        if self._run >= 2 * self._aside + 1:  # more skips in a row than can be: all set aside
            self._saturate(version)
            self.forced += 1
            return True
        self._run += 1
        self.skipped += 1
        return False

    def draw(self, items: Iterator[PromptItem], version: int) -> PromptItem | None:
        """The next item of `items` that admit() lets through at `version` (set-aside ones are passed
        over, at most 2·aside_now + 1 in a row); None once `items` ends."""
        return next((item for item in items if self.admit(item.prompt, version)), None)

    def observe(self, prompt: Prompt, rewards: Sequence[float], version: int) -> None:
        """A finished group of `prompt` at `version` with these rewards (all its samples')."""
        flat = max(rewards) == min(rewards)
        self.groups += 1
        self._recent.append(not flat)
        if not flat:
            self.groups_with_signal += 1
            self.saturated = False
        if not self.enabled:
            return
        key = prompt_key(prompt)
        e = self._entries.get(key)
        if not flat:
            if e is not None:
                self._forget(key, e)
                self.retried_with_signal += e.trial
            return
        if e is None:
            e = self._entries[key] = _Entry()
            if len(self._entries) > MAX_TRACKED:
                old_key, old = next(iter(self._entries.items()))
                self._forget(old_key, old)
        self._entries.move_to_end(key)
        value = float(rewards[0])
        e.streak = e.streak + 1 if e.streak == 0 or value == e.value else 1  # 0s then 1s: not "always"
        e.value = value
        if e.until is None and e.streak >= self.after:
            e.until = version + self.retry_after * 2 ** min(e.times, MAX_DOUBLINGS)
            e.times += 1
            e.trial = False
            self._aside += 1
            self.set_aside += 1

    def _forget(self, key: Hashable, e: _Entry) -> None:
        del self._entries[key]
        if e.until is not None:
            self._aside -= 1

    def _saturate(self, version: int) -> None:
        self.saturated = True
        self.saturations += 1
        self._run = 0
        warn = self._warned_at is None or version >= self._warned_at + WARN_EVERY
        self._warned_at = version if warn else self._warned_at
        by_value = Counter(e.value for e in self._entries.values() if e.until is not None)
        values = ", ".join(f"{n} at reward {v:g}" for v, n in sorted(by_value.items(), reverse=True))
        (log.warning if warn else log.info)(
            "difficulty filter: every prompt drawn lately is set aside (%d prompts: %s; their last %d+ groups "
            "each had equal rewards, so GRPO learns nothing from them): the policy always solves them or never "
            "does. Admitting them anyway so batches keep coming, until a group shows a reward spread again. "
            "Groups with signal so far: %d of %d. If they are solved the task is done (end the run, or make "
            "it harder); if out of reach, a longer warm start (run.warm_start_steps) or an easier task helps; "
            "buffer.set_aside_samples=0 turns the filter off.", self._aside, values or "none", self.after,
            self.groups_with_signal, self.groups)

    def stats(self) -> dict:
        """Counters for the buffer's stats(): `prompts_set_aside` and `prompts_retried` count events
        (cumulative), `prompts_aside` those set aside now, `signal_share` the share of the last
        SIGNAL_WINDOW groups with a reward spread (None before the first)."""
        recent = len(self._recent)
        return {"prompts_set_aside": self.set_aside, "prompts_retried": self.retried,
                "prompts_retried_with_signal": self.retried_with_signal, "prompts_aside": self._aside,
                "prompts_skipped": self.skipped, "prompts_forced": self.forced,
                "filter_saturated": self.saturated, "filter_saturations": self.saturations,
                "groups_with_signal": self.groups_with_signal, "groups_observed": self.groups,
                "signal_share": sum(self._recent) / recent if recent else None}

    def state_dict(self) -> dict:
        return {"entries": [(k, astuple(e)) for k, e in self._entries.items()], "run": self._run,
                "saturated": self.saturated, "recent": list(self._recent),
                "counters": {k: getattr(self, k) for k in _COUNTERS}}

    def load_state_dict(self, s: dict) -> None:
        self._entries = OrderedDict((k, _Entry(*fields)) for k, fields in s["entries"])
        self._aside = sum(e.until is not None for e in self._entries.values())
        self._run, self.saturated = s["run"], s["saturated"]
        self._recent = deque(s["recent"], maxlen=SIGNAL_WINDOW)
        for k in _COUNTERS:
            setattr(self, k, s["counters"][k])


_COUNTERS = ("groups", "groups_with_signal", "set_aside", "retried", "retried_with_signal", "skipped", "forced",
             "saturations")
