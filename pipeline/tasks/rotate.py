"""Built-in 0/1-reward task: rotate a short string left by one. Prompt `rot abcd=`, answer `bcda`.

Exact answer or nothing: reward 1 for the rotated string exactly (surrounding spaces ignored), else 0,
as math graders and unit tests pay. So a group has a reward spread only when some of its samples
are exactly right and some are not; a policy that never (or always) gets a prompt right gives GRPO
nothing there, which is what the warm start and the difficulty filter are for (docs/training.md).
The skill itself (copy three or four letters, the first moved to the end) is within the tiny model's
reach: the demonstration is the answer. Train and eval strings come from disjoint random streams.
"""

from __future__ import annotations

import random
from typing import Iterator

from pipeline.types import PromptItem

ALPHABET = "abcdefgh"
MIN_LEN, MAX_LEN = 3, 4


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + 31 + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        yield PromptItem(uid=uid, prompt=f"rot {s}=", answer=s[1:] + s[0])
        uid += 1


def answer_of(prompt: str) -> str:
    s = prompt[4:-1]
    if not (prompt.startswith("rot ") and prompt.endswith("=") and s.isalpha()):
        raise ValueError(f"rotate task: malformed prompt {prompt!r}")
    return s[1:] + s[0]


def reward(prompt: str, completion: str) -> float:
    return 1.0 if completion.strip() == answer_of(prompt) else 0.0


def demonstration(item: PromptItem) -> str:
    return answer_of(item.prompt)
