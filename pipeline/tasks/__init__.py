"""Task plug-ins: a prompt source plus a verifiable `reward(prompt, completion) -> float`.

A task is any importable module (or object) named in config by dotted path (`task.name`) with:

    def prompts(seed: int, split: str) -> Iterator[PromptItem]   # split: "train" | "eval"
    def reward(prompt: str, completion: str) -> float           # in [0, 1], partial credit allowed
    def demonstration(item: PromptItem) -> str                  # optional: the ideal completion

so a user's task lives outside this repository. `load_task` checks the contract and fails with a
message naming what is missing. `Task.reward` checks each answer: a reward that raises, is not a
real number (a str like "0.5" or a bool is not; int, float and numpy scalars are) or is NaN/inf
raises RewardRejected with the reason it is counted under (pipeline/rollout.py runs it off the
event loop with a timeout, which adds reward_timeout). `PromptStream` serves prompts through `torchdata.nodes`, so the
position in the stream is part of a checkpoint (`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

import importlib
import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torchdata.nodes import IterableWrapper, Loader

from pipeline.types import PromptItem

__all__ = ["Task", "TaskError", "RewardRejected", "REWARD_REASONS", "check_reward", "load_task", "PromptStream"]

REWARD_REASONS = ("reward_raised", "reward_nan", "reward_not_a_number", "reward_timeout")


class TaskError(ValueError):
    """A task path that does not import or does not satisfy the task contract."""


class RewardRejected(TaskError):
    """One reward call that cannot be used; `reason` (one of REWARD_REASONS) is its counter."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message

    def __reduce__(self):  # crosses actor boundaries: pickle with both arguments
        return (type(self), (self.reason, self.message))


def check_reward(value: object) -> float:
    """`value` as a float if it is a finite real number, else RewardRejected. bool is refused
    although Python counts it as an int: a task returning True almost surely meant a score."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardRejected("reward_not_a_number", f"returned {value!r} of type {type(value).__name__}; "
                                                    "a reward is an int or a float")
    r = float(value)
    if not math.isfinite(r):
        raise RewardRejected("reward_nan", f"returned {r}")
    return r


@dataclass(frozen=True)
class Task:
    name: str
    prompts: Callable[[int, str], Iterator[PromptItem]]
    reward_fn: Callable[[str, str], float]
    demonstration: Callable[[PromptItem], str] | None = None

    def reward(self, prompt: str, completion: str) -> float:
        """The plug-in's reward, checked; RewardRejected (reward_raised, reward_nan,
        reward_not_a_number) if it cannot be used."""
        try:
            value = self.reward_fn(prompt, completion)
        except Exception as e:
            raise RewardRejected("reward_raised", f"task {self.name}: {type(e).__name__}: {e}") from e
        return check_reward(value)


def _resolve(path: str) -> Any:
    """Import `a.b.c`, falling back to attribute `c` of module `a.b`."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is None or not path.startswith(e.name):
            raise TaskError(f"task {path!r}: importing it failed: {e}") from e
    mod_path, _, attr = path.rpartition(".")
    if not mod_path:
        raise TaskError(f"task {path!r}: no module of that name")
    try:
        mod = importlib.import_module(mod_path)
    except ModuleNotFoundError as e:
        raise TaskError(f"task {path!r}: no module {mod_path!r} ({e})") from e
    if not hasattr(mod, attr):
        raise TaskError(f"task {path!r}: module {mod_path!r} has no attribute {attr!r}")
    return getattr(mod, attr)


def load_task(path: str) -> Task:
    obj = _resolve(path)
    missing = [n for n in ("prompts", "reward") if not callable(getattr(obj, n, None))]
    if missing:
        raise TaskError(f"task {path!r}: missing callable(s) {', '.join(missing)}; a task provides "
                        "prompts(seed, split) and reward(prompt, completion)")
    demo = getattr(obj, "demonstration", None)
    return Task(name=path, prompts=obj.prompts, reward_fn=obj.reward, demonstration=demo if callable(demo) else None)


class PromptStream:
    """Checkpointable stream of training prompts (torchdata.nodes Loader over the task's generator)."""

    def __init__(self, task: Task, seed: int, split: str = "train"):
        self._loader = Loader(IterableWrapper(_Source(task, seed, split)))
        self._it = iter(self._loader)

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> PromptItem:
        return next(self._it)

    def state_dict(self) -> dict:
        return self._loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._loader.load_state_dict(state)
        self._it = iter(self._loader)


class _Source:
    """Re-iterable view of a task's prompt generator (IterableWrapper re-creates it on reset)."""

    def __init__(self, task: Task, seed: int, split: str):
        self.task, self.seed, self.split = task, seed, split

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.task.prompts(self.seed, self.split))


def take(task: Task, seed: int, split: str, n: int) -> list[PromptItem]:
    return list(itertools.islice(task.prompts(seed, split), n))
