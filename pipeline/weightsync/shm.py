"""Same-host shared-memory transport: every trainer rank's two slots are /dev/shm segments. With one
rank holding whole tensors the receiving engine process maps that rank's slot directly (zero-copy)
and `fetch` only waits for the version and checks the header; with several ranks `fetch` waits for
every rank's slot, copies each piece into its place in a staging segment, and re-checks the slot
headers afterwards (a slot rewritten meanwhile is a TornReadError)."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.weightsync import segment as seg
from pipeline.weightsync.shard_plan import ShardPlan
from pipeline.weightsync.transport import NUM_SLOTS, ReceiverTransport, SenderTransport, Slot, SyncHandle, wait_for_version


class ShmSender(SenderTransport):
    kind = "shm"

    def __init__(self, shards: ShardPlan, rank: int, num_receivers: int, cfg) -> None:
        super().__init__(shards, rank, num_receivers, cfg)
        self._segs = [seg.Segment(seg.new_name(f"r{rank}-slot{i}"), self.nbytes, create=True)
                      for i in range(NUM_SLOTS)]
        self.slots = [Slot(s.header, s.data) for s in self._segs]

    def handle_info(self) -> dict[str, Any]:
        return {"segments": [s.name for s in self._segs]}

    def close(self) -> None:
        self.slots = []
        for s in self._segs:
            s.close()


class ShmReceiver(ReceiverTransport):
    """Maps every rank's slots; `fetch` waits for each, then (several ranks) assembles a copy."""

    def __init__(self, handle: SyncHandle, rank: int) -> None:
        super().__init__(handle, rank)
        self._names = [info["segments"] for info in self.infos]
        # one rank: the engine reads the slot itself with the full plan, so map it at the plan's size
        sizes = [self.plan.total_bytes] if self.direct else list(self.shards.totals)
        self._segs = [[seg.Segment(n, size, create=False) for n in names] for names, size in zip(self._names, sizes)]
        self._stage = None if self.direct else seg.Segment(seg.new_name(f"shm-r{rank}"), self.plan.total_bytes,
                                                           create=True)

    async def _slot(self, r: int, version: int, timeout_s: float) -> int:
        async def versions() -> list[int]:
            return [int(s.header[seg.H_VERSION]) for s in self._segs[r]]

        i = await wait_for_version(versions, version, timeout_s, f"trainer rank {r}'s shm slots")
        seg.check_header(self._segs[r][i].header, version, self.expect,
                         f"shm slot {self._names[r][i]} of trainer rank {r}")
        return i

    async def fetch(self, version: int, timeout_s: float) -> str:
        slots = await asyncio.gather(*[self._slot(r, version, timeout_s) for r in range(self.shards.world)])
        if self.direct:
            return self._names[0][slots[0]]
        chosen = [self._segs[r][i] for r, i in enumerate(slots)]

        def recheck() -> None:
            for r, (s, i) in enumerate(zip(chosen, slots)):
                seg.check_header(s.header, version, self.expect,
                                 f"shm slot {self._names[r][i]} of trainer rank {r}", after_read=True)

        # a thread: the copy of a large model must not stall the generator's event loop
        await asyncio.to_thread(self.assemble, self._stage, [s.data for s in chosen], version, recheck)
        return self._stage.name

    def close(self) -> None:
        for segs in self._segs:
            for s in segs:
                s.close()
        if self._stage is not None:
            self._stage.close()
