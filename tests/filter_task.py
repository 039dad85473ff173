"""A stand-in task for tests/test_difficulty.py's CLI run: half its prompts always pay the same.

8 prompts (a finite split, served in epochs). The `easy` ones pay 1.0 whatever the completion, so
every group of them has equal rewards and the difficulty filter sets them aside; the others pay a
hash of the completion (an untrained policy's completions differ, so their groups carry signal).

    python -m pipeline.run --config configs/tiny.yaml task.name=tests.filter_task run.eval_every=0 ...
"""

from __future__ import annotations

from pipeline.types import PromptItem

WORDS = ("abc", "bad", "cab", "dab", "fed", "gag", "hag", "ace")
PROMPTS = tuple(PromptItem(uid=i, prompt=f"{'easy' if i % 2 else 'rev'} {w}=") for i, w in enumerate(WORDS))


def prompts(seed: int, split: str) -> tuple[PromptItem, ...]:
    return PROMPTS


def reward(prompt: str, completion: str) -> float:
    return 1.0 if prompt.startswith("easy") else sum(map(ord, completion)) % 8 / 8
