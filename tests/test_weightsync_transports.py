"""Every transport moves weights bit-exactly between real Monarch procs, and fails loudly when it must.

A "trainer" proc mesh (1 proc) holds a WeightSender, a "generators" proc mesh (2 procs) holds one
WeightReceiver each; both are module-scoped and reused by every transport.

    .venv/bin/python -m pytest -q tests/test_weightsync_transports.py
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from monarch.actor import Actor, current_rank, endpoint, this_host

from pipeline.config import WeightSyncConfig
from pipeline.weightsync import (BucketPlan, PlanMismatchError, ShortBufferError, SyncTimeoutError,
                                 VersionRegressionError, WeightReceiver, WeightSender)
from pipeline.weightsync.segment import Segment

pytestmark = pytest.mark.slow
NUM_RECEIVERS = 2
TRANSPORTS = ["shm", "rdma", "collective"]
GET_S = 120  # every call on a mesh is bounded


def make_sd(version: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd shapes, 0-d tensors, special values and a tensor larger than a 1 MiB bucket."""
    g = torch.Generator().manual_seed(version)
    sd = {
        "model.embed_tokens.weight": torch.randn(3, 5, 7, generator=g),
        "model.layers.0.a.weight": torch.randn(13, generator=g).bfloat16(),
        "model.layers.0.b.weight": torch.randn(2, 3, generator=g).half(),
        "model.layers.0.steps": torch.randint(-2**62, 2**62, (5,), generator=g),
        "model.layers.0.scale": torch.randn((), generator=g),
        "model.layers.0.count": torch.tensor(version, dtype=torch.int64),
        "model.layers.1.big.weight": torch.randn(300_001, generator=g),  # 1.2 MB: spans two buckets
        "model.norm.weight": torch.tensor([float("inf"), -0.0, float("nan"), 1e-45]),
    }
    return sd


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class SenderActor(Actor):
    def __init__(self, transport: str, timeout_s: float) -> None:
        cfg = WeightSyncConfig(transport=transport, bucket_mb=1, timeout_s=timeout_s)
        self.sender = WeightSender(cfg, make_sd(0), num_receivers=NUM_RECEIVERS)

    @endpoint
    async def sync_handle(self):
        return self.sender.handle()

    @endpoint
    async def push(self, version: int):
        return await self.sender.push(make_sd(version), version)

    @endpoint
    async def shutdown_sender(self) -> None:
        self.sender.close()


class ReceiverActor(Actor):
    def __init__(self) -> None:
        self.receiver: WeightReceiver | None = None

    @endpoint
    async def setup(self, handle) -> None:
        self.receiver = WeightReceiver(handle, rank=current_rank().rank)

    @endpoint
    async def pull(self, version: int) -> dict[str, torch.Tensor]:
        """Pull, then read the staged segment the way the vLLM engine does (map by name, unpack views)."""
        r = self.receiver
        await r.pull(version)
        seg = Segment(r.staged_segment(version), r.plan.total_bytes, create=False)
        try:
            return {k: v.clone() for k, v in r.plan.unpack(seg.data, version)}
        finally:
            seg.close()

    @endpoint
    async def shutdown_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


@pytest.fixture(scope="module")
def meshes():
    trainer = this_host().spawn_procs(per_host={"procs": 1})
    gens = this_host().spawn_procs(per_host={"procs": NUM_RECEIVERS})
    yield trainer, gens
    trainer.stop().get(timeout=GET_S)
    gens.stop().get(timeout=GET_S)


def spawn(meshes, transport: str, timeout_s: float = 30.0):
    trainer, gens = meshes
    sender = trainer.spawn(f"sender_{transport}_{int(timeout_s)}", SenderActor, transport, timeout_s)
    receivers = gens.spawn(f"receivers_{transport}_{int(timeout_s)}", ReceiverActor)
    receivers.setup.call(sender.sync_handle.call_one().get(timeout=GET_S)).get(timeout=GET_S)
    return sender, receivers


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_round_trip_is_bit_exact_across_versions_and_slots(meshes, transport):
    sender, receivers = spawn(meshes, transport)
    try:
        for version in (1, 2, 3):  # three pushes: both slots used, slot 0 reused
            pushed = sender.push.call_one(version)  # concurrent with the pulls (required by collective)
            pulled = receivers.pull.call(version)
            wv = pushed.get(timeout=GET_S)
            assert wv.version == version and wv.num_buckets == 2
            expected = make_sd(version)
            for _, got in pulled.get(timeout=GET_S).items():
                assert list(got) == list(expected)
                for name, t in expected.items():
                    assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
                    assert torch.equal(bits(got[name]), bits(t)), (transport, version, name)
    finally:
        receivers.shutdown_receiver.call().get(timeout=GET_S)
        sender.shutdown_sender.call_one().get(timeout=GET_S)


