"""Weight-sync errors. Each message names the version and, where one is involved, the bucket."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Base class: a push, pull or load that did not complete; the receiver must not serve it."""


class PlanMismatchError(WeightSyncError):
    """Sender and receiver disagree on the bucket plan (hash, tensor names, dtypes or shapes)."""


class ShortBufferError(WeightSyncError):
    """A bucket, staging segment or remote buffer is smaller than the plan says."""


class VersionRegressionError(WeightSyncError):
    """A push or pull names a version not newer than one already published / loaded."""


class SyncTimeoutError(WeightSyncError, TimeoutError):
    """A push, pull or load did not finish within weight_sync.timeout_s."""


class TornReadError(WeightSyncError):
    """The sender overwrote a slot while a receiver was reading it (the slot-reuse rule was broken)."""


class TransportError(WeightSyncError):
    """The transport failed (RDMA read, collective, shared memory); wraps the original error."""
