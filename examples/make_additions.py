"""Two-number additions in chat form, written for this project: a train file and a disjoint held-out file.

    python examples/make_additions.py        # rewrites examples/additions_train.jsonl and additions_eval.jsonl

Each row is {"question": "What is 17 + 25? Put the final answer in \\boxed{}.", "answer": "42"}: the
dataset task (pipeline/tasks/dataset.py) reads `question` as a user turn through the checkpoint's chat
template (task.apply_chat_template=true) and grades the completion's last \\boxed{} against `answer`
with math-verify (pipeline.tasks.graders.math; configs/smollm2-135m-add.yaml takes the last number of a
completion without a box too: pipeline.tasks.graders.math_last_number).

Operands are 10..99 (sums 20..198). The phrasing varies over a few templates that all state the answer
format. The held-out file takes its pairs first and the train file never uses them in either order, so
no held-out sum is seen in training as the same two numbers. Deterministic: a fixed seed and Python's
`random.Random`, so the files are byte-identical on every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20240917
N_TRAIN = 2000
N_EVAL = 128
LO, HI = 10, 99
TEMPLATES = (
    "What is {a} + {b}? Put the final answer in \\boxed{{}}.",
    "Compute {a} + {b}. Put the final answer in \\boxed{{}}.",
    "What is the sum of {a} and {b}? Give the final answer in \\boxed{{}}.",
    "Add {a} and {b}. Write the final answer in \\boxed{{}}.",
    "Calculate {a} plus {b}. Put your final answer in \\boxed{{}}.",
)
HERE = Path(__file__).resolve().parent


def rows(pairs: list[tuple[int, int]], rng: random.Random) -> list[dict]:
    return [{"question": rng.choice(TEMPLATES).format(a=a, b=b), "answer": str(a + b)} for a, b in pairs]


def main() -> None:
    rng = random.Random(SEED)
    unordered = [(a, b) for a in range(LO, HI + 1) for b in range(a, HI + 1)]  # a <= b
    rng.shuffle(unordered)
    held, train = unordered[:N_EVAL], unordered[N_EVAL:N_EVAL + N_TRAIN]
    orient = lambda p: p if rng.random() < 0.5 else (p[1], p[0])  # noqa: E731  (either order in the prompt)
    for name, pairs in (("additions_eval.jsonl", held), ("additions_train.jsonl", train)):
        with open(HERE / name, "w") as f:
            for r in rows([orient(p) for p in pairs], rng):
                f.write(json.dumps(r) + "\n")
        print(f"{HERE / name}: {len(pairs)} rows")


if __name__ == "__main__":
    main()
