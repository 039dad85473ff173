"""The trainer's errors, for the driver that tells a skipped step from a fatal one.

A refused batch raises BadBatchError before the weights are touched; a batch with nothing to train on
(EmptyBatchError) and a non-finite loss or gradient norm (NonFiniteLossError) are skipped steps: the
version stays and the driver gives the batch back. NonFiniteWeightsError and TooManySkippedSteps end
the run. `skipped_step_error` recognises the skippable ones in-process or through an actor call.

Example:
    try:
        metrics = await trainer.train_step(batch)
    except Exception as e:
        if (why := skipped_step_error(e)) is None:
            raise                      # a bug, corrupt weights, or too many skips: the run stops
        buffer.skip_batch(ids)         # `why` says what was skipped and why
"""

from __future__ import annotations


class BadBatchError(ValueError):
    """A batch the trainer refuses; the weights were not touched."""


class EmptyBatchError(BadBatchError):
    """A well-formed batch with nothing to train on (no loss tokens): the step is skipped."""


class NonFiniteLossError(FloatingPointError):
    """An optimizer step's loss or gradient norm was NaN/inf; that step's weight update was not
    applied and the version does not advance: the step is skipped (see TrainCore.train_step). With
    several minibatches, the steps of the same batch before it stay applied (nothing is snapshotted)."""


class NonFiniteWeightsError(FloatingPointError):
    """A parameter holds NaN/inf after an optimizer step: the weights are corrupt and must never be
    pushed or saved. Not a skipped step; the run stops."""


class TooManySkippedSteps(RuntimeError):
    """trainer.max_skipped_steps steps in a row were skipped; the run stops."""


def skipped_step_error(err: BaseException) -> BaseException | None:
    """The trainer's reason for skipping a step if `err` is one (NonFiniteLossError, EmptyBatchError),
    raised in-process or arriving through an actor call as Monarch's ActorError, which carries the
    original exception, unpickled with its type, as `.exception`; None for any other error."""
    inner = getattr(err, "exception", err)
    return inner if isinstance(inner, (NonFiniteLossError, EmptyBatchError)) else None
