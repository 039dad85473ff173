"""Monarch RDMA transport: receivers read every trainer rank's registered buckets.

Each trainer rank's sender registers one `RDMABuffer` per bucket per slot, plus one per slot header,
once at construction (inside its actor). A receiver reads the slot headers, picks each rank's slot
publishing the wanted version, reads all their buckets in one batched `RDMAAction`, then re-reads
the headers to prove no slot was rewritten meanwhile. With weight_sync.delta a rank's slot also offers
the delta against the previous version in buffers of its own (a read moves a whole buffer, so they are
smaller than the buckets, delta.py); a receiver whose copy holds that base reads the delta header and
the delta buckets in use instead of the full buckets, and applies them in place. With one rank holding whole tensors the
buckets land straight at their place in the shared-memory staging segment (no unpack copy); with
several, each rank's bytes land in a scratch buffer of that rank's size and are assembled into the
staging segment (shard_plan.py). ibverbs where available, the TCP fallback otherwise.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch

from pipeline.weightsync import segment as seg
from pipeline.weightsync.delta import num_buckets
from pipeline.weightsync.errors import ShortBufferError, TransportError
from pipeline.weightsync.shard_plan import ShardPlan
from pipeline.weightsync.transport import (NUM_SLOTS, ReceiverTransport, SenderTransport, Slot, SyncHandle,
                                           wait_for_version)


def _rdma():
    import monarch.rdma as rdma
    return rdma


class RdmaSender(SenderTransport):
    kind = "rdma"

    def __init__(self, shards: ShardPlan, rank: int, num_receivers: int, cfg) -> None:
        super().__init__(shards, rank, num_receivers, cfg)
        RDMABuffer = _rdma().RDMABuffer
        self.slots, self._headers, self._buckets, self._dheaders, self._deltas = [], [], [], [], []
        for _ in range(NUM_SLOTS):
            header = torch.zeros(seg.HEADER_WORDS, dtype=torch.int64)
            header[seg.H_MAGIC], header[seg.H_VERSION], header[seg.H_BASE] = seg.MAGIC, seg.EMPTY, seg.EMPTY
            data = torch.empty(self.nbytes, dtype=torch.uint8)
            slot = Slot(header, data, **self.delta_buffers())
            self.slots.append(slot)
            self._headers.append(RDMABuffer(header.view(torch.uint8)))
            self._buckets.append([RDMABuffer(b) for b in shards.buckets(rank, data)])
            if self.geometry is not None:  # a read moves a whole buffer: the delta's buckets are registered apart
                self._dheaders.append(RDMABuffer(slot.dheader.view(torch.uint8)))
                self._deltas.append([RDMABuffer(b) for b in self.geometry.buckets(slot.delta)])

    def handle_info(self) -> dict[str, Any]:
        info = {"headers": self._headers, "buckets": self._buckets}
        if self.geometry is not None:
            info["delta"] = {"headers": self._dheaders, "buckets": self._deltas}
        return info

    def close(self) -> None:
        # Fire-and-forget: close() may run inside the owner's event loop, where blocking is not allowed.
        for buf in [*self._headers, *(b for bs in self._buckets for b in bs), *self._dheaders,
                    *(b for bs in self._deltas for b in bs)]:
            buf.drop()
        self._headers, self._buckets, self.slots, self._dheaders, self._deltas = [], [], [], [], []


class RdmaReceiver(ReceiverTransport):
    def __init__(self, handle: SyncHandle, rank: int) -> None:
        super().__init__(handle, rank)
        self._headers = [info["headers"] for info in self.infos]
        self._buckets = [info["buckets"] for info in self.infos]
        self._stage = seg.Segment(seg.new_name(f"rdma-r{rank}"), self.plan.total_bytes, create=True)
        # where each rank's buckets land: the stage itself when its bytes are the full layout
        self._flats = None if self.direct else [torch.empty(n, dtype=torch.uint8) for n in self.shards.totals]
        self._local = [self.plan.buckets(self._stage.data)] if self.direct else \
            [self.shards.buckets(r, f) for r, f in enumerate(self._flats)]
        self._local_headers = [[torch.zeros(seg.HEADER_WORDS, dtype=torch.int64) for _ in range(NUM_SLOTS)]
                               for _ in self.infos]
        # weight_sync.delta: where each rank's delta header and buckets land
        self._dhead = [None if g is None else torch.zeros(g.header_words, dtype=torch.int64) for g in self.geometry]
        self._dflat = [None if g is None else torch.zeros(g.capacity, dtype=torch.uint8) for g in self.geometry]
        for r, (slots, locals_) in enumerate(zip(self._buckets, self._local)):
            for slot, bufs in enumerate(slots):
                if len(bufs) != len(locals_):
                    raise ShortBufferError(f"rdma slot {slot} of trainer rank {r} has {len(bufs)} buckets, plan "
                                           f"{self.shards.hash} needs {len(locals_)}")
                for i, (buf, local) in enumerate(zip(bufs, locals_)):
                    if buf.size() != local.numel():
                        raise ShortBufferError(f"rdma slot {slot} bucket {i} of trainer rank {r}: remote buffer "
                                               f"holds {buf.size()} bytes, plan {self.shards.hash} says "
                                               f"{local.numel()}")

    async def _read_headers(self, slots: list[tuple[int, int]], version: int, timeout_s: float) -> None:
        action = _rdma().RDMAAction()
        for r, s in slots:
            action.read_remote(self._local_headers[r][s].view(torch.uint8), self._headers[r][s])
        try:
            await action.submit(timeout=max(1, math.ceil(timeout_s)))
        except Exception as e:
            raise TransportError(f"version {version}: rdma read of slot headers {slots} (rank, slot) "
                                 f"failed: {e}") from e

    def _where(self, r: int, slot: int) -> str:
        return f"rdma slot {slot} of trainer rank {r} (owner {self._headers[r][slot].owner})"

    async def fetch(self, version: int, timeout_s: float) -> str:
        world = range(len(self.infos))
        held, self.held = self.held, None  # a fetch that fails leaves no valid copy: the next one is full

        async def slot_of(r: int) -> int:
            async def versions() -> list[int]:
                await self._read_headers([(r, s) for s in range(NUM_SLOTS)], version, timeout_s)
                return [int(h[seg.H_VERSION]) for h in self._local_headers[r]]

            i = await wait_for_version(versions, version, timeout_s, f"trainer rank {r}'s rdma slots")
            seg.check_header(self._local_headers[r][i], version, self.expect, self._where(r, i))
            return i

        chosen = await asyncio.gather(*[slot_of(r) for r in world])
        seg.begin_write(self._stage.header)
        action, nb, moved = _rdma().RDMAAction(), 0, 0
        deltas = [self.delta_len(r, self._local_headers[r][chosen[r]], held) for r in world]
        for r in world:
            if deltas[r] is None:  # the full bytes
                pairs = list(zip(self._buckets[r][chosen[r]], self._local[r]))
            else:  # the delta's header and the buckets it uses
                remote = self.infos[r]["delta"]
                dbufs = self.geometry[r].buckets(self._dflat[r])[:num_buckets(deltas[r], self.geometry[r].bucket)]
                pairs = [(remote["headers"][chosen[r]], self._dhead[r].view(torch.uint8)),
                         *zip(remote["buckets"][chosen[r]], dbufs)]
            for buf, local in pairs:
                action.read_remote(local, buf)
                moved += local.numel()
            nb += len(pairs)
        try:
            await action.submit(timeout=max(1, math.ceil(timeout_s)))
        except Exception as e:
            raise TransportError(f"version {version}: rdma read of {nb} buckets from trainer ranks "
                                 f"0..{len(self.infos) - 1} failed: {e}") from e
        await self._read_headers(list(enumerate(chosen)), version, timeout_s)
        for r in world:
            seg.check_header(self._local_headers[r][chosen[r]], version, self.expect,
                             self._where(r, chosen[r]), after_read=True)
        await self.publish_staged(self._stage, self._flats, deltas, self._dhead, self._dflat, version, held)
        self.last = {"bytes": float(moved), "delta_ranks": float(sum(d is not None for d in deltas))}
        return self._stage.name

    def close(self) -> None:
        self._stage.close()
