"""Built-in task: a reasoning-gym dataset (procedural problems, 100+ kinds), each completion scored by
the dataset's own `score_answer`. An optional extra: `pip install reasoning-gym==0.1.25`.

    python -m pipeline.run --config configs/tiny.yaml task.name=pipeline.tasks.reasoning_gym \\
        task.rg_dataset=chain_sum task.rg_config.min_terms=2 task.rg_config.max_terms=2 task.rg_size=2000

Config: `task.rg_dataset` (the dataset's registered name), `task.rg_config` (fields of its config
dataclass), `task.rg_size` (train items), `task.rg_system_prompt` (optional, a name in
reasoning_gym.utils.SYSTEM_PROMPTS), `task.rg_answer_format` (tags or boxed) and
`task.apply_chat_template`. A name reasoning-gym does not have, a field its config lacks or a value
its validate() refuses fails at load with a TaskError naming the key (the CLI exits 2 with that one
line).

Splits. Train: items 0..rg_size-1 of `create_dataset(name, seed=task.seed, size=rg_size, **rg_config)`.
Eval: the same dataset and config with the held-out seed `task.seed + EVAL_SEED_OFFSET` (2**30): its
items in index order, skipping any whose prompt a train item (or an earlier eval item) has, until
task.eval_prompts are taken. Two guards, so eval never repeats a train item: nearly every dataset
draws item i from Random(seed + i), and 2**30 is far past any rg_size, so the two splits' draws never
share a seed; and a small problem space (`Calculate 2 - 1.`) can still draw the same question twice,
which the filter drops. The items come from task.seed whatever seed `prompts` is called with (as the
file tasks' rows): the stream's seed only orders them, and the reward must know every item.

Prompt: the question, then ANSWER_FORMATS[task.rg_answer_format]: `tags` (the default) asks for the
`<answer>...</answer>` tags reasoning-gym's `extract_answer` reads, `boxed` for `\\boxed{...}` (for a
checkpoint that already boxes its answers); with task.apply_chat_template one user message (after
a system message when task.rg_system_prompt is set), else a string (the system prompt, if any,
written before it).

Reward: `score_answer(answer, entry)`, in [0, 1], the entry looked up by prompt (types.prompt_key),
the answer read in the stated format: `extract_answer(completion)` (the last tags) for `tags`, the
content of the last complete `\\boxed{}` (graders.last_boxed) for `boxed`, stripped; a completion
without it scores 0. A scorer that cannot parse a malformed answer raises (prime_factorization:
ValueError, coin_flip: OverflowError, boxnet: TypeError): that answer scores 0; any other exception
is the scorer's failure and is rejected (reward_raised). `demonstration(item)` is the reference
answer in the stated format (`<answer>42</answer>`, `\\boxed{42}`) when the dataset gives answers (a
few accept any valid solution and give None: boxnet, graph_color, propositional_logic, rubiks_cube,
rush_hour; those have no demonstration, so no fixed warm start).

Every process that loads the task (the driver, the buffer, each generator) generates all its items,
so prompts must be the same in every process: a dataset drawing from an unseeded RNG is refused at
load (item 0 generated twice differs), and so are PER_PROCESS_DATASETS, whose questions follow
Python's per-process string hashing (measured with reasoning-gym 0.1.25). The cost is rg_size times
the dataset's time per item: 0.2 ms for basic_arithmetic, 0.2 s for sokoban; lower task.rg_size for
slow ones (the load time is logged).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import time
from typing import Any

from pipeline.config import TaskConfig
from pipeline.tasks import TaskError
from pipeline.tasks.answers import shown
from pipeline.tasks.graders import last_boxed
from pipeline.types import Prompt, PromptItem, prompt_key

__all__ = ["ReasoningGymTask", "from_config", "EVAL_SEED_OFFSET", "ANSWER_FORMAT", "ANSWER_FORMATS",
           "PER_PROCESS_DATASETS"]

log = logging.getLogger(__name__)

NAME = "pipeline.tasks.reasoning_gym"
INSTALL = "pip install reasoning-gym==0.1.25 (the project's `reasoning-gym` extra)"
EVAL_SEED_OFFSET = 2**30
"""The eval split's seed is task.seed + this: past every train item's Random(seed + i)."""
ANSWER_FORMAT = "Give your final answer between <answer> and </answer> tags."
ANSWER_FORMATS = {"tags": ANSWER_FORMAT, "boxed": "Put the final answer in \\boxed{}."}
"""task.rg_answer_format -> the instruction written after each question."""
PER_PROCESS_DATASETS = frozenset({"isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note"})
"""Their questions differ between two processes with the same seed (they depend on Python's string
hashing, PYTHONHASHSEED): the generators' copy would not match the buffer's prompts."""
MALFORMED = (ValueError, TypeError, ArithmeticError)
"""What a scorer raises on an answer it cannot parse: that answer is wrong (module docstring)."""


def _reasoning_gym() -> Any:
    """The reasoning_gym package, or a one-line TaskError saying how to install it."""
    try:
        import reasoning_gym
    except ModuleNotFoundError as e:
        what = "package, which is not installed" if e.name == "reasoning_gym" else f"package's requirement {e.name!r}"
        raise TaskError(f"task {NAME!r} needs the reasoning-gym {what}: {INSTALL}") from None
    return reasoning_gym


def from_config(cfg: TaskConfig) -> "ReasoningGymTask":
    return ReasoningGymTask(cfg)


def _bad(key: str, value: Any, allowed: str) -> TaskError:
    return TaskError(f"config: {key}={value!r} is invalid; allowed: {allowed}")


class ReasoningGymTask:
    """The splits and scorer of one reasoning-gym dataset (module docstring)."""

    def __init__(self, cfg: TaskConfig):
        rg = _reasoning_gym()
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.name, self.chat, self.format = cfg.rg_dataset, cfg.apply_chat_template, cfg.rg_answer_format
        self._extract = extract_answer if self.format == "tags" else _boxed
        if self.name not in DATASETS:
            near = difflib.get_close_matches(self.name, DATASETS, n=1)
            raise _bad("task.rg_dataset", self.name, (f"did you mean {near[0]!r}? " if near else "")
                       + f"one of reasoning-gym's {len(DATASETS)} datasets: {', '.join(sorted(DATASETS))}")
        if self.name in PER_PROCESS_DATASETS:
            raise _bad("task.rg_dataset", self.name, "a dataset whose questions are the same in every process; "
                       f"{', '.join(sorted(PER_PROCESS_DATASETS))} follow Python's per-process string hashing")
        fields = [f.name for f in dataclasses.fields(DATASETS[self.name][1]) if f.name not in ("seed", "size")]
        for key, value in cfg.rg_config.items():
            if key not in fields:
                raise _bad(f"task.rg_config.{key}", value, f"a field of {self.name}'s config "
                           f"({DATASETS[self.name][1].__name__}): {', '.join(fields) or 'none'}")
        self.system = ""
        if cfg.rg_system_prompt:
            if cfg.rg_system_prompt not in SYSTEM_PROMPTS:
                raise _bad("task.rg_system_prompt", cfg.rg_system_prompt,
                           f"one of {', '.join(map(repr, SYSTEM_PROMPTS))}, or empty")
            self.system = SYSTEM_PROMPTS[cfg.rg_system_prompt]

        def dataset(seed: int, size: int) -> Any:
            try:
                return rg.create_dataset(self.name, seed=seed, size=size, **cfg.rg_config)
            except Exception as e:  # the config's own check (mostly AssertionError), whatever its type
                raise _bad("task.rg_config", cfg.rg_config, f"a config {self.name} accepts; it says "
                           f"{type(e).__name__}: {e}") from None

        start = time.monotonic()
        train_ds = dataset(cfg.seed, cfg.rg_size)
        first = train_ds[0]
        if train_ds[0]["question"] != first["question"]:
            raise _bad("task.rg_dataset", self.name, "a dataset that draws each item from its seed; item 0 "
                       "came out twice different (an unseeded random generator)")
        self._entries: dict = {}  # prompt_key -> (dataset, entry): the scorer and what it scores against
        train = [self._item(train_ds, i, first if i == 0 else train_ds[i], i) for i in range(cfg.rg_size)]
        evals: list[PromptItem] = []
        if cfg.eval_prompts:
            pool = 2 * cfg.eval_prompts + 64  # room for the items the filter drops
            eval_ds = dataset(cfg.seed + EVAL_SEED_OFFSET, pool)
            for i in range(pool):
                entry = eval_ds[i]
                if prompt_key(self._prompt(entry["question"])) not in self._entries:
                    evals.append(self._item(eval_ds, i, entry, len(train) + len(evals)))
                    if len(evals) == cfg.eval_prompts:
                        break
        self._splits = {"train": tuple(train), "eval": tuple(evals)}
        if first["answer"] is not None:  # only then: the warm start asks for demonstration()
            self.demonstration = self._demonstration
        log.info("task %s: %s, %d train items (seed %d), %d eval items (seed %d) in %.1f s", NAME, self.name,
                 len(train), cfg.seed, len(evals), cfg.seed + EVAL_SEED_OFFSET, time.monotonic() - start)

    def _prompt(self, question: str) -> Prompt:
        user = f"{question.rstrip()}\n\n{ANSWER_FORMATS[self.format]}"
        if self.chat:
            return ([{"role": "system", "content": self.system}] if self.system else []) + \
                [{"role": "user", "content": user}]
        return f"{self.system.rstrip()}\n\n{user}" if self.system else user

    def _item(self, ds: Any, index: int, entry: dict, uid: int) -> PromptItem:
        prompt = self._prompt(entry["question"])
        self._entries.setdefault(prompt_key(prompt), (ds, entry))  # a repeated question: its first entry
        answer = entry["answer"]
        return PromptItem(uid=uid, prompt=prompt, answer="" if answer is None else str(answer))

    def prompts(self, seed: int, split: str) -> tuple[PromptItem, ...]:
        if split not in self._splits:
            raise ValueError(f"task {NAME!r}: unknown split {split!r}; 'train' or 'eval'")
        return self._splits[split]  # generated from task.seed; `seed` only orders them (PromptStream)

    def entry(self, prompt: Prompt) -> tuple[Any, dict]:
        """(dataset, entry) of a prompt of either split; KeyError naming it otherwise."""
        found = self._entries.get(prompt_key(prompt))
        if found is None:
            raise KeyError(f"prompt {shown(prompt)!r} is not one of {self.name}'s items for this task.seed, "
                           "task.rg_size and task.rg_config")
        return found

    def reward(self, prompt: Prompt, completion: str) -> float:
        ds, entry = self.entry(prompt)
        answer = self._extract(completion)
        if answer is None:  # no <answer> tags (no \\boxed{}): the stated format was not followed
            return 0.0
        try:
            score = float(ds.score_answer(answer, entry))
        except MALFORMED:
            return 0.0
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"{self.name}.score_answer returned {score}, outside [0, 1]")
        return score

    def _demonstration(self, item: PromptItem) -> str:
        answer = self.entry(item.prompt)[1]["answer"]
        if answer is None:
            raise ValueError(f"{self.name}: item {item.uid} has no reference answer to demonstrate")
        return f"<answer>{answer}</answer>" if self.format == "tags" else f"\\boxed{{{answer}}}"


def _boxed(completion: str) -> str | None:
    """The stripped content of the completion's last complete \\boxed{}, or None."""
    found = last_boxed(completion)
    return None if found is None else found.strip()
