"""Built-in task: sort the letters of a short string. Prompt `sort dbca=`, answer `abcd`.

An ordering task (the answer depends on every input letter at every position, unlike reverse's
fixed mapping). Partial credit: the fraction of answer positions that are right, scaled down by any
length error. Train and eval prompts come from disjoint random streams.
"""

from __future__ import annotations

import random
from typing import Iterator

from pipeline.types import PromptItem

ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 5


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + 31 + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        yield PromptItem(uid=uid, prompt=f"sort {s}=", answer="".join(sorted(s)))
        uid += 1


def answer_of(prompt: str) -> str:
    if not (prompt.startswith("sort ") and prompt.endswith("=")):
        raise ValueError(f"sort task: malformed prompt {prompt!r}")
    return "".join(sorted(prompt[5:-1]))


def reward(prompt: str, completion: str) -> float:
    target, got = answer_of(prompt), completion.strip()
    hits = sum(1 for a, b in zip(got, target) if a == b)
    return hits / max(len(target), len(got), 1)


def demonstration(item: PromptItem) -> str:
    return answer_of(item.prompt)
