"""Input checks the trainer runs before a batch touches the weights (Batch.__post_init__ already
checks shapes). Each failure raises BadBatchError naming the field and what is wrong; a batch with no
loss tokens (every completion empty) raises its subclass EmptyBatchError, which the trainer treats
as a skipped step rather than a bug (pipeline/trainer/errors.py). Pure functions of their inputs;
they read no trainer state.

Example:
    check_batch(batch, vocab_size)               # TrainCore.train_step, first thing
    check_sft(input_ids, loss_mask, vocab_size)  # TrainCore.sft_step
"""

from __future__ import annotations

import torch

from pipeline.trainer.errors import BadBatchError, EmptyBatchError
from pipeline.types import Batch


def _finite(name: str, x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x)
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise BadBatchError(f"trainer: batch.{name} has {int(bad.sum())} non-finite value(s), "
                            f"first at index {where}: {x[tuple(where)].item()}")


def _ids_and_mask(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] < 2:
        raise BadBatchError(f"trainer: input_ids must be [N >= 1, T >= 2], got {tuple(input_ids.shape)}")
    if tuple(loss_mask.shape) != tuple(input_ids.shape):
        raise BadBatchError(f"trainer: loss_mask has shape {tuple(loss_mask.shape)}, "
                            f"expected {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise BadBatchError(f"trainer: input_ids dtype {input_ids.dtype}, expected an integer dtype")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise BadBatchError(f"trainer: input_ids hold ids in [{lo}, {hi}], outside the vocabulary [0, {vocab_size})")
    if not torch.all((loss_mask == 0) | (loss_mask == 1)):
        raise BadBatchError("trainer: loss_mask must hold only 0 and 1")
    if float(loss_mask[:, 1:].sum()) == 0:
        raise EmptyBatchError("trainer: batch has no loss tokens (loss_mask[:, 1:] is all zero); "
                            "position 0 can never be a trained token")


def check_batch(batch: Batch, vocab_size: int) -> None:
    """Refuse empty batches, NaN/inf logprobs, advantages or rewards, bad ids and masks."""
    if not isinstance(batch, Batch):
        raise BadBatchError(f"trainer: expected pipeline.types.Batch, got {type(batch).__name__}")
    _ids_and_mask(batch.input_ids, batch.loss_mask, vocab_size)
    _finite("behaviour_logprobs", batch.behaviour_logprobs)
    _finite("advantages", batch.advantages)
    if batch.teacher_logprobs is not None:
        _finite("teacher_logprobs", batch.teacher_logprobs)
    _finite("rewards", batch.rewards)
    on = batch.loss_mask[:, 1:] > 0
    if bool((batch.behaviour_logprobs[:, 1:][on] > 1e-4).any()):
        raise BadBatchError("trainer: batch.behaviour_logprobs has positive values on loss tokens "
                            "(logprobs must be <= 0)")


def check_sft(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> None:
    """Refuse bad demonstration ids and masks, and demonstrations with no loss tokens."""
    _ids_and_mask(input_ids, loss_mask, vocab_size)
