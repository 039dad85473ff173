"""WeightSender: trainer rank 0 packs HF-named weights into a double-buffered snapshot and publishes it."""

from __future__ import annotations

import asyncio
import time
from typing import Mapping

import torch

from pipeline.config import WeightSyncConfig
from pipeline.types import WeightVersion
from pipeline.weightsync import segment as seg
from pipeline.weightsync.checksum import Checksum, of_dict
from pipeline.weightsync.errors import SyncTimeoutError, VersionRegressionError, WeightSyncError
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.transport import NUM_SLOTS, SenderTransport, SyncHandle


def make_sender(kind: str, plan: BucketPlan, num_receivers: int, cfg, host: str = "127.0.0.1",
                backend: str = "gloo") -> SenderTransport:
    """The sender side of transport `kind`; `host` is the address receivers reach this process at,
    `backend` the torch.distributed backend of a collective (the trainer's, trainer.backend)."""
    if kind == "shm":
        from pipeline.weightsync.shm import ShmSender
        return ShmSender(plan, num_receivers, cfg)
    if kind == "rdma":
        from pipeline.weightsync.rdma import RdmaSender
        return RdmaSender(plan, num_receivers, cfg)
    if kind == "collective":
        from pipeline.weightsync.collective import CollectiveSender
        return CollectiveSender(plan, num_receivers, cfg, host, backend)
    raise ValueError(f"unknown weight-sync transport {kind!r}")


class WeightSender:
    """Publishes versions of the trainer's weights to `num_receivers` WeightReceivers.

    Ordering contract:
      * `publish(sd, v)` packs `sd` into the free slot, starts the transfer and returns: from then on
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
        # trainer rank 0, once:
        sender = WeightSender(cfg.weight_sync, hf_meta, num_receivers=G)
        handle = sender.handle()                       # send to every generator once
        # each generator, once:  receiver = WeightReceiver(handle, rank=g)
        # each step:
        await sender.publish(export_hf(model), v)      # snapshot packed; optimizer may step now
        await asyncio.gather(*[r.pull(v) for r in receivers])   # (in the generators' processes)
        # the next publish may start only after every receiver loaded v (slot reuse rule above).
        sender.close()
    """

    def __init__(self, cfg: WeightSyncConfig, state_dict_meta_or_sd: Mapping[str, object], num_receivers: int,
                 host: str = "127.0.0.1", backend: str = "gloo") -> None:
        if num_receivers < 1:
            raise ValueError(f"WeightSender: num_receivers={num_receivers} must be >= 1")
        self.cfg = cfg
        self.plan = BucketPlan.from_state_dict(state_dict_meta_or_sd, cfg.bucket_mb << 20)
        self.num_receivers = num_receivers
        self.transport = make_sender(cfg.transport, self.plan, num_receivers, cfg, host, backend)
        self._sending: asyncio.Task | None = None
        for slot in self.transport.slots:  # fault the pages in now, not during the first pushes
            slot.data.zero_()
        self._pushes = 0
        self._last_version: int | None = None
        self._slot_of: dict[int, int] = {}
        self.last_timing: dict[str, float] = {}

    def handle(self) -> SyncHandle:
        return SyncHandle(self.cfg.transport, self.plan, self.num_receivers, self.cfg.timeout_s,
                          self.transport.handle_info())

    def pack(self, hf_state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Snapshot `hf_state_dict` into the next slot and publish `version`; returns the slot index."""
        if self._last_version is not None and version <= self._last_version:
            raise VersionRegressionError(f"version {version}: push after version {self._last_version}; "
                                         "versions must strictly increase")
        self.plan.check_state_dict(hf_state_dict, version)
        slot_idx = self._pushes % NUM_SLOTS
        slot = self.transport.slots[slot_idx]
        t0 = time.perf_counter()
        seg.begin_write(slot.header)
        self.plan.pack(hf_state_dict, slot.data, version)
        if slot.data.is_cuda:
            torch.cuda.synchronize(slot.data.device)
        seg.end_write(slot.header, version, self.plan.hash_int, self.plan.total_bytes)
        self.last_timing = {"pack_s": time.perf_counter() - t0}
        self._pushes += 1
        self._last_version = version
        self._slot_of = {version: slot_idx}
        return slot_idx

    def checksums(self, version: int) -> dict[str, Checksum]:
        """Checksums of the packed snapshot of `version` per HF name (pipeline/weightsync/checksum.py):
        what receivers read, the trainer's weights cast to the engines' dtype. Valid until the slot is
        reused (publish of version + 2); a read the next pack overlapped raises TornReadError."""
        if version not in self._slot_of:
            raise WeightSyncError(f"version {version}: checksums() of a version not packed last "
                                  f"(last packed {self._last_version})")
        slot = self.transport.slots[self._slot_of[version]]
        where = f"sender slot {self._slot_of[version]}"
        seg.check_header(slot.header, version, self.plan.hash_int, where)
        out = of_dict(self.plan.unpack(slot.data, version))
        seg.check_header(slot.header, version, self.plan.hash_int, where, after_read=True)
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

    async def publish(self, hf_state_dict: Mapping[str, torch.Tensor], version: int) -> WeightVersion:
        """Pack `version` and start its transfer; returns once `hf_state_dict` may change (see above)."""
        await self.flush()
        # A thread, so a large copy does not stall the actor's event loop (torch drops the GIL).
        await asyncio.to_thread(self.pack, hf_state_dict, version)
        self._sending = asyncio.create_task(self.send(version), name=f"weightsync-send-v{version}")
        return WeightVersion(version, self.plan.hash, self.plan.num_buckets, self.plan.total_bytes)

    async def flush(self) -> None:
        """Wait for the transfer started by the last publish; raises its error."""
        if self._sending is not None:
            task, self._sending = self._sending, None
            await task

    async def push(self, hf_state_dict: Mapping[str, torch.Tensor], version: int) -> WeightVersion:
        """publish + flush: returns once the transfer is done (collective: every receiver joined)."""
        wv = await self.publish(hf_state_dict, version)
        await self.flush()
        return wv

    def close(self) -> None:
        if self._sending is not None:
            self._sending.cancel()
            self._sending = None
        self.transport.close()
