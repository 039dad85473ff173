"""WeightSender: trainer rank 0 packs HF-named weights into a double-buffered snapshot and publishes it."""

from __future__ import annotations

import asyncio
import time
from typing import Mapping

import torch

from pipeline.config import WeightSyncConfig
from pipeline.types import WeightVersion
from pipeline.weightsync import shm
from pipeline.weightsync.errors import SyncTimeoutError, VersionRegressionError, WeightSyncError
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.transport import NUM_SLOTS, SyncHandle, make_sender


class WeightSender:
    """Publishes versions of the trainer's weights to `num_receivers` WeightReceivers.

    Ordering contract:
      * `push(sd, v)` = `pack(sd, v)` then `send(v)`. `pack` copies `sd` into the free slot and
        returns; from then on the optimizer may overwrite `sd` (the next step overlaps the transfer).
      * Versions strictly increase (VersionRegressionError otherwise).
      * Slot reuse: push k writes slot k % 2, overwriting the version of push k - 2. Every receiver
        must have finished `pull` (and, for shm, `load_into_vllm`) of that older version before push k
        starts; i.e. at most one sync may be outstanding while the next push begins. A receiver that
        breaks the rule gets TornReadError, never silently mixed weights.
      * rdma / shm: receivers pull; `pull(v)` may start before `push(v)` and waits (bounded by
        timeout_s) until v is published. collective: `push(v)` broadcasts and blocks until every
        receiver's `pull(v)` joins, so they must run concurrently.

    Example:
        # trainer rank 0, once:
        sender = WeightSender(cfg.weight_sync, hf_meta, num_receivers=G)
        handle = sender.handle()                       # send to every generator once
        # each generator, once:  receiver = WeightReceiver(handle, rank=g)
        # each step (controller):
        #   trainer: loss.backward(); opt.step(); v += 1
        await asyncio.gather(
            trainer.push_weights.call_one(v),          # -> sender.push(export_hf(model), v)
            *[g.update_weights.call_one(v) for g in gens],  # -> receiver.pull(v); load_into_vllm(...)
        )
        # the next push may start only after this gather (slot reuse rule above).
        sender.close()
    """

    def __init__(self, cfg: WeightSyncConfig, state_dict_meta_or_sd: Mapping[str, object], num_receivers: int) -> None:
        if num_receivers < 1:
            raise ValueError(f"WeightSender: num_receivers={num_receivers} must be >= 1")
        self.cfg = cfg
        self.plan = BucketPlan.from_state_dict(state_dict_meta_or_sd, cfg.bucket_mb << 20)
        self.num_receivers = num_receivers
        self.transport = make_sender(cfg.transport, self.plan, num_receivers, cfg)
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
        shm.begin_write(slot.header)
        self.plan.pack(hf_state_dict, slot.data, version)
        if slot.data.is_cuda:
            torch.cuda.synchronize(slot.data.device)
        shm.end_write(slot.header, version, self.plan.hash_int, self.plan.total_bytes)
        self.last_timing = {"pack_s": time.perf_counter() - t0}
        self._pushes += 1
        self._last_version = version
        self._slot_of = {version: slot_idx}
        return slot_idx

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

    async def push(self, hf_state_dict: Mapping[str, torch.Tensor], version: int) -> WeightVersion:
        """pack + send; see the class docstring for what may overlap what."""
        # A thread, so a large copy does not stall the actor's event loop (torch drops the GIL).
        await asyncio.to_thread(self.pack, hf_state_dict, version)
        return await self.send(version)

    def close(self) -> None:
        self.transport.close()
