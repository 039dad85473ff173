"""WeightReceiver: one per generator; brings a version into shared memory the vLLM engine process maps."""

from __future__ import annotations

import asyncio
import time

from pipeline.weightsync.errors import SyncTimeoutError, VersionRegressionError, WeightSyncError
from pipeline.weightsync.transport import ReceiverTransport, SyncHandle

PULL_GRACE_S = 5.0  # how long after its own deadline a transport may take to raise, before pull cancels it


def make_receiver(handle: SyncHandle, rank: int) -> ReceiverTransport:
    if handle.kind == "shm":
        from pipeline.weightsync.shm import ShmReceiver
        return ShmReceiver(handle, rank)
    if handle.kind == "rdma":
        from pipeline.weightsync.rdma import RdmaReceiver
        return RdmaReceiver(handle, rank)
    if handle.kind == "collective":
        from pipeline.weightsync.collective import CollectiveReceiver
        return CollectiveReceiver(handle, rank)
    raise ValueError(f"unknown weight-sync transport {handle.kind!r}")


class WeightReceiver:
    """`await pull(v)` stages version v; `staged_segment(v)` names the segment holding it.

    `loaded_version` is the last version fully loaded into the engine (set by `load_into_vllm`);
    `pulled_version` the last one staged. A pull of a version not newer than the loaded one raises
    VersionRegressionError. `last_timing` after a pull: pull_s, and for rdma / collective the bytes
    it moved (`bytes`), what a full pull moves (`full_bytes`) and how many trainer ranks' parts came
    as a delta (`delta_ranks`, weight_sync.delta).
    """

    def __init__(self, handle: SyncHandle, rank: int) -> None:
        if not 0 <= rank < handle.num_receivers:
            raise ValueError(f"WeightReceiver: rank {rank} outside 0..{handle.num_receivers - 1}")
        self.handle, self.plan, self.rank = handle, handle.plan, rank
        self.timeout_s = handle.timeout_s
        self.transport = make_receiver(handle, rank)
        self.pulled_version: int | None = None
        self.loaded_version: int | None = None
        self._segment: str | None = None
        self.last_timing: dict[str, float] = {}

    async def pull(self, version: int) -> None:
        floor = max(v for v in (self.pulled_version, self.loaded_version, -1) if v is not None)
        if version <= floor:
            raise VersionRegressionError(f"version {version}: receiver {self.rank} already has version {floor}")
        self._segment = None  # a failed pull leaves nothing loadable
        t0 = time.perf_counter()
        # The transport keeps its own deadline (timeout_s) and raises naming what it waited for; this
        # bound is the backstop, a grace later, so a normal timeout never cancels a read in flight.
        backstop = self.timeout_s + PULL_GRACE_S
        try:
            seg = await asyncio.wait_for(self.transport.fetch(version, self.timeout_s), backstop)
        except SyncTimeoutError:
            raise  # the transport's own, naming what it waited for (it is a TimeoutError too)
        except asyncio.TimeoutError:
            raise SyncTimeoutError(f"version {version}: pull over {self.handle.kind} by receiver {self.rank} "
                                   f"did not finish within {backstop:.1f}s") from None
        self.last_timing = {"pull_s": time.perf_counter() - t0, **self.transport.last,
                            "full_bytes": float(sum(self.transport.shards.totals))}
        self._segment, self.pulled_version = seg, version

    def staged_segment(self, version: int) -> str:
        if self._segment is None or self.pulled_version != version:
            raise WeightSyncError(f"version {version}: not staged on receiver {self.rank} "
                                  f"(last pulled {self.pulled_version}); pull it first")
        return self._segment

    def close(self) -> None:
        self.transport.close()
