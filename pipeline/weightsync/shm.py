"""Same-host shared-memory transport: the sender's two slots are /dev/shm segments the receiving
engine process maps directly (zero-copy); `fetch` only waits for the version and checks the header."""

from __future__ import annotations

from typing import Any

from pipeline.weightsync import segment as seg
from pipeline.weightsync.plan import BucketPlan
from pipeline.weightsync.transport import NUM_SLOTS, ReceiverTransport, SenderTransport, Slot, SyncHandle, wait_for_version


class ShmSender(SenderTransport):
    kind = "shm"

    def __init__(self, plan: BucketPlan, num_receivers: int, cfg) -> None:
        super().__init__(plan, num_receivers, cfg)
        self._segs = [seg.Segment(seg.new_name(f"slot{i}"), plan.total_bytes, create=True) for i in range(NUM_SLOTS)]
        self.slots = [Slot(s.header, s.data) for s in self._segs]

    def handle_info(self) -> dict[str, Any]:
        return {"segments": [s.name for s in self._segs]}

    def close(self) -> None:
        self.slots = []
        for s in self._segs:
            s.close()


class ShmReceiver(ReceiverTransport):
    """Zero-copy: the engine process maps the sender's slot directly; `fetch` only waits and checks."""

    def __init__(self, handle: SyncHandle, rank: int) -> None:
        super().__init__(handle, rank)
        self._names = handle.info["segments"]
        self._segs = [seg.Segment(n, self.plan.total_bytes, create=False) for n in self._names]

    async def fetch(self, version: int, timeout_s: float) -> str:
        async def versions() -> list[int]:
            return [int(s.header[seg.H_VERSION]) for s in self._segs]

        i = await wait_for_version(versions, version, timeout_s, "the sender's shm slots")
        seg.check_header(self._segs[i].header, version, self.plan.hash_int, f"shm slot {self._names[i]}")
        return self._names[i]

    def close(self) -> None:
        for s in self._segs:
            s.close()
