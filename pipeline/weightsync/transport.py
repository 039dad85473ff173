"""The transport interface every weight-sync transport implements (shm.py, rdma.py, collective.py).

A transport moves the bytes of one packed version from the senders' slots to a place the receiver's
vLLM engine process can map. There is one sender per trainer rank, each with its own slots holding
its own pieces of the weights (shard_plan.py); a receiver brings every rank's bytes and assembles
the whole tensors in its staging segment, in the full plan's layout (plan.py):

    sender side   SenderTransport (one per trainer rank): owns that rank's two slots (header + flat
                  bytes each); `send(slot, v)` runs after the slot is packed and published
                  (collective broadcasts here; pull transports do nothing).
    receiver side ReceiverTransport: `fetch(v)` returns the name of a shared-memory segment whose
                  header publishes v under the full plan (its own staging segment, or for shm with
                  one rank holding whole tensors, the sender's slot itself).

WeightSender / WeightReceiver (sender.py, receiver.py) pick the implementation from
`WeightSyncConfig.transport`; the implementations import this module, never each other.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable

import torch

from pipeline.weightsync import delta as dl
from pipeline.weightsync import segment as seg
from pipeline.weightsync.errors import PlanMismatchError, SyncTimeoutError, VersionRegressionError
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.shard_plan import ShardPlan

NUM_SLOTS = 2


@dataclass
class Slot:
    header: torch.Tensor  # int64[8], see segment.py for the word layout
    data: torch.Tensor  # uint8[plan.total_bytes]
    dheader: torch.Tensor | None = None  # weight_sync.delta: int64 delta header (delta.py)
    delta: torch.Tensor | None = None  # weight_sync.delta: uint8 delta buckets (delta.capacity bytes)


@dataclass(frozen=True)
class SyncHandle:
    """Everything a receiver needs, sent once from the senders to every generator (picklable).

    `plan`: the assembled layout the engine loads; `shards`: who sends what (None: one rank holding
    every tensor whole); `info["ranks"][r]`: trainer rank r's transport handles."""

    kind: str
    plan: BucketPlan
    num_receivers: int
    timeout_s: float
    info: dict[str, Any] = field(default_factory=dict)
    shards: ShardPlan | None = None

    @property
    def shard_plan(self) -> ShardPlan:
        return self.shards if self.shards is not None else ShardPlan.whole(self.plan)


def merge_handles(handles: list[SyncHandle]) -> SyncHandle:
    """One handle from every trainer rank's (in rank order): the ranks' transport handles side by side."""
    first = handles[0]
    for r, h in enumerate(handles):
        if h.shard_plan.hash != first.shard_plan.hash or h.kind != first.kind:
            raise PlanMismatchError(f"trainer rank {r} built shard plan {h.shard_plan.hash} over {h.kind}, "
                                    f"rank 0 {first.shard_plan.hash} over {first.kind}")
    return replace(first, info={"ranks": [i for h in handles for i in h.info["ranks"]]})


class SenderTransport(ABC):
    """Trainer rank `rank`'s side: slots of `shards.totals[rank]` bytes."""

    kind: str

    def __init__(self, shards: ShardPlan, rank: int, num_receivers: int, cfg) -> None:
        self.shards, self.rank, self.num_receivers, self.cfg = shards, rank, num_receivers, cfg
        self.nbytes = shards.totals[rank]
        self.slots: list[Slot] = []
        self.geometry = DeltaGeometry(shards, rank) if cfg.delta else None

    def delta_buffers(self, device: str = "cpu") -> dict:
        """A slot's delta header and buffer (Slot fields) when weight_sync.delta is on, else nothing."""
        g = self.geometry
        if g is None:
            return {}
        return {"dheader": torch.zeros(dl.header_words(len(g.spans)), dtype=torch.int64, device=device),
                "delta": torch.zeros(g.capacity, dtype=torch.uint8, device=device)}

    @abstractmethod
    def handle_info(self) -> dict[str, Any]:
        """Transport handles for the SyncHandle (segment names, RDMABuffers, rendezvous address)."""

    async def send(self, slot: int, version: int, timeout_s: float) -> None:
        """Move a packed, published slot to the receivers. Pull transports have nothing to do."""

    def close(self) -> None:
        pass


class DeltaGeometry:
    """Trainer rank `rank`'s delta layout, the same on both sides: its spans, delta bucket size and
    the capacity of a slot's delta buffer (delta.py)."""

    def __init__(self, shards: ShardPlan, rank: int) -> None:
        self.spans = dl.spans_of(shards, rank)
        self.bucket = dl.delta_bucket_bytes(shards.totals[rank], shards.bucket_bytes)
        self.capacity = dl.capacity(shards.totals[rank], self.bucket)
        self.header_words = dl.header_words(len(self.spans))

    def buckets(self, flat: torch.Tensor, nbytes: int | None = None) -> list[torch.Tensor]:
        """Views of the delta buckets in `flat`: all of its capacity, or those of a delta of `nbytes`
        (the last one cut to its length)."""
        end = self.capacity if nbytes is None else nbytes
        return [flat[a:min(a + self.bucket, end)] for a in range(0, end, self.bucket)]


