"""The transport interface every weight-sync transport implements (shm.py, rdma.py, collective.py).

A transport moves the bytes of one packed version from the sender's slot to a place the receiver's
vLLM engine process can map:

    sender side   SenderTransport: owns the two slots (header + flat bytes each); `send(slot, v)`
                  runs after the slot is packed and published (collective broadcasts here; pull
                  transports do nothing).
    receiver side ReceiverTransport: `fetch(v)` returns the name of a shared-memory segment whose
                  header publishes v (its own staging segment, or for shm the sender's slot itself).

WeightSender / WeightReceiver (sender.py, receiver.py) pick the implementation from
`WeightSyncConfig.transport`; the implementations import this module, never each other.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import torch

from pipeline.weightsync.errors import SyncTimeoutError, VersionRegressionError
from pipeline.weightsync.plan import BucketPlan

NUM_SLOTS = 2


@dataclass
class Slot:
    header: torch.Tensor  # int64[8], see shm.py for the word layout
    data: torch.Tensor  # uint8[plan.total_bytes]


@dataclass(frozen=True)
class SyncHandle:
    """Everything a receiver needs, sent once from the sender to every generator (picklable)."""

    kind: str
    plan: BucketPlan
    num_receivers: int
    timeout_s: float
    info: dict[str, Any] = field(default_factory=dict)


class SenderTransport(ABC):
    kind: str

    def __init__(self, plan: BucketPlan, num_receivers: int, cfg) -> None:
        self.plan, self.num_receivers, self.cfg = plan, num_receivers, cfg
        self.slots: list[Slot] = []

    @abstractmethod
    def handle_info(self) -> dict[str, Any]:
        """Transport handles for the SyncHandle (segment names, RDMABuffers, rendezvous address)."""

    async def send(self, slot: int, version: int, timeout_s: float) -> None:
        """Move a packed, published slot to the receivers. Pull transports have nothing to do."""

    def close(self) -> None:
        pass


class ReceiverTransport(ABC):
    def __init__(self, handle: SyncHandle, rank: int) -> None:
        self.handle, self.plan, self.rank = handle, handle.plan, rank

    @abstractmethod
    async def fetch(self, version: int, timeout_s: float) -> str:
        """Bring `version` into a mappable segment and return its name; raise on any failure."""

    def close(self) -> None:
        pass


async def wait_for_version(read_versions: Callable[[], Awaitable[list[int]]], version: int, timeout_s: float,
                           where: str) -> int:
    """Index of the slot that publishes `version`, waiting for the sender to publish it.

    Pull transports have no cross-process notification channel; the slot headers are the
    publication point, so we re-read them with bounded backoff (1 ms .. 50 ms) until the deadline.
    """
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while True:
        versions = await read_versions()
        if version in versions:
            return versions.index(version)
        if min(versions) > version:
            raise VersionRegressionError(f"version {version}: {where} already hold newer versions {versions}")
        if time.monotonic() >= deadline:
            raise SyncTimeoutError(f"version {version}: not published by the sender within {timeout_s:.1f}s "
                                   f"({where} hold versions {versions}; bucket 0 never became readable)")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
