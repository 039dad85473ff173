"""Delta pushes (weight_sync.delta) over rdma and collective between real Monarch procs: bit-exact
with what a full push delivers, across several versions and 1 or 2 trainer ranks; a receiver that
missed a version gets the full bytes (rdma: it decides; collective: the sender is told), and one
handed a delta it holds no base for fails naming itself, the tensor side and the version.

A "trainer" proc mesh (1 proc) holds one WeightSender per trainer rank (each with its own shard);
a "generators" mesh (2 procs) one WeightReceiver each, as in tests/test_weightsync_transports.py.

    .venv/bin/python -m pytest -q tests/test_delta_transports.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from monarch.actor import Actor, current_rank, endpoint

from pipeline.config import WeightSyncConfig
from pipeline.weightsync import WeightReceiver, WeightSender
from pipeline.weightsync.segment import Segment
from pipeline.weightsync.transport import merge_handles

# the same trainer (1 proc) and generator (2 procs) meshes as the full-push tests, one pair per module
from .test_weightsync_transports import GET_S, NUM_RECEIVERS, meshes  # noqa: F401

pytestmark = pytest.mark.slow
ROWS = 64


def make_sd(version: int) -> dict[str, torch.Tensor]:
    """Version 0 random; each later version changes ~1% of the elements of the one before."""
    g = torch.Generator().manual_seed(0)
    sd = {"embed.weight": torch.randn(ROWS, 1000, generator=g).bfloat16(),
          "norm.weight": torch.randn(ROWS, generator=g).bfloat16(),
          "scale": torch.randn((), generator=g), "big.weight": torch.randn(400_001, generator=g).bfloat16()}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for t in sd.values():
            hit = torch.rand(t.shape, generator=g) < 0.01
            t[hit] = t[hit] * 1.5 + 0.01
    return sd


def holdings(world: int) -> list | None:
    """Rank r of `world` holds rows [r*ROWS/world, ...) of embed.weight; the rest is replicated."""
    if world == 1:
        return None
    per = ROWS // world
    return [[("embed.weight", (r * per, 0), (per, 1000)), ("norm.weight", (0,), (ROWS,)), ("scale", (), ()),
             ("big.weight", (0,), (400_001,))] for r in range(world)]


def boxes(sd: dict, world: int, rank: int) -> list[torch.Tensor]:
    per = ROWS // world
    return [sd["embed.weight"][rank * per:(rank + 1) * per], sd["norm.weight"], sd["scale"], sd["big.weight"]]


class SenderActor(Actor):
    def __init__(self, transport: str, world: int) -> None:
        cfg = WeightSyncConfig(transport=transport, bucket_mb=1, timeout_s=30.0, delta=True, full_every=0)
        meta = {k: (v.dtype, tuple(v.shape)) for k, v in make_sd(0).items()}
        self.world = world
        self.senders = [WeightSender(cfg, meta, NUM_RECEIVERS, holdings=holdings(world), rank=r) for r in range(world)]

    @endpoint
    async def sync_handle(self):
        return merge_handles([s.handle() for s in self.senders])

    @endpoint
    async def push(self, version: int, full: bool = False) -> list[float]:
        """Every rank's delta bytes (-1: full) for `version`."""
        sd = make_sd(version)
        await asyncio.gather(*[s.push(boxes(sd, self.world, r) if self.world > 1 else sd, version, full)
                               for r, s in enumerate(self.senders)])
        return [s.last_timing["delta_bytes"] for s in self.senders]

    @endpoint
    async def shutdown_sender(self) -> None:
        for s in self.senders:
            s.close()


class ReceiverActor(Actor):
    def __init__(self) -> None:
        self.receiver: WeightReceiver | None = None

    @endpoint
    async def setup(self, handle) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver(handle, rank=current_rank().rank)

    @endpoint
    async def pull(self, version: int, ranks: list[int]) -> tuple[dict, dict] | None:
        """Receivers in `ranks` pull and read the staged segment as the engine does; the others skip."""
        r = self.receiver
        if r.rank not in ranks:
            return None
        await r.pull(version)
        seg = Segment(r.staged_segment(version), r.plan.total_bytes, create=False)
        try:
            return {k: v.clone() for k, v in r.plan.unpack(seg.data, version)}, dict(r.last_timing)
        finally:
            seg.close()

    @endpoint
    async def forget(self, rank: int) -> None:
        """Receiver `rank` loses its valid copy, as after a failed apply (its next pull must be full)."""
        if self.receiver.rank == rank:
            self.receiver.transport.held = None

    @endpoint
    async def shutdown_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()



