"""Built-in task: add two single-digit numbers. Prompt `7+8=`, answer `15` (one or two tokens).

Partial credit: 1 for the exact sum, else the fraction of right digits (aligned from the right)
scaled down by any length error; non-digits score 0. The rewards and `answer_of` take any
non-negative operands (the boxed task asks for two-digit sums).

The whole problem space is 100 sums, so held-out prompts are other draws from the same table: the
task measures learning an exact table with multi-token answers, not generalisation. Two-digit
operands (sums with carries) were tried: the tiny default model gained only +0.08 held-out reward
in 800 steps (docs/results/task-sweep.md).
"""

from __future__ import annotations

import random
from typing import Iterator

from pipeline.types import PromptItem

MAX_OPERAND = 9


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        yield PromptItem(uid=uid, prompt=f"{a}+{b}=", answer=str(a + b))
        uid += 1


def answer_of(prompt: str) -> str:
    lhs, eq, rest = prompt.partition("=")
    a, plus, b = lhs.partition("+")
    if not (eq and plus and a.isdigit() and b.isdigit() and rest == ""):
        raise ValueError(f"arith task: malformed prompt {prompt!r}")
    return str(int(a) + int(b))


def reward(prompt: str, completion: str) -> float:
    return digit_credit(answer_of(prompt), completion)


def digit_credit(target: str, completion: str) -> float:
    """1 for `target` exactly, else the fraction of right digits (aligned from the right) scaled down by
    any length error; 0 for anything but digits."""
    got = completion.strip()
    if got == target:
        return 1.0
    if not got.isdigit():
        return 0.0
    hits = sum(1 for x, y in zip(reversed(got), reversed(target)) if x == y)
    return 0.9 * hits / max(len(target), len(got))


def demonstration(item: PromptItem) -> str:
    return answer_of(item.prompt)
