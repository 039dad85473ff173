"""Built-in multi-turn task: multiply with a calculator tool. Prompt `mul 37*4=`, answer `148`.

The model may call the calculator by starting a turn with `?`: a bare `?` asks it about the question
(`37*4`), `?<expression>` about that expression (integers, + - *). The call gets the observation
`:148;` and the model takes another turn; a malformed expression gets `:error;` (a tool error the
model sees, not a crash). A turn without `?` is the final answer and ends the episode:

    prompt  mul 37*4=
    turn 1  ?<eos>              (model: trained)
    obs     :148;               (environment: masked out of the loss)
    turn 2  148<eos>            (model: trained)

Reward: the digit credit of the arithmetic task (pipeline/tasks/arith.py) for the final answer, the
text after the last observation. Two-digit times one-digit products are beyond what the tiny model
computes, so the reward rises by learning to call the tool and copy its result. The demonstration
(the warm start) is the bare call. Limits come from task.max_turns and task.max_total_tokens
(pipeline/generator/envs.py).
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from pipeline.tasks import arith
from pipeline.types import PromptItem

CALL, OBS_START, OBS_END = "?", ":", ";"
EXPR = re.compile(r"\d{1,6}([*+-]\d{1,6})*")


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + 97 + (1_000_003 if split == "eval" else 0))
    uid = 0
    while True:
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        yield PromptItem(uid=uid, prompt=f"mul {a}*{b}=", answer=str(a * b))
        uid += 1


def expression_of(prompt: str) -> str:
    if not (prompt.startswith("mul ") and prompt.endswith("=") and EXPR.fullmatch(prompt[4:-1])):
        raise ValueError(f"calc task: malformed prompt {prompt!r}")
    return prompt[4:-1]


def calculate(expr: str) -> str:
    """The calculator: integers with + - *; anything else is an error string, never an exception."""
    expr = expr.strip()
    if not EXPR.fullmatch(expr):
        return "error"
    terms = []  # sums of products, left to right; leading zeros are fine ("08" is 8)
    for sign, term in re.findall(r"([+-]?)([\d*]+)", expr):
        value = 1
        for factor in term.split("*"):
            value *= int(factor)
        terms.append(-value if sign == "-" else value)
    return str(sum(terms))


class Calculator:
    """The environment of one rollout (pipeline/generator/envs.py)."""

    def __init__(self, item: PromptItem) -> None:
        self.item = item

    def step(self, turn: str) -> str | None:
        turn = turn.strip()
        if not turn.startswith(CALL):
            return None  # a final answer
        expr = turn[len(CALL):].strip() or expression_of(self.item.prompt)  # bare `?`: the question
        return f"{OBS_START}{calculate(expr)}{OBS_END}"


def env(item: PromptItem) -> Calculator:
    return Calculator(item)


def final_answer(transcript: str) -> str:
    return transcript.rsplit(OBS_END, 1)[-1].strip()


def reward(prompt: str, completion: str) -> float:
    return arith.digit_credit(calculate(expression_of(prompt)), final_answer(completion))


def demonstration(item: PromptItem) -> list[str]:
    """Model turn, observation, model turn: the bare tool call, its result, the answer."""
    result = calculate(expression_of(item.prompt))
    return [CALL, f"{OBS_START}{result}{OBS_END}", result]