class ReceiverTransport(ABC):
    """`direct`: one sender whose bytes are the full layout (no assembly); else the ranks' bytes are
    assembled into a staging segment of the receiver's own.

    Delta (weight_sync.delta; a rank whose handle carries delta buffers): `held` is the version
    every rank's bytes in the receiver's copy hold (None: no valid copy: nothing yet, or the last
    fetch failed, so the next must be full). `last` reports the last fetch: bytes moved, ranks
    applied as a delta."""

    def __init__(self, handle: SyncHandle, rank: int) -> None:
        self.handle, self.plan, self.rank = handle, handle.plan, rank
        self.shards = handle.shard_plan
        self.infos = handle.info["ranks"]
        self.direct = self.shards.identity
        # what every rank's header must carry: the receiver's own plan when one rank's bytes are loaded as they are
        self.expect = self.plan.hash_int if self.direct else self.shards.hash_int
        if len(self.infos) != self.shards.world:
            raise PlanMismatchError(f"receiver {rank}: handle names {len(self.infos)} trainer ranks, shard plan "
                                    f"{self.shards.hash} has {self.shards.world}")
        if not self.direct and self.shards.full.hash != self.plan.hash:
            raise PlanMismatchError(f"receiver {rank}: bucket plan {self.plan.hash} is not the one the shard plan "
                                    f"{self.shards.hash} assembles ({self.shards.full.hash})")
        self.geometry = [DeltaGeometry(self.shards, r) if "delta" in info else None
                         for r, info in enumerate(self.infos)]
        self.held: int | None = None
        self.last: dict[str, float] = {}

    def delta_len(self, r: int, header: torch.Tensor, held: int | None) -> int | None:
        """Wire length of the delta rank `r`'s slot header offers against version `held` (what this
        receiver's copy holds), or None: read the full bytes (no delta offered, or another base)."""
        base = int(header[seg.H_BASE])
        if self.geometry[r] is None or base == seg.EMPTY or held is None or base != held:
            return None
        return int(header[seg.H_DELTA])

    def apply_delta(self, r: int, flat: torch.Tensor, dheader: torch.Tensor, buf: torch.Tensor, version: int,
                    held: int | None) -> None:
        """Rank r's delta of `version` (its header `dheader`, buckets at `buf`) onto `flat`, which holds
        version `held`; every span checked against the trainer's checksums. DeltaError on any fault."""
        g, where = self.geometry[r], f"receiver {self.rank} (trainer rank {r}'s shard)"
        nbytes, sums = dl.read_header(dheader.cpu(), g.spans, version, held, where)
        dl.apply(g.spans, buf, nbytes, g.bucket, flat, version, where)
        dl.check(g.spans, flat, sums, version, where)

    def assemble(self, stage: seg.Segment, flats: list[torch.Tensor], version: int,
                 recheck: Callable[[], None] | None = None) -> None:
        """Every rank's bytes of `version` (headers checked) into `stage`; `recheck` (raising if a
        source was rewritten meanwhile) runs before the stage's header publishes the version."""
        seg.begin_write(stage.header)
        self.shards.assemble(flats, stage.data, version)
        if recheck is not None:
            recheck()
        seg.end_write(stage.header, version, self.plan.hash_int, self.plan.total_bytes)

    async def publish_staged(self, stage: seg.Segment, flats: list[torch.Tensor] | None,
                             deltas: list[int | None], dheads: list[torch.Tensor], dflats: list[torch.Tensor],
                             version: int, held: int | None) -> None:
        """Finish a fetch whose bytes have landed: apply each rank's delta (deltas[r] not None; its
        header dheads[r], buckets dflats[r]) onto the copy of `held`, then publish `version` in `stage`
        (directly, or assembled from the ranks' `flats`), and record it as held. In a thread: applying
        and assembling a large model must not stall the event loop."""
        def finish() -> None:
            targets = [stage.data] if self.direct else flats
            for r, d in enumerate(deltas):
                if d is not None:
                    self.apply_delta(r, targets[r], dheads[r], dflats[r], version, held)
            if self.direct:
                seg.end_write(stage.header, version, self.plan.hash_int, self.plan.total_bytes)
            else:
                self.assemble(stage, flats, version)

        await asyncio.to_thread(finish)
        self.held = version

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
