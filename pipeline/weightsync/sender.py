"""WeightSender: one per trainer rank; packs that rank's own pieces of the HF-named weights into a
double-buffered snapshot and publishes them (shard_plan.py says which pieces; with one rank and no
holdings given, every tensor whole, as from a single process)."""

from __future__ import annotations

import asyncio
import time
from typing import Mapping, Sequence

import torch

from pipeline.config import WeightSyncConfig
from pipeline.types import WeightVersion
from pipeline.weightsync import delta as dl
from pipeline.weightsync import segment as seg
from pipeline.weightsync.checksum import Checksum
from pipeline.weightsync.errors import SyncTimeoutError, VersionRegressionError, WeightSyncError
from pipeline.weightsync.pinning import HostPins
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.shard_plan import Box, ShardPlan
from pipeline.weightsync.transport import NUM_SLOTS, SenderTransport, SyncHandle


def make_sender(kind: str, shards: ShardPlan, rank: int, num_receivers: int, cfg, host: str = "127.0.0.1",
                backend: str = "gloo") -> SenderTransport:
    """Trainer rank `rank`'s side of transport `kind`; `host` is the address receivers reach this
    process at, `backend` the torch.distributed backend of a collective (the trainer's, trainer.backend)."""
    if kind == "shm":
        from pipeline.weightsync.shm import ShmSender
        return ShmSender(shards, rank, num_receivers, cfg)
    if kind == "rdma":
        from pipeline.weightsync.rdma import RdmaSender
        return RdmaSender(shards, rank, num_receivers, cfg)
    if kind == "collective":
        from pipeline.weightsync.collective import CollectiveSender
        return CollectiveSender(shards, rank, num_receivers, cfg, host, backend)
    raise ValueError(f"unknown weight-sync transport {kind!r}")


