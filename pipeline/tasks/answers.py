"""AnswerSplits: the train and eval splits of a file-backed task, with each prompt's one reference.

Both file tasks (pipeline/tasks/jsonl.py, pipeline/tasks/dataset.py) read rows of (item, where),
where = "file:line" or "file row i", and score a completion against the reference found by the
prompt (types.prompt_key: a string prompt as it is, chat messages by their content). The contract:

  * a prompt has one reference across both files: the same prompt again with the same answer is kept
    (it is trained twice per epoch), with another answer it fails at load naming both rows;
  * `prompts(seed, split)` returns the split's tuple, so PromptStream shuffles every epoch, the
    first included, and the files are read once per process;
  * `answer(prompt)` raises KeyError naming the prompt when it is in neither file.

Example:
    splits = AnswerSplits(NAME, [(item, "a.jsonl:1"), ...], [(item, "b.jsonl:1"), ...])
    items = splits.prompts(seed=0, split="train")
    ref = splits.answer(items[0].prompt)
"""

from __future__ import annotations

import json
from typing import Iterable

from pipeline.tasks import TaskError
from pipeline.types import Prompt, PromptItem, prompt_key

__all__ = ["AnswerSplits", "shown"]


def shown(prompt: Prompt) -> str:
    """The first 80 characters of a prompt, for error messages (messages as JSON)."""
    return (prompt if isinstance(prompt, str) else json.dumps(prompt))[:80]


class AnswerSplits:
    """See the module docstring. `train` and `evals` are (item, where) rows in file order."""

    def __init__(self, task_name: str, train: Iterable[tuple[PromptItem, str]],
                 evals: Iterable[tuple[PromptItem, str]]) -> None:
        self.task_name = task_name
        train, evals = list(train), list(evals)
        self._answers: dict = {}  # prompt_key(prompt) -> (answer, where)
        for item, at in train + evals:
            seen = self._answers.setdefault(prompt_key(item.prompt), (item.answer, at))
            if seen[0] != item.answer:
                raise TaskError(f"{at}: prompt {shown(item.prompt)!r} has answer {item.answer[-80:]!r}, but "
                                f"{seen[1]} gives it {seen[0][-80:]!r}; the reward looks answers up by prompt, "
                                "so a prompt must have one answer")
        self._splits = {"train": tuple(i for i, _ in train), "eval": tuple(i for i, _ in evals)}

    def prompts(self, seed: int, split: str) -> tuple[PromptItem, ...]:
        if split not in self._splits:
            raise ValueError(f"task {self.task_name!r}: unknown split {split!r}; 'train' or 'eval'")
        return self._splits[split]  # the order is PromptStream's (seeded shuffle per epoch)

    def answer(self, prompt: Prompt) -> str:
        if prompt_key(prompt) not in self._answers:
            raise KeyError(f"prompt {shown(prompt)!r} is in neither task.path nor task.eval_path")
        return self._answers[prompt_key(prompt)][0]
