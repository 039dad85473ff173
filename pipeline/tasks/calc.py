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
from typing import Callable, Iterator

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


class ToolEnv:
    """The environment of one rollout of a one-tool task (pipeline/generator/envs.py): a turn that starts
    with CALL calls `tool` on the text after it (a bare CALL: on `question(prompt)`) and is answered
    with the result between OBS_START and OBS_END; any other turn is the final answer. The calc and
    lookup tasks share it, and with it one tool-call syntax."""

    def __init__(self, item: PromptItem, tool: Callable[[str], str], question: Callable[[str], str]) -> None:
        self.item, self.tool, self.question = item, tool, question

    def step(self, turn: str) -> str | None:
        turn = turn.strip()
        if not turn.startswith(CALL):
            return None  # a final answer
        arg = turn[len(CALL):].strip() or self.question(self.item.prompt)  # bare `?`: the question's
        return f"{OBS_START}{self.tool(arg)}{OBS_END}"

    def demonstration(self) -> list[str]:
        """Model turn, observation, model turn: the bare tool call, its result, the result as the answer."""
        result = self.tool(self.question(self.item.prompt))
        return [CALL, f"{OBS_START}{result}{OBS_END}", result]


def env(item: PromptItem) -> ToolEnv:
    return ToolEnv(item, calculate, expression_of)


def final_answer(transcript: str) -> str:
    return transcript.rsplit(OBS_END, 1)[-1].strip()


def reward(prompt: str, completion: str) -> float:
    return arith.digit_credit(calculate(expression_of(prompt)), final_answer(completion))


def demonstration(item: PromptItem) -> list[str]:
    """The bare tool call, its result, the answer."""
    return env(item).demonstration()
