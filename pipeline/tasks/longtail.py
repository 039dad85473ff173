"""Benchmark workload: the reverse task with a long-tail (lognormal) generation budget per prompt.

Run with `generator.ignore_eos=true` so every completion uses its whole budget: response lengths
then follow LogNormal(log(median), sigma) capped at `generator.max_new_tokens`, the shape that makes
synchronous batching wait on its slowest sample. Used by tools/bench/pipeline_bench.py.
"""

from __future__ import annotations

import math
import random
from typing import Iterator

from pipeline.tasks import reverse
from pipeline.types import PromptItem

MEDIAN_TOKENS = 12
SIGMA = 1.0


def prompts(seed: int, split: str) -> Iterator[PromptItem]:
    rng = random.Random(seed + 17)
    for item in reverse.prompts(seed, split):
        budget = max(1, round(math.exp(rng.gauss(math.log(MEDIAN_TOKENS), SIGMA))))
        yield PromptItem(uid=item.uid, prompt=item.prompt, answer=item.answer, max_new_tokens=budget)


reward = reverse.reward
demonstration = reverse.demonstration