class WeightSender:
    """Publishes trainer rank `rank`'s part of each version of the weights to `num_receivers`
    WeightReceivers. `holdings[r]` lists the boxes rank r holds (shard_plan.py); every rank builds
    the same ShardPlan from them, and a receiver needs every rank's handle (`merge_handles`).
    Without holdings this one sender holds every tensor whole and `publish` takes the state dict.

    Ordering contract (per rank; every rank publishes every version):
      * `publish(sd, v)` packs `sd` (with holdings: the tensors of this rank's boxes, in order) into the free slot, starts the transfer and returns: from then on
        the optimizer may overwrite `sd` (the next step overlaps the transfer). `flush()` awaits the
        transfer and re-raises its failure; the next `publish` flushes first. `push` = publish + flush.
      * Versions strictly increase (VersionRegressionError otherwise).
      * Slot reuse: publish k writes slot k % 2, overwriting the version of publish k - 2. Every
        receiver must have finished `pull` (and, for shm, `load_into_vllm`) of that older version
        before publish k starts: at most one sync may be outstanding while the next one begins
        (pipeline.weightsync.sync.WeightSync keeps this). A receiver that breaks the rule gets
        TornReadError, never silently mixed weights.
      * rdma / shm: receivers pull; `pull(v)` may start before `publish(v)` and waits (bounded by
        timeout_s) until v is published; the transfer has nothing to do on this side.
        collective: the transfer is a broadcast that completes only once every receiver's `pull(v)`
        has joined, so publish and the pulls run concurrently (publish returns before they finish).

    Example:
        # one process holding whole tensors, once:
        sender = WeightSender(cfg.weight_sync, hf_meta, num_receivers=G)
        handle = sender.handle()                       # send to every generator once
        # each generator, once:  receiver = WeightReceiver(handle, rank=g)
        # each step:
        await sender.publish(export_hf(model), v)      # snapshot packed; optimizer may step now
        await asyncio.gather(*[r.pull(v) for r in receivers])   # (in the generators' processes)
        # the next publish may start only after every receiver loaded v (slot reuse rule above).
        sender.close()
        # trainer rank r of N, each holding its shards (boxes of the HF tensors):
        sender = WeightSender(cfg.weight_sync, hf_meta, G, holdings=all_ranks_boxes, rank=r)
        await sender.publish([local tensor of each box of rank r], v)
    """

    def __init__(self, cfg: WeightSyncConfig, state_dict_meta_or_sd: Mapping[str, object], num_receivers: int,
                 host: str = "127.0.0.1", backend: str = "gloo", holdings: Sequence[Sequence[Box]] | None = None,
                 rank: int = 0) -> None:
        if num_receivers < 1:
            raise ValueError(f"WeightSender: num_receivers={num_receivers} must be >= 1")
        self.cfg = cfg
        self.plan = BucketPlan.from_state_dict(state_dict_meta_or_sd, cfg.bucket_mb << 20)
        self.shards = ShardPlan.whole(self.plan) if holdings is None else ShardPlan.build(self.plan, holdings)
        if not 0 <= rank < self.shards.world:
            raise ValueError(f"WeightSender: rank {rank} outside the {self.shards.world} trainer ranks")
        self.rank, self._whole = rank, holdings is None
        self.num_receivers = num_receivers
        self.transport = make_sender(cfg.transport, self.shards, rank, num_receivers, cfg, host, backend)
        self._sending: asyncio.Task | None = None
        self._pins = HostPins()  # host slots page-locked at the first push from CUDA tensors (pinning.py)
        for slot in self.transport.slots:  # fault the pages in now, not during the first pushes
            slot.data.zero_()
        self._pushes = 0
        self._last_version: int | None = None
        self._slot_of: dict[int, int] = {}
        self.last_timing: dict[str, float] = {}

    def handle(self) -> SyncHandle:
        """This rank's handle; with several ranks, the receivers need all of them merged (merge_handles)."""
        return SyncHandle(self.cfg.transport, self.plan, self.num_receivers, self.cfg.timeout_s,
                          {"ranks": [self.transport.handle_info()]}, self.shards)

    def pack(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor], version: int,
             full: bool = False) -> int:
        """Snapshot this rank's part into the next slot and publish `version`; returns the slot index.
        `tensors`: the HF state dict (no holdings given), else the tensor of each of this rank's boxes
        in holdings order, any dtype (each is cast to the plan's while it is copied). With
        weight_sync.delta the slot also offers the delta against the previous version (still in the
        other slot) unless `full` (collective: a receiver is behind), the version is a multiple of
        full_every, or the delta would exceed half the full bytes (delta.py)."""
        if self._last_version is not None and version <= self._last_version:
            raise VersionRegressionError(f"version {version}: push after version {self._last_version}; "
                                         "versions must strictly increase")
        if isinstance(tensors, Mapping):
            if not self._whole:
                raise WeightSyncError(f"version {version}: trainer rank {self.rank} holds shards; pass the "
                                      "tensors of its boxes, not a state dict")
            self.plan.check_state_dict(tensors, version)
            tensors = [tensors[e.name] for e in self.plan.entries]
        slot_idx = self._pushes % NUM_SLOTS
        slot = self.transport.slots[slot_idx]
        if tensors and tensors[0].is_cuda and not slot.data.is_cuda:
            self._pins.pin(slot.data)  # once per slot; a refusal leaves it pageable
        t0 = time.perf_counter()
        seg.begin_write(slot.header)
        sent = self.shards.pack(self.rank, tensors, slot.data, version)
        t1 = time.perf_counter()
        slot.header[seg.H_BASE], slot.header[seg.H_DELTA] = self._delta(slot_idx, version, full)
        if slot.data.is_cuda:
            torch.cuda.synchronize(slot.data.device)
        seg.end_write(slot.header, version, self.shards.header_hash_int, self.shards.totals[self.rank])
        t2 = time.perf_counter()
        self.last_timing = {"pack_s": t2 - t0, "bytes": float(sent), "delta_s": t2 - t1,
                            "delta_bytes": float(slot.header[seg.H_DELTA])}
        self._pushes += 1
        self._last_version = version
        self._slot_of = {version: slot_idx}
        return slot_idx

    def _delta(self, slot_idx: int, version: int, full: bool) -> tuple[int, int]:
        """(base version, wire bytes) of the delta packed beside `version` into the slot, or (EMPTY, -1)."""
        g, cfg = self.transport.geometry, self.cfg
        if g is None or full or self._last_version is None or (cfg.full_every and version % cfg.full_every == 0):
            return seg.EMPTY, -1
        new, old = self.transport.slots[slot_idx], self.transport.slots[(slot_idx - 1) % NUM_SLOTS]
        if int(old.header[seg.H_VERSION]) != self._last_version:  # the base slot is not the last version
            return seg.EMPTY, -1
        n = dl.pack(g.spans, old.data, new.data, new.delta, g.bucket, self.shards.totals[self.rank] // 2)
        if n is None:
            return seg.EMPTY, -1
        dl.write_header(new.dheader, version, self._last_version, n, dl.checksums(g.spans, new.data))
        return self._last_version, n

    def checksums(self, version: int) -> dict[str, Checksum]:
        """This rank's share of the checksum of each HF tensor it sends (pipeline/weightsync/checksum.py
        `of_box`), from the packed snapshot of `version`: what receivers read, the trainer's weights
        cast to the engines' dtype. `checksum.combine` over every rank's shares gives each whole
        tensor's checksum (one rank holding whole tensors: its shares are those). Valid until the
        slot is reused (publish of version + 2); a read the next pack overlapped raises TornReadError."""
        if version not in self._slot_of:
            raise WeightSyncError(f"version {version}: checksums() of a version not packed last "
                                  f"(last packed {self._last_version})")
        slot = self.transport.slots[self._slot_of[version]]
        where = f"trainer rank {self.rank}'s sender slot {self._slot_of[version]}"
        seg.check_header(slot.header, version, self.shards.header_hash_int, where)
        out = self.shards.checksums(self.rank, slot.data)
        seg.check_header(slot.header, version, self.shards.header_hash_int, where, after_read=True)
        return out

    async def send(self, version: int) -> WeightVersion:
        """Transfer a packed version (collective: broadcast to all receivers; rdma/shm: nothing to do)."""
        if version not in self._slot_of:
            raise WeightSyncError(f"version {version}: send() without a matching pack() (last packed "
                                  f"{self._last_version})")
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self.transport.send(self._slot_of[version], version, self.cfg.timeout_s),
                                   self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise SyncTimeoutError(f"version {version}: push over {self.cfg.transport} did not finish within "
                                   f"{self.cfg.timeout_s:.1f}s") from None
        self.last_timing["send_s"] = time.perf_counter() - t0
        return WeightVersion(version, self.plan.hash, self.plan.num_buckets, self.plan.total_bytes)

    async def publish(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                      version: int, full: bool = False) -> WeightVersion:
        """Pack `version` and start its transfer; returns once `tensors` may change (see above).
        `full`: offer no delta (weight_sync.delta; collective: some receiver does not hold the
        previous version)."""
        await self.flush()
        # A thread, so a large copy does not stall the actor's event loop (torch drops the GIL).
        await asyncio.to_thread(self.pack, tensors, version, full)
        self._sending = asyncio.create_task(self.send(version), name=f"weightsync-send-v{version}")
        return WeightVersion(version, self.plan.hash, self.plan.num_buckets, self.plan.total_bytes)

    async def flush(self) -> None:
        """Wait for the transfer started by the last publish; raises its error."""
        if self._sending is not None:
            task, self._sending = self._sending, None
            await task

    async def push(self, tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                   version: int, full: bool = False) -> WeightVersion:
        """publish + flush: returns once the transfer is done (collective: every receiver joined)."""
        wv = await self.publish(tensors, version, full)
        await self.flush()
        return wv

    def close(self) -> None:
        if self._sending is not None:
            self._sending.cancel()
            self._sending = None
        self._pins.release()  # before the transport unmaps or drops the slots
        self.transport.close()
