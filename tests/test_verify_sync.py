"""WeightSync's verify phase (weight_sync.verify) in-process: which pushes are verified, that only the
first one corrupts first, and that a mismatch fails the push naming generator, tensor and version
(also with the reference added from 2 and 4 trainer ranks' shares by the driver's real Trainer handle).

The trainer and generators here are stand-ins with the actors' endpoint signatures (the ordering
logic is what is tested; the real engines, trainer and CLI run in tests/test_verify.py).

    .venv/bin/python -m pytest -q tests/test_verify_sync.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import re

import pytest
import torch

from pipeline.config import Config, WeightSyncConfig
from actors.trainer import Trainer
from pipeline.weightsync.checksum import of_box, of_dict
from pipeline.weightsync.sync import SyncError, WeightSync

WEIGHTS = {"q": torch.randn(4, 8).bfloat16(), "k": torch.randn(2, 8).bfloat16(), "norm": torch.randn(8).bfloat16()}


class Call:
    def __init__(self, fn):
        self.fn = fn

    async def call_one(self, *args):
        return await self.fn(*args)

    async def call(self, *args):  # a mesh endpoint: every rank's answer, by rank
        return await self.fn(*args)


class FakeTrainer:
    def __init__(self) -> None:
        self.references: list[int] = []

    async def push_weights(self, full: bool = False) -> None:
        pass

    async def weight_checksums(self, version: int) -> dict[str, str]:
        self.references.append(version)
        return {k: v.to_wire() for k, v in of_dict(WEIGHTS).items()}


class FakeGenerator:
    """Serves q‖k fused as "qk" and "norm"; `bad` names a tensor it serves one bit off."""

    def __init__(self, bad: str | None = None) -> None:
        self.bad, self.corrupted, self.checked = bad, [], 0
        self.stage_weights = Call(self._stage)
        self.apply_weights = Call(self._apply)
        self.served_checksums = Call(self._served)

    async def _stage(self, version):
        return {"pull_s": 0.0}

    async def _apply(self, version, on_update, corrupt_first):
        self.corrupted.append(corrupt_first)
        return version

    async def _served(self):
        self.checked += 1
        served = {"qk": torch.cat([WEIGHTS["q"], WEIGHTS["k"]]), "norm": WEIGHTS["norm"].clone()}
        if self.bad:
            served[self.bad].view(torch.int16)[0] ^= 1
        return {k: v.to_wire() for k, v in of_dict(served).items()}, {"qk": ["q", "k"]}


def cfg(verify: str) -> Config:
    return dataclasses.replace(Config(), weight_sync=WeightSyncConfig(verify=verify, timeout_s=10))


def push_all(sync: WeightSync, versions) -> None:
    async def run():
        for v in versions:
            await sync.push(v)
    asyncio.run(run())


def test_verify_every_checks_each_push_and_corrupts_only_before_the_first():
    gens = [FakeGenerator(), FakeGenerator()]
    trainer = FakeTrainer()
    sync = WeightSync(trainer, gens, cfg("every"))
    push_all(sync, [1, 2, 3])
    assert trainer.references == [1, 2, 3] and sync.verified_pushes == 3 and sync.pushes == 3
    assert all(g.corrupted == [True, False, False] and g.checked == 3 for g in gens)
    assert "verify_s" in sync.last


def test_verify_k_checks_the_first_push_and_every_kth_after_it():
    gen, trainer = FakeGenerator(), FakeTrainer()
    sync = WeightSync(trainer, [gen], cfg("2"))
    push_all(sync, [1, 2, 3, 4, 5])
    assert trainer.references == [1, 3, 5] and gen.checked == 3 and sync.verified_pushes == 3
    assert gen.corrupted == [True, False, False, False, False]


def test_verify_off_never_reads_back_nor_corrupts():
    gen, trainer = FakeGenerator(bad="norm"), FakeTrainer()
    sync = WeightSync(trainer, [gen], cfg("off"))
    push_all(sync, [1, 2])
    assert trainer.references == [] and gen.checked == 0 and gen.corrupted == [False, False]


@pytest.mark.parametrize("bad, named", [("norm", "norm"), ("qk", "qk (= q + k)")])
def test_a_served_tensor_one_bit_off_fails_the_push_naming_generator_tensor_and_version(bad, named):
    sync = WeightSync(FakeTrainer(), [FakeGenerator(), FakeGenerator(bad=bad)], cfg("every"))
    with pytest.raises(SyncError, match=rf"generator1 does not serve weight version 1 bit for bit: "
                                        rf"1 tensor\(s\) differ.*{re.escape(named)}: "
                                        "served checksum"):
        push_all(sync, [1])
    assert sync.verified_pushes == 0


def test_a_mismatch_with_a_supervisor_takes_the_generator_out_like_a_failed_load():
    reports = []
    gens = [FakeGenerator(), FakeGenerator(bad="norm")]
    sync = WeightSync(FakeTrainer(), gens, cfg("every"), on_failure=lambda i, e: reports.append((i, str(e))))
    push_all(sync, [1])
    assert gens[1] is None and gens[0] is not None and sync.served == {0: 1}  # the live list, taken out
    assert reports and reports[0][0] == 1 and "norm" in reports[0][1] and "version 1" in reports[0][1]


class ShardedMesh:
    """The trainer mesh's endpoints on `ranks` ranks holding uneven row shards (a rank may hold none of a
    tensor): each rank answers its shares, as TrainerActor does, and the real driver-side Trainer adds them."""

    SPLITS = {2: [0, 0.3, 1], 4: [0, 0.1, 0.45, 0.7, 1]}

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.weight_checksums, self.push_weights = Call(self.shares), Call(self.packed)

    async def packed(self, full: bool = False):
        return {r: None for r in range(self.ranks)}

    async def shares(self, version: int):
        out = {r: {} for r in range(self.ranks)}
        for k, w in WEIGHTS.items():
            cuts = [round(w.shape[0] * f) for f in self.SPLITS[self.ranks]]
            for r, (a, b) in enumerate(zip(cuts, cuts[1:])):
                if b > a:
                    out[r][k] = of_box(w[a:b], (a,) + (0,) * (w.dim() - 1), w.shape).to_wire()
        return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_trainer_ranks_are_verified_and_a_mismatch_names_generator_tensor_and_version(ranks):
    c = dataclasses.replace(cfg("every"), trainer=dataclasses.replace(Config().trainer, num_ranks=ranks))
    trainer = Trainer(c, procs=None, mesh=ShardedMesh(ranks))
    sync = WeightSync(trainer, [FakeGenerator(), FakeGenerator()], c)
    push_all(sync, [1, 2])
    assert sync.verified_pushes == 2
    sync = WeightSync(trainer, [FakeGenerator(), FakeGenerator(bad="qk")], c)
    with pytest.raises(SyncError, match=r"generator1 does not serve weight version 1 bit for bit: 1 tensor\(s\) "
                                        r"differ.*qk \(= q \+ k\): served checksum"):
        push_all(sync, [1])
