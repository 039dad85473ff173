"""A task as a user writes it, outside the package: shift every letter one step along the alphabet
(a->b, ..., z->a). Prompt `nxt hello=`, answer `ifmmp`. All 26 letters, similarity partial credit.

    python -m pipeline.run --config configs/tiny.yaml task.name=examples.tasks.shift

The contract (pipeline/tasks/__init__.py): prompts(seed, split), reward(prompt, completion) in
[0, 1], and optionally demonstration(item) for the supervised warm start.
"""

from __future__ import annotations

import difflib
import random
import string
from typing import Iterator

from pipeline.types import PromptItem

LETTERS = string.ascii_lowercase


def shifted(s: str) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in s)


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + (7_777_777 if split == "eval" else 0))
    uid = 0
    while True:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        yield PromptItem(uid=uid, prompt=f"nxt {s}=", answer=shifted(s))
        uid += 1


def reward(prompt: str, completion: str) -> float:
    if not (prompt.startswith("nxt ") and prompt.endswith("=")):
        raise ValueError(f"shift task: malformed prompt {prompt!r}")
    return difflib.SequenceMatcher(None, completion.strip(), shifted(prompt[4:-1])).ratio()


def demonstration(item: PromptItem) -> str:
    return item.answer
