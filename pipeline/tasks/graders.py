"""Graders: `grade(completion, reference) -> float` in [0, 1], named in config by dotted path
(`task.grader`, used by pipeline.tasks.dataset).

    from pipeline.tasks.graders import load_grader
    grade = load_grader("pipeline.tasks.graders.math")
    grade("3 + 4 = 7, so she has \\boxed{7} apples.", "She has 3 + 4 = 7.\\n#### 7")   # 1.0
    grade("3 + 4 = 7, so she has 7 apples.", "#### 7")                               # 0.0: no box

A reference may be a bare answer (`72`, `\\frac{1}{2}`) or a GSM8K-style solution ending in
`#### 72`: the text after the last `####` is the answer (`final_answer`).

`math`: the completion's answer is the content of its last complete `\\boxed{...}`, the format the
prompt asks for (the data's own words, or task.instruction: "Put the final answer in \\boxed{}.");
a completion without one has no answer and scores 0.0, whatever numbers it holds. The answer scores
1.0 when math-verify (`parse`, `verify`) finds it equal to the reference's answer (so `1,000` =
`1000`, `0.5` = `1/2` = `\\frac{1}{2}`, `18` = `\\$18`), else 0.0.
`math_last_number`: the same, but a completion without a box is read for its last number (`1,000`,
`-3`, `0.5`, `1/2`; thousands commas dropped). Named only where a run wants that: a number written
after the answer (a check, a restated quantity) is then taken for it.
A reference math-verify cannot parse (an empty one, `#### ` with nothing after it) raises ValueError:
the reward path rejects it as reward_raised (task.max_reject_frac) instead of scoring it 0. Words
parse as products of symbols, so a text answer is compared as such: use `exact` for text.
math-verify's own timeouts use SIGALRM, which works only on the main thread; rewards run on worker
threads (pipeline/generator/rewards.py), so they are off here and task.reward_timeout_s bounds a call.

`exact`: 1.0 when the stripped completion equals the reference's answer, else 0.0.
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Callable

from math_verify import LatexExtractionConfig, parse, verify

from pipeline.tasks import TaskError

__all__ = ["Grader", "math", "math_last_number", "exact", "final_answer", "completion_answer", "last_boxed",
           "boxed_solution", "load_grader"]

Grader = Callable[[str, str], float]

# A number: optional sign (not a minus between two operands: "10-4" ends in 4), digits with
# optional thousands commas, an optional decimal part and an optional "/denominator".
NUMBER = re.compile(r"(?<![\w.)])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?<![\w.)-])-?\.\d+")
BOXED = "\\boxed"


class _TimeoutOffNotice(logging.Filter):
    """Drops math-verify's once-per-process warning that its timeouts are off: they are off on
    purpose and task.reward_timeout_s bounds every call (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimeoutOffNotice())


def final_answer(reference: str) -> str:
    """The answer of a reference: the text after its last `####` (GSM8K), else all of it; stripped."""
    return reference.rpartition("####")[2].strip() if "####" in reference else reference.strip()


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` (nested braces kept), or None."""
    start = text.rfind(BOXED + "{")
    while start >= 0:
        depth, i = 0, start + len(BOXED)
        for i in range(start + len(BOXED), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len(BOXED) + 1:i]
        start = text.rfind(BOXED + "{", 0, start)  # unclosed (cut off): an earlier one
    return None


def last_number(text: str) -> str | None:
    """The last number in `text` with thousands commas dropped (`1,000` -> `1000`), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def completion_answer(completion: str) -> str | None:
    """What `math_last_number` grades: the last boxed content, else the last number, else None."""
    boxed = last_boxed(completion)
    return boxed if boxed is not None else last_number(completion)


def boxed_solution(solution: str) -> str:
    """A GSM8K-style worked solution with its final `#### N` line written as `\\boxed{N}`, the answer
    the math graders read (what a warm start on it teaches); a solution without `####` as it is."""
    if "####" not in solution:
        return solution
    steps = solution.rpartition("####")[0].rstrip()
    return f"{steps}\n{BOXED}{{{final_answer(solution)}}}" if steps else f"{BOXED}{{{final_answer(solution)}}}"


def _parse(answer: str) -> list:
    # timeouts off: see the module docstring (SIGALRM is main-thread only)
    return parse(f"${BOXED}{{{answer}}}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


def _same(got: str | None, reference: str) -> float:
    """1.0 when math-verify finds answer `got` equal to the reference's answer; ValueError when the
    reference has none it can parse."""
    ref = final_answer(reference)
    gold = _parse(ref.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", ref) else ref)
    if not gold:
        raise ValueError(f"math grader: cannot parse the reference answer {ref[:80]!r}")
    if got is None:
        return 0.0
    pred = _parse(got)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0


def math(completion: str, reference: str) -> float:
    """The last complete \\boxed{} against the reference; no box, no answer (module docstring)."""
    return _same(last_boxed(completion), reference)


def math_last_number(completion: str, reference: str) -> float:
    """`math`, reading a completion without a box for its last number (module docstring)."""
    return _same(completion_answer(completion), reference)


def exact(completion: str, reference: str) -> float:
    return 1.0 if completion.strip() == final_answer(reference) else 0.0


def load_grader(path: str) -> Grader:
    """The callable at dotted `path` (`module.function`); TaskError naming the key if there is none."""
    mod_path, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_path), attr) if mod_path else None
    except ImportError as e:
        raise TaskError(f"task.grader={path!r}: cannot import {mod_path!r}: {e}") from None
    except AttributeError:
        raise TaskError(f"task.grader={path!r}: module {mod_path!r} has no {attr!r}") from None
    if not callable(fn):
        raise TaskError(f"task.grader={path!r}: not a callable; a grader is grade(completion, reference) -> float "
                        "(e.g. pipeline.tasks.graders.math)")
    return fn
