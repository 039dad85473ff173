"""Built-in task: add two small numbers. Prompt `12+7=`, answer `19`.

Partial credit: 1 for the exact sum, else the fraction of right digits (aligned from the right)
scaled down by any length error; non-digits score 0.
"""

from __future__ import annotations

import random
from typing import Iterator

from pipeline.types import PromptItem


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        yield PromptItem(uid=uid, prompt=f"{a}+{b}=", answer=str(a + b))
        uid += 1


def answer_of(prompt: str) -> str:
    lhs, eq, rest = prompt.partition("=")
    a, plus, b = lhs.partition("+")
    if not (eq and plus and a.isdigit() and b.isdigit() and rest == ""):
        raise ValueError(f"arith task: malformed prompt {prompt!r}")
    return str(int(a) + int(b))


def reward(prompt: str, completion: str) -> float:
    target = answer_of(prompt)
    got = completion.strip()
    if got == target:
        return 1.0
    if not got.isdigit():
        return 0.0
    hits = sum(1 for x, y in zip(reversed(got), reversed(target)) if x == y)
    return 0.9 * hits / max(len(target), len(got))


def demonstration(item: PromptItem) -> str:
    return answer_of(item.prompt)