@pytest.mark.parametrize("transport", ["shm", "rdma"])
def test_pull_of_unpublished_version_times_out_naming_it(meshes, transport):
    sender, receivers = spawn(meshes, transport, timeout_s=2.0)
    try:
        with pytest.raises(Exception, match=r"SyncTimeoutError.*version 7: not published by the sender within 2.0s"):
            receivers.pull.call(7).get(timeout=GET_S)
    finally:
        receivers.shutdown_receiver.call().get(timeout=GET_S)
        sender.shutdown_sender.call_one().get(timeout=GET_S)


# -- in-process error paths (shm transport; the checks are transport independent) --


def _cfg(**kw) -> WeightSyncConfig:
    return WeightSyncConfig(**{"transport": "shm", "bucket_mb": 1, "timeout_s": 2.0, **kw})


def test_plan_is_deterministic_and_splits_large_tensors():
    a, b = BucketPlan.from_state_dict(make_sd(0), 1 << 20), BucketPlan.from_state_dict(make_sd(5), 1 << 20)
    assert a == b and a.num_buckets == 2
    big = next(e for e in a.entries if e.name == "model.layers.1.big.weight")
    assert big.offset + big.nbytes > a.bucket_bytes  # spans into the next bucket
    assert BucketPlan.from_wire(a.to_wire()) == a
    assert BucketPlan.from_state_dict({k: (v.dtype, v.shape) for k, v in make_sd(0).items()}, 1 << 20) == a


def test_plan_mismatch_is_raised_by_sender_and_receiver():
    import asyncio

    sender = WeightSender(_cfg(), make_sd(0), num_receivers=1)
    try:
        bad = make_sd(1)
        bad["model.layers.0.a.weight"] = bad["model.layers.0.a.weight"].float()
        with pytest.raises(PlanMismatchError, match=r"version 1: tensor 'model.layers.0.a.weight'.*bucket 0"):
            asyncio.run(sender.push(bad, 1))
        meta = {k: (v.dtype, v.shape) for k, v in make_sd(0).items()}
        meta["model.layers.0.steps"] = (torch.float64, (5,))  # same bytes, different plan
        handle = replace(sender.handle(), plan=BucketPlan.from_state_dict(meta, 1 << 20))
        receiver = WeightReceiver(handle, rank=0)
        asyncio.run(sender.push(make_sd(2), 2))
        with pytest.raises(PlanMismatchError, match="version 2.*plan"):
            asyncio.run(receiver.pull(2))
        receiver.close()
        short = replace(sender.handle(), plan=BucketPlan.from_state_dict({"x": (torch.float32, (1 << 20,))}, 1 << 20))
        with pytest.raises(ShortBufferError, match="holds"):
            WeightReceiver(short, rank=0)
    finally:
        sender.close()


def test_version_regression_raises_on_push_and_pull():
    import asyncio

    sender = WeightSender(_cfg(), make_sd(0), num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    try:
        async def go():
            await asyncio.gather(sender.push(make_sd(3), 3), receiver.pull(3))
            with pytest.raises(VersionRegressionError, match="version 3"):
                await sender.push(make_sd(3), 3)
            with pytest.raises(VersionRegressionError, match="version 2"):
                await receiver.pull(2)
            await sender.push(make_sd(4), 4)
            await sender.push(make_sd(5), 5)  # both slots now newer than 3
        asyncio.run(go())
        fresh = WeightReceiver(sender.handle(), rank=0)
        with pytest.raises(VersionRegressionError, match="version 3"):
            asyncio.run(fresh.pull(3))
        fresh.close()
    finally:
        receiver.close()
        sender.close()


def test_timeout_names_version():
    import asyncio

    sender = WeightSender(_cfg(timeout_s=0.5), make_sd(0), num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    try:
        with pytest.raises(SyncTimeoutError, match="version 9"):
            asyncio.run(receiver.pull(9))
    finally:
        receiver.close()
        sender.close()
