"""The rows of a training step: minibatches and micro-batches (`minibatch_rows`, `minibatch_plan`), the
tokens a row's loss needs (`spans`) and per-token log-probs (`logprobs`); TrainCore (step.py) runs the
steps over them, as its module docstring describes.
"""

from __future__ import annotations

import hashlib
import math

import torch

from pipeline.trainer import chunked
from pipeline.trainer.snapshots import Plan

__all__ = ["minibatch_rows", "minibatch_plan", "logprobs", "spans"]


def minibatch_rows(n: int, minibatches: int, epochs: int, seed: int, version: int) -> list[list[torch.Tensor]]:
    """Per epoch, the global rows of each of its minibatches: a permutation of range(n), drawn anew
    each epoch, cut into `minibatches` near-equal parts (`tensor_split`), each in increasing row order.
    The draws come from a generator seeded with (seed, version) alone, never the global RNG, so every
    data-parallel rank and a resumed or repeated run get the same minibatches. Rows are shuffled one by
    one: the advantages are per row already (the buffer's group baselines), and each minibatch's loss
    denominators are its own. One minibatch: the whole batch in order every epoch (no draw)."""
    if minibatches == 1:
        return [[torch.arange(n)] for _ in range(epochs)]
    # torch's CPU generator keeps 32 bits of its seed: (seed, version) is hashed down to them
    key = hashlib.blake2b(f"minibatches:{seed}:{version}".encode(), digest_size=4).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    return [[mb.sort().values for mb in torch.tensor_split(torch.randperm(n, generator=g), minibatches)]
            for _ in range(epochs)]


def minibatch_plan(n: int, minibatches: int, world: int, rank: int, micro_batch_size: int,
                   lengths: torch.Tensor | None = None, split: list[torch.Tensor] | None = None) -> Plan:
    """Per minibatch: (its global row indices, this rank's micro-batches as (rows, weight)).
    `split`: the minibatches' global rows (`minibatch_rows`); default `tensor_split(range(n), minibatches)`.

    Weight 0 marks a padding micro-batch (one dummy row): its count depends only on the global
    minibatch size, so every rank runs the same number of forwards and backwards per step.
    `lengths` [n] (`spans`): when there is more than one micro-batch, this rank's rows of a minibatch
    are ordered longest first before they are cut, so each micro-batch holds rows of like length and
    its forward is cut to its longest row (`TrainCore._logprobs`). The sums over micro-batches do not
    depend on their order or make-up: the loss denominators are the minibatch's.
    """
    plan = []
    for mb in torch.tensor_split(torch.arange(n), minibatches) if split is None else split:
        rows = torch.tensor_split(mb, world)[rank]
        most = math.ceil(len(mb) / world)
        k = max(1, math.ceil(most / (micro_batch_size or max(most, 1))))
        if lengths is not None and k > 1 and len(rows) > 1:
            rows = rows[torch.sort(lengths[rows], descending=True, stable=True).indices]
        chunks = torch.tensor_split(rows, k) if len(rows) else [rows] * k
        plan.append((mb, [(c, 1.0) if len(c) else (torch.zeros(1, dtype=torch.long), 0.0) for c in chunks]))
    return plan


def logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float, chunk: int = 0,
             entropy: str = "", positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of ids[:, 1:] under softmax(logits / temperature), and (entropy "value" or
    "grad") its per-token entropy; chunk > 0 never builds the [tokens, vocab] logits, and with
    `positions` runs the output head on those tokens only (chunked.py)."""
    return chunked.logprobs(model, ids, temperature, chunk, entropy, positions)


def spans(loss_mask: torch.Tensor) -> torch.Tensor:
    """Per row of a Batch's loss_mask [N, T]: how many leading tokens its loss needs (its last loss
    token's index + 1; 1 for a row without loss tokens). A causal model's log-prob of a token depends
    on the tokens up to it only, so the tokens after that (right padding, trailing environment
    tokens) can be cut off without changing any loss term or gradient."""
    cols = torch.arange(1, loss_mask.shape[1] + 1)
    return ((loss_mask > 0) * cols).amax(dim=1).clamp(min=1)
