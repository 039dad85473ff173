"""Built-in task: format following. Add two numbers and give the sum in parentheses, the way math
tasks ask for a boxed final answer. Prompt `box 12+7=`, answer `(19)`.

Reward: 0.3 for the format alone (the completion is `(`, digits, `)` and nothing else), plus 0.7 times
the arithmetic task's credit for the digits inside; an unformatted right sum gets only 0.3 of the
arithmetic credit, so the format is worth learning.
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from pipeline.tasks import arith
from pipeline.types import PromptItem

FORMAT = re.compile(r"\((\d+)\)")


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + 53 + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        yield PromptItem(uid=uid, prompt=f"box {a}+{b}=", answer=f"({a + b})")
        uid += 1


def sum_of(prompt: str) -> str:
    """The arithmetic prompt inside (`12+7=`); ValueError if the prompt is malformed."""
    if not prompt.startswith("box "):
        raise ValueError(f"boxed task: malformed prompt {prompt!r}")
    arith.answer_of(prompt[4:])
    return prompt[4:]


def answer_of(prompt: str) -> str:
    return f"({arith.answer_of(sum_of(prompt))})"


def reward(prompt: str, completion: str) -> float:
    sum_prompt = sum_of(prompt)
    got = completion.strip()
    m = FORMAT.fullmatch(got)
    if m:
        return 0.3 + 0.7 * arith.reward(sum_prompt, m[1])
    digits = "".join(ch for ch in got if ch.isdigit())
    return 0.3 * arith.reward(sum_prompt, digits) if digits else 0.0


def demonstration(item: PromptItem) -> str:
    return answer_of(item.prompt)
