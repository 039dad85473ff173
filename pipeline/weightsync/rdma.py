"""Monarch RDMA transport: receivers read the sender's registered buckets into a staging segment.

The sender registers one `RDMABuffer` per bucket per slot, plus one per slot header, once at
construction (inside its actor). A receiver reads both slot headers, picks the slot publishing the
wanted version, reads all its buckets in one batched `RDMAAction` straight into its shared-memory
staging segment (each bucket lands at its place in the flat layout, so no unpack copy), then
re-reads the header to prove the slot was not rewritten meanwhile. ibverbs where available, the
TCP fallback otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pipeline.weightsync import segment as seg
from pipeline.weightsync.errors import ShortBufferError, TransportError
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.transport import (NUM_SLOTS, ReceiverTransport, SenderTransport, Slot, SyncHandle,
                                           wait_for_version)


def _rdma():
    import monarch.rdma as rdma
    return rdma


class RdmaSender(SenderTransport):
    kind = "rdma"

    def __init__(self, plan: BucketPlan, num_receivers: int, cfg) -> None:
        super().__init__(plan, num_receivers, cfg)
        RDMABuffer = _rdma().RDMABuffer
        self.slots, self._headers, self._buckets = [], [], []
        for _ in range(NUM_SLOTS):
            header = torch.zeros(seg.HEADER_WORDS, dtype=torch.int64)
            header[seg.H_MAGIC], header[seg.H_VERSION] = seg.MAGIC, seg.EMPTY
            data = torch.empty(plan.total_bytes, dtype=torch.uint8)
            self.slots.append(Slot(header, data))
            self._headers.append(RDMABuffer(header.view(torch.uint8)))
            self._buckets.append([RDMABuffer(b) for b in plan.buckets(data)])

    def handle_info(self) -> dict[str, Any]:
        return {"headers": self._headers, "buckets": self._buckets}

    def close(self) -> None:
        # Fire-and-forget: close() may run inside the owner's event loop, where blocking is not allowed.
        for buf in [*self._headers, *(b for bs in self._buckets for b in bs)]:
            buf.drop()
        self._headers, self._buckets, self.slots = [], [], []


class RdmaReceiver(ReceiverTransport):
    def __init__(self, handle: SyncHandle, rank: int) -> None:
        super().__init__(handle, rank)
        self._headers = handle.info["headers"]
        self._buckets = handle.info["buckets"]
        self._stage = seg.Segment(seg.new_name(f"rdma-r{rank}"), self.plan.total_bytes, create=True)
        self._local_headers = [torch.zeros(seg.HEADER_WORDS, dtype=torch.int64) for _ in range(NUM_SLOTS)]
        for slot, bufs in enumerate(self._buckets):
            if len(bufs) != self.plan.num_buckets:
                raise ShortBufferError(f"rdma slot {slot} has {len(bufs)} buckets, plan {self.plan.hash} "
                                       f"needs {self.plan.num_buckets}")
            for i, (buf, local) in enumerate(zip(bufs, self.plan.buckets(self._stage.data))):
                if buf.size() != local.numel():
                    raise ShortBufferError(f"rdma slot {slot} bucket {i}: remote buffer holds {buf.size()} "
                                           f"bytes, plan {self.plan.hash} says {local.numel()}")

    async def _read_headers(self, slots: list[int], version: int, timeout_s: float) -> None:
        action = _rdma().RDMAAction()
        for s in slots:
            action.read_remote(self._local_headers[s].view(torch.uint8), self._headers[s])
        try:
            await action.submit(timeout=max(1, math.ceil(timeout_s)))
        except Exception as e:
            raise TransportError(f"version {version}: rdma read of slot headers {slots} failed: {e}") from e

    async def fetch(self, version: int, timeout_s: float) -> str:
        async def versions() -> list[int]:
            await self._read_headers(list(range(NUM_SLOTS)), version, timeout_s)
            return [int(h[seg.H_VERSION]) for h in self._local_headers]

        slot = await wait_for_version(versions, version, timeout_s, "the sender's rdma slots")
        where = f"rdma slot {slot} (owner {self._headers[slot].owner})"
        seg.check_header(self._local_headers[slot], version, self.plan.hash_int, where)
        seg.begin_write(self._stage.header)
        action = _rdma().RDMAAction()
        for buf, local in zip(self._buckets[slot], self.plan.buckets(self._stage.data)):
            action.read_remote(local, buf)
        try:
            await action.submit(timeout=max(1, math.ceil(timeout_s)))
        except Exception as e:
            raise TransportError(f"version {version}: rdma read of {self.plan.num_buckets} buckets "
                                 f"(0..{self.plan.num_buckets - 1}) from {where} failed: {e}") from e
        await self._read_headers([slot], version, timeout_s)
        seg.check_header(self._local_headers[slot], version, self.plan.hash_int, where, after_read=True)
        seg.end_write(self._stage.header, version, self.plan.hash_int, self.plan.total_bytes)
        return self._stage.name

    def close(self) -> None:
        self._stage.close()
