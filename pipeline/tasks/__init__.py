"""Task plug-ins: a prompt source plus a verifiable `reward(prompt, completion) -> float`.

A task is any importable module (or object) named in config by dotted path (`task.name`) with:

    def prompts(seed: int, split: str) -> Iterable[PromptItem]   # split: "train" | "eval"
    def reward(prompt: Prompt, completion: str) -> float        # in [0, 1], partial credit allowed
    def demonstration(item: PromptItem) -> str                  # optional: the ideal completion
    def env(item: PromptItem) -> Env                             # optional: multi-turn (pipeline/generator/envs.py)

so a user's task lives outside this repository. A prompt (PromptItem.prompt) is a str, tokenised as
it is, or a list of chat messages [{"role": "user", "content": "..."}, ...], rendered by the
checkpoint's chat template with the generation prompt (pipeline/tokens.py; task.enable_thinking).
`reward` gets the prompt as the task gave it and the completion as text, the end-of-turn token left
out. A task that needs its config (a data file, say)
provides instead a factory `from_config(cfg: TaskConfig)` returning the object with those functions
(pipeline/tasks/jsonl.py); `load_task` calls it with the run's `task` section. `load_task` checks the
contract and fails with a message naming what is missing. `Task.reward` checks each answer: a reward
that raises, is not a real number (a str like "0.5" or a bool is not; int, float and numpy scalars
are) or is NaN/inf raises RewardRejected with the reason it is counted under (pipeline/generator/rewards.py
runs it off the event loop with a timeout, which adds reward_timeout).

Finite and infinite prompt sources. `prompts(seed, split)` may never end (a generator of synthetic
problems: served as is, in its own order) or be finite (a list of 500 problems, the lines of a file).
`PromptStream` serves a finite train split in epochs, each in an order shuffled from (seed, split,
epoch) and the same on every process; `run.epochs` ends the stream after that many (0: never). A
Sequence (list, tuple) is shuffled from the first epoch on, with no copy. A generator is read lazily
in its own order for the first pass (it may be infinite, so nothing is kept); once it ends it is
called again and read into memory (a list of its items) for the shuffled later epochs. So a finite
split costs its items' memory from the second epoch on, an infinite one nothing; a source too large
for memory should not end: yield its own passes (e.g. reshuffled shards) forever. `prompts` must
yield the same items on every call: the stream calls it again for later epochs and on resume.

The stream's position (epoch, index within it, the shuffle's seed and the epoch length once known)
is its `torchdata.nodes` state_dict, part of every checkpoint: a resume continues the same shuffled
order at the same item.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import numbers
import random
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from torchdata.nodes import BaseNode, Loader

from pipeline.config import TaskConfig
from pipeline.types import Prompt, PromptItem

__all__ = ["Task", "TaskError", "RewardRejected", "REWARD_REASONS", "check_reward", "load_task", "open_task",
           "has_turns", "PromptStream", "epoch_order", "take"]

log = logging.getLogger(__name__)

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
    prompts: Callable[[int, str], Iterable[PromptItem]]
    reward_fn: Callable[[Prompt, str], float]
    demonstration: Callable[[PromptItem], Any] | None = None
    env: Callable[[PromptItem], Any] | None = None
    """Multi-turn environment factory (task.env, else the task's own `env`); None: single-turn."""

    def reward(self, prompt: Prompt, completion: str) -> float:
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


def load_task(path: str, cfg: TaskConfig | None = None) -> Task:
    """The task at dotted `path`; a task with `from_config` is built from `cfg` (default: TaskConfig(name=path))."""
    obj = _resolve(path)
    factory = getattr(obj, "from_config", None)
    if callable(factory):
        try:
            obj = factory(cfg if cfg is not None else TaskConfig(name=path))
        except TaskError:
            raise
        except Exception as e:
            raise TaskError(f"task {path!r}: from_config failed: {type(e).__name__}: {e}") from e
    missing = [n for n in ("prompts", "reward") if not callable(getattr(obj, n, None))]
    if missing:
        raise TaskError(f"task {path!r}: missing callable(s) {', '.join(missing)}; a task provides "
                        "prompts(seed, split) and reward(prompt, completion)")
    demo = getattr(obj, "demonstration", None)
    env = getattr(obj, "env", None)
    if cfg is not None and cfg.env:
        env = _resolve(cfg.env)
        if not callable(env):
            raise TaskError(f"task.env={cfg.env!r}: not callable; an environment factory is env(item) -> Env")
    elif env is not None and not callable(env):
        raise TaskError(f"task {path!r}: its `env` is not callable; an environment factory is env(item) -> Env")
    return Task(name=path, prompts=obj.prompts, reward_fn=obj.reward, demonstration=demo if callable(demo) else None,
                env=env)


def has_turns(cfg: TaskConfig) -> bool:
    """Whether a rollout of the task can have several model turns: task.max_turns > 1 and an
    environment (task.env, the task's own `env`, or an `env` on the type its `from_config` is annotated
    to return; nothing is built). A task that does not import says False: load_task reports it."""
    if cfg.max_turns <= 1:
        return False
    if cfg.env:
        return True
    try:
        obj = _resolve(cfg.name)
    except (TaskError, ImportError):
        return False
    factory = getattr(obj, "from_config", None)
    if callable(factory):
        try:
            obj = typing.get_type_hints(factory).get("return")
        except NameError:  # an annotation that does not resolve: no type to read
            return False
    return callable(getattr(obj, "env", None))


def open_task(cfg: TaskConfig, evaluate: bool) -> Task:
    """`load_task` plus the checks a run needs before anything starts: the train split yields at
    least one prompt and, if `evaluate`, so does the eval split (a shorter one than task.eval_prompts
    is used as it is, and a log line says so). Raises TaskError naming the task."""
    task = load_task(cfg.name, cfg)
    if not take(task, cfg.seed, "train", 1):
        raise TaskError(f"task {cfg.name!r}: the train split is empty (prompts(seed={cfg.seed}, 'train') yielded "
                        "nothing): there is nothing to train on")
    if evaluate:
        n = len(take(task, cfg.seed, "eval", cfg.eval_prompts))
        if n == 0:
            raise TaskError(f"task {cfg.name!r}: the eval split is empty (prompts(seed={cfg.seed}, 'eval') yielded "
                            "nothing); give the task eval prompts (pipeline.tasks.jsonl: task.eval_path) or turn "
                            "evaluation off with run.eval_every=0 or task.eval_prompts=0")
        if n < cfg.eval_prompts:
            log.warning("task %s: the eval split has %d prompts, fewer than task.eval_prompts=%d: evaluating on "
                        "those %d", cfg.name, n, cfg.eval_prompts, n)
    return task


def take(task: Task, seed: int, split: str, n: int) -> list[PromptItem]:
    """The first `n` prompts of a split in the task's own order (fewer if the split is shorter)."""
    return list(itertools.islice(task.prompts(seed, split), n))


def epoch_order(n: int, seed: int, split: str, epoch: int) -> list[int]:
    """The order of epoch `epoch` over `n` items: a permutation drawn from (seed, split, epoch) alone
    (a str seed is hashed with SHA-512, so it is the same in every process and Python run)."""
    order = list(range(n))
    random.Random(f"prompts/{seed}/{split}/{epoch}").shuffle(order)
    return order


class PromptStream:
    """Checkpointable stream of a split's prompts in epochs (module docstring): a torchdata.nodes
    Loader over `_Epochs`. `epochs` > 0 ends it (StopIteration) once that many passes are served."""

    def __init__(self, task: Task, seed: int, split: str = "train", epochs: int = 0):
        self._node = _Epochs(task, seed, split, epochs)
        # a state at the end of the last epoch must stay there on load, not start over
        self._loader = Loader(self._node, restart_on_stop_iteration=False)
        self._it = iter(self._loader)

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> PromptItem:
        return next(self._it)

    def progress(self) -> float:
        """Epochs served so far: whole ones plus the fraction of the current one (once the epoch
        length is known; during a generator's first pass only whole epochs, i.e. 0)."""
        n = self._node
        return n.epoch + (n.index / n.length if n.length else 0.0)

    def state_dict(self) -> dict:
        return self._loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._loader.load_state_dict(state)
        self._it = iter(self._loader)


_END = object()


class _Epochs(BaseNode[PromptItem]):
    """The task's prompts pass after pass. State: epoch, index (items of this epoch served), seed and
    length (items per epoch, None until known: an infinite source never learns it)."""

    def __init__(self, task: Task, seed: int, split: str, epochs: int):
        super().__init__()
        self.task, self.seed, self.split, self.epochs = task, seed, split, epochs
        self.epoch = self.index = 0
        self.length: int | None = None
        self._items: Sequence[PromptItem] | None = None  # a Sequence source, or a finite generator read in
        self._it: Iterator[PromptItem] = iter(())

    def _where(self) -> str:
        return f"task {self.task.name!r}, split {self.split!r}"

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        s = dict(initial_state or {})
        if "_num_yielded" in s:  # a checkpoint of the single-pass stream (IterableWrapper) before epochs
            s = {"epoch": 0, "index": s["_num_yielded"]}
        if s.get("seed", self.seed) != self.seed:
            raise TaskError(f"{self._where()}: the checkpoint's prompt stream is shuffled with task.seed={s['seed']}, "
                            f"this run has task.seed={self.seed}; a resume keeps task.seed")
        saved = s.get("length")
        if saved is not None and self.length is not None and saved != self.length:
            raise TaskError(f"{self._where()}: the checkpoint's epochs have {saved} prompts, prompts(seed, split) "
                            f"now yields {self.length}: its position cannot be resumed (a changed data file?)")
        if saved is not None:
            self._known(saved)
        self.epoch, self.index = s.get("epoch", 0), s.get("index", 0)
        self._open()

    def _known(self, n: int) -> None:
        if self.length is not None and n != self.length:
            raise TaskError(f"{self._where()}: prompts(seed, split) yielded {n} prompts where it yielded (or the "
                            f"checkpoint recorded) {self.length}; it must yield the same items on every call")
        self.length = n

    def _open(self) -> None:
        """Position the iterator at item `index` of epoch `epoch`."""
        if self.epochs and self.epoch >= self.epochs:
            self._it = iter(())
            return
        if self._items is None:
            src = self.task.prompts(self.seed, self.split)
            if isinstance(src, Sequence):
                self._items = src
            elif self.epoch > 0:  # a finite generator (it ended before): its items, for shuffling
                self._items = list(src)
        if self._items is None:  # a generator's first pass: as is, fast-forwarded to `index`
            self._it = iter(src)
            for k in range(self.index):
                if next(self._it, _END) is _END:
                    raise TaskError(f"{self._where()}: the checkpoint's position is item {self.index} of the first "
                                    f"pass, but prompts(seed, split) ended after {k}")
            return
        self._known(len(self._items))
        if self.index > self.length:
            raise TaskError(f"{self._where()}: the checkpoint's position is item {self.index} of an epoch of "
                            f"{self.length}")
        order = epoch_order(self.length, self.seed, self.split, self.epoch)
        self._it = (self._items[i] for i in itertools.islice(order, self.index, None))

    def next(self) -> PromptItem:
        while True:
            item = next(self._it, _END)
            if item is not _END:
                self.index += 1
                return item
            if self.epochs and self.epoch >= self.epochs:
                raise StopIteration
            if self.index == 0:
                raise TaskError(f"{self._where()}: prompts(seed={self.seed}, {self.split!r}) yielded nothing")
            self._known(self.index)
            self.epoch, self.index = self.epoch + 1, 0
            self._open()

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "length": self.length}
