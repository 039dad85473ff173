"""Built-in task: reverse a short lowercase string. Prompt `rev abc=`, answer `cba`.

Partial credit: the fraction of answer positions that are right, scaled down by any length error.
Train and eval prompts come from disjoint random streams (eval strings have a `seed+10^6` stream).
"""

from __future__ import annotations

import random
from typing import Iterator

from pipeline.types import PromptItem

ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 5


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        yield PromptItem(uid=uid, prompt=f"rev {s}=", answer=s[::-1])
        uid += 1


def answer_of(prompt: str) -> str:
    if not (prompt.startswith("rev ") and prompt.endswith("=")):
        raise ValueError(f"reverse task: malformed prompt {prompt!r}")
    return prompt[4:-1][::-1]


def reward(prompt: str, completion: str) -> float:
    target = answer_of(prompt)
    got = completion.strip()
    hits = sum(1 for a, b in zip(got, target) if a == b)
    return hits / max(len(target), len(got), 1)


def demonstration(item: PromptItem) -> str:
    return answer_of(item.prompt)
