"""Synthetic RL batches for benchmarks and device checks (tools/bench/trainer_bench.py, tools/probe/gpu_check.py):
random tokens in the Batch layout, a prompt of `prompt_len` tokens then a completion that carries the
loss, random advantages, and sampler log-probs either random or the learner's own plus noise.

Example:
    batch = synthetic_batch(32, 128, 32, vocab, seed=0)                        # random sampler logprobs
    score = lambda ids: batches.logprobs(core.model, ids.to(core.device), core.temperature, core.chunk)[0]
    batch = synthetic_batch(32, 128, 32, vocab, seed=0, score=score)          # on-policy: ratios near 1
    batch = ragged_batch(32, 58, [12, 96, 30, ...], vocab, seed=0)            # completions of these lengths, right-padded
"""

from __future__ import annotations

from typing import Callable

import torch

from pipeline.types import Batch


def synthetic_batch(n: int, t: int, prompt_len: int, vocab: int, seed: int,
                    score: Callable[[torch.Tensor], torch.Tensor] | None = None, mu_noise: float = 0.1) -> Batch:
    """N samples of T tokens (ids in [4, vocab)), completions from `prompt_len` on, trainer_version 0.
    Sampler log-probs: `score(ids)` ([N, T-1] log-probs of ids[:, 1:], any device) plus Gaussian noise
    of `mu_noise`, clamped at 0; without `score`, uniform in (-4, 0]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (n, t), generator=g)
    mask = torch.zeros(n, t)
    mask[:, prompt_len:] = 1
    if score is None:
        beh = -torch.rand(n, t, generator=g) * 4 * mask
    else:
        with torch.no_grad():
            lp = score(ids).detach().float().cpu()
        beh = torch.zeros(n, t)
        beh[:, 1:] = (lp + mu_noise * torch.randn(lp.shape, generator=g)).clamp(max=0) * mask[:, 1:]
    adv = torch.randn(n, generator=g)
    return Batch(ids, mask, beh, torch.where(mask > 0, 0, -1).long(), adv, adv.clone(), tuple(range(n)), 0)


def ragged_batch(n: int, prompt_len: int, lengths: list[int], vocab: int, seed: int) -> Batch:
    """N samples of a `prompt_len`-token prompt and a completion whose length is drawn from `lengths`
    (with replacement, by `seed`), right-padded to the longest (pad id 0) as the replay buffer pads a
    batch; random sampler log-probs in (-2, 0] on the completion, random advantages."""
    g = torch.Generator().manual_seed(seed)
    lens = [lengths[int(i)] for i in torch.randint(len(lengths), (n,), generator=g)]
    t = prompt_len + max(lens)
    ids = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t)
    for i, c in enumerate(lens):
        ids[i, :prompt_len + c] = torch.randint(4, vocab, (prompt_len + c,), generator=g)
        mask[i, prompt_len:prompt_len + c] = 1
    beh = -torch.rand(n, t, generator=g) * 2 * mask
    adv = torch.randn(n, generator=g)
    return Batch(ids, mask, beh, torch.where(mask > 0, 0, -1).long(), adv, adv.clone(), tuple(range(n)), 0)
