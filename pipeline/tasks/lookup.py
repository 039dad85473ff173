"""Built-in multi-turn task: look a key's code up with a tool and copy it. Prompt `key qmz=`, answer
the three-digit code the tool gives for `qmz`.

The codes are a fixed pseudo-random table over 17,576 three-letter keys (from the key alone, the
same in every process), so the model cannot work one out: the only way to the reward is to call the
tool and copy what it returns. A turn starting with `?` calls it (a bare `?` about the question's key,
`?abc` about any key) and gets `:417;`; a malformed key gets `:error;`. Any other turn is the final
answer and ends the episode:

    prompt  key qmz=
    turn 1  ?<eos>              (model: trained)
    obs     :417;               (environment: masked out of the loss)
    turn 2  417<eos>            (model: trained)

Reward: the digit credit of the arithmetic task (pipeline/tasks/arith.py: 1 for the exact code, else
0.9 x the share of right digits) for the final answer, the text after the last observation. The
demonstration (the warm start) is the call, its result and the copy. Compare pipeline/tasks/calc.py,
where the tiny model can guess part of a product; here nothing but the tool's output helps.
"""

from __future__ import annotations

import random
import re
import string
from typing import Iterator

from pipeline.tasks import arith
from pipeline.tasks.calc import ToolEnv, final_answer  # one tool-call syntax for both tool tasks
from pipeline.types import PromptItem

KEY = re.compile(r"[a-z]{3}")


def code_of(key: str) -> str:
    """The table: a three-digit code drawn from the key alone (a str seed is hashed with SHA-512)."""
    return str(random.Random(f"lookup/{key}").randint(100, 999))


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + 53 + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        yield PromptItem(uid=uid, prompt=f"key {key}=", answer=code_of(key))
        uid += 1


def key_of(prompt: str) -> str:
    if not (prompt.startswith("key ") and prompt.endswith("=") and KEY.fullmatch(prompt[4:-1])):
        raise ValueError(f"lookup task: malformed prompt {prompt!r}")
    return prompt[4:-1]


def lookup(key: str) -> str:
    """The tool: a key's code, or `error` for anything but three lowercase letters (never raises)."""
    key = key.strip()
    return code_of(key) if KEY.fullmatch(key) else "error"


def env(item: PromptItem) -> ToolEnv:
    return ToolEnv(item, lookup, key_of)


def reward(prompt: str, completion: str) -> float:
    return arith.digit_credit(code_of(key_of(prompt)), final_answer(completion))


def demonstration(item: PromptItem) -> list[str]:
    """The bare tool call, its result, the copy."""
    return env(item).demonstration()