def spawn(meshes, transport: str, world: int, name: str):
    trainer, gens = meshes
    sender = trainer.spawn(f"dsender_{transport}_{world}_{name}", SenderActor, transport, world)
    receivers = gens.spawn(f"dreceivers_{transport}_{world}_{name}", ReceiverActor)
    receivers.setup.call(sender.sync_handle.call_one().get(timeout=GET_S)).get(timeout=GET_S)
    return sender, receivers


def step(sender, receivers, version: int, ranks=(0, 1), full: bool = False):
    """Push `version` while the receivers in `ranks` pull it; (sender's delta bytes per rank, pulls)."""
    pushed = sender.push.call_one(version, full)  # concurrent with the pulls (required by collective)
    pulled = receivers.pull.call(version, list(ranks))
    got = [p for _, p in pulled.get(timeout=GET_S).items()]
    return pushed.get(timeout=GET_S), [p for p in got if p is not None]


def assert_exact(pulls, version: int) -> None:
    want = make_sd(version)
    for sd, _ in pulls:
        for name, t in want.items():
            assert torch.equal(sd[name].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (version, name)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("transport", ["rdma", "collective"])
def test_delta_pushes_are_bit_exact_and_small_across_versions(meshes, transport, world):
    sender, receivers = spawn(meshes, transport, world, "exact")
    try:
        for version in (1, 2, 3, 4):
            sent, pulls = step(sender, receivers, version)
            assert len(pulls) == NUM_RECEIVERS
            assert_exact(pulls, version)
            for _, timing in pulls:
                if version == 1:  # nothing to diff against yet: full
                    assert sent == [-1.0] * world and timing["delta_ranks"] == 0
                    assert timing["bytes"] == timing["full_bytes"]
                else:  # ~1% of bf16 elements changed: ~6 bytes each (index + value) of 2
                    assert all(0 < b < 0.1 * timing["full_bytes"] / world for b in sent), sent
                    assert timing["delta_ranks"] == world
                    assert timing["bytes"] < 0.1 * timing["full_bytes"] if transport == "collective" else \
                        timing["bytes"] < 0.5 * timing["full_bytes"]  # rdma reads whole 64 KiB delta buffers
    finally:
        receivers.shutdown_receiver.call().get(timeout=GET_S)
        sender.shutdown_sender.call_one().get(timeout=GET_S)


def test_rdma_receiver_that_skipped_a_version_reads_it_full(meshes):
    sender, receivers = spawn(meshes, "rdma", 1, "skip")
    try:
        step(sender, receivers, 1)
        _, pulls = step(sender, receivers, 2, ranks=(0,))  # receiver 1 misses version 2
        assert pulls[0][1]["delta_ranks"] == 1
        _, pulls = step(sender, receivers, 3)  # receiver 1 holds 1, the delta is against 2
        assert_exact(pulls, 3)
        assert sorted(t["delta_ranks"] for _, t in pulls) == [0, 1]
        _, pulls = step(sender, receivers, 4)  # both hold 3 again
        assert_exact(pulls, 4)
        assert [t["delta_ranks"] for _, t in pulls] == [1, 1]
    finally:
        receivers.shutdown_receiver.call().get(timeout=GET_S)
        sender.shutdown_sender.call_one().get(timeout=GET_S)


def test_collective_delta_without_its_base_fails_naming_receiver_and_version_then_full_recovers(meshes):
    sender, receivers = spawn(meshes, "collective", 1, "base")
    try:
        step(sender, receivers, 1)
        step(sender, receivers, 2)
        receivers.forget.call(1).get(timeout=GET_S)
        with pytest.raises(Exception, match=r"version 3: delta for receiver 1 \(trainer rank 0's shard\) is "
                                            r"against version 2, but its staged copy holds no valid version"):
            step(sender, receivers, 3)
        sent, pulls = step(sender, receivers, 4, full=True)  # what WeightSync asks for after a failure
        assert sent == [-1.0] and [t["delta_ranks"] for _, t in pulls] == [0, 0]
        assert_exact(pulls, 4)
        sent, pulls = step(sender, receivers, 5)
        assert sent[0] > 0 and [t["delta_ranks"] for _, t in pulls] == [1, 1]
        assert_exact(pulls, 5)
    finally:
        receivers.shutdown_receiver.call().get(timeout=GET_S)
        sender.shutdown_sender.call_one().get(timeout=GET_S)
