"""One-step word problems in chat form: a weak-start dataset for SmolLM2 (few groups with a reward spread).

    python examples/make_wordproblems.py     # rewrites examples/wordproblems_train.jsonl and wordproblems_eval.jsonl

Each row is {"question": "Mia has 34 marbles. She gets 27 more. How many marbles does Mia have now?
Put the final answer in \\boxed{}.", "answer": "61"}: read like the additions (the dataset task,
task.apply_chat_template=true, graded by pipeline.tasks.graders.math on the last \\boxed{}). Four
kinds of step (gets more, gives away, buys packs, shares equally), operands 10..99 for sums and
differences, 2..9 packs of 3..12, shares that divide evenly. The held-out file's (kind, numbers) never
appear in the train file. Deterministic (a fixed seed), so the files are byte-identical on every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 20261129
N_TRAIN = 2000
N_EVAL = 128
NAMES = ("Mia", "Liam", "Ava", "Noah", "Zoe", "Omar", "Lena", "Ravi", "Ines", "Tom", "Yuki", "Sara")
THINGS = ("marbles", "stickers", "apples", "coins", "books", "shells", "pencils", "cards")
PRONOUN = {"Mia": "She", "Ava": "She", "Zoe": "She", "Lena": "She", "Ines": "She", "Yuki": "She", "Sara": "She"}
TAIL = " Put the final answer in \\boxed{}."
HERE = Path(__file__).resolve().parent


def problem(rng: random.Random) -> tuple[tuple, str, int]:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    he = PRONOUN.get(name, "He")
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        q = f"{name} has {a} {thing}. {he} gets {b} more. How many {thing} does {name} have now?"
        return (kind, a, b), q, a + b
    if kind == 1:
        a = rng.randint(30, 99)
        b = rng.randint(10, a - 5)
        q = f"{name} has {a} {thing}. {he} gives {b} of them to a friend. How many {thing} does {name} have left?"
        return (kind, a, b), q, a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(3, 12)
        q = f"{name} buys {a} packs of {thing}. Each pack holds {b} {thing}. How many {thing} does {name} buy?"
        return (kind, a, b), q, a * b
    k, each = rng.randint(2, 9), rng.randint(3, 12)
    q = (f"{name} shares {k * each} {thing} equally among {k} friends. How many {thing} does each "
         "friend get?")
    return (kind, k, each), q, each


def main() -> None:
    rng = random.Random(SEED)
    seen: set = set()
    held, train = [], []
    while len(held) < N_EVAL or len(train) < N_TRAIN:
        key, q, ans = problem(rng)
        if key in seen:
            continue
        seen.add(key)
        (held if len(held) < N_EVAL else train).append({"question": q + TAIL, "answer": str(ans)})
    for name, rows in (("wordproblems_eval.jsonl", held), ("wordproblems_train.jsonl", train)):
        with open(HERE / name, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"{HERE / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
