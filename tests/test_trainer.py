"""Trainer mesh on real Monarch procs (gloo, FSDP2 on CPU): 2 ranks match 1 rank, checkpoint resume
across a fresh mesh, bad input refused over the actor boundary, HF export loads back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from actors.trainer import Trainer
from pipeline.config import Config, ModelConfig, TrainerConfig
from pipeline.models.hf import build_model, model_dir, read_hf_config
from tests.test_trainer_core import make_batch, replace

pytestmark = pytest.mark.slow


def cfg_for(ranks: int, **kw) -> Config:
    # A bounded process-group timeout: a collective mismatch fails the test in 240 s instead of hanging
    # (60 s was too short for a 2-rank mesh to start beside a 4-rank one on 2 loaded cores).
    return Config(model=ModelConfig(), trainer=TrainerConfig(num_ranks=ranks, lr=1e-3, init_timeout_s=240, **kw))


def gather(loop, *coros):
    async def _all():
        return await asyncio.gather(*coros)
    return loop.run_until_complete(_all())


@pytest.fixture(scope="module")
def batch():
    model, _ = build_model(model_dir(ModelConfig()))
    return make_batch(model, n=6, mu_noise=0.2, seed=3)


@pytest.fixture(scope="module")
def trainers(loop):
    one, two = gather(loop, Trainer.start(cfg_for(1), name="t1"), Trainer.start(cfg_for(2), name="t2"))
    yield one, two
    gather(loop, one.close(), two.close())


def hf_weights(loop, trainer: Trainer, out) -> dict[str, torch.Tensor]:
    loop.run_until_complete(trainer.export_hf(str(out)))
    return load_file(str(out / "model.safetensors"))


def assert_same_step(w0: dict, w1: dict, w2: dict, atol: float, loose_frac: float) -> None:
    """w2 (sharded) equals w1 (one rank) after the same step from w0: every element within atol, all
    but loose_frac of them within 1e-7, and the step moved the weights (so the comparison means something)."""
    moved, loose, total = 0.0, 0, 0
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=atol, msg=k)
        loose += int(((w2[k] - w1[k]).abs() > 1e-7).sum())
        total += w1[k].numel()
        moved = max(moved, float((w1[k] - w0[k]).abs().max()))
    assert loose <= loose_frac * total, f"{loose} of {total} weights differ by more than 1e-7"
    assert moved > 1e-4


def test_two_rank_fsdp_matches_one_rank(loop, trainers, batch, tmp_path):
    one, two = trainers
    w0 = hf_weights(loop, one, tmp_path / "init")
    m1, m2 = gather(loop, one.train_step(batch), two.train_step(batch))
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)
    for k in ("grad_norm", "tokens", "mismatch_resp_max", "mismatch_resp_mean", "mismatch_max",
              "kl_sampler_learner", "is_ess", "entropy", "clip_frac"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    assert m1["version"] == m2["version"] == 1 and m1["mismatch_max"] > 0
    w1, w2 = hf_weights(loop, one, tmp_path / "one"), hf_weights(loop, two, tmp_path / "two")
    assert w1.keys() == w2.keys()
    # Shard sums differ from the full sum in the last fp32 bit; AdamW's first step g/(|g|+eps)
    # amplifies that only where |g| ~ eps, so: every element within 1% of lr, nearly all within 1e-7.
    assert_same_step(w0, w1, w2, atol=1e-5, loose_frac=1e-4)


def test_fsdp_by_tensor_parallel_mesh_matches_one_rank_and_export_full_weights(loop, trainers, batch, tmp_path):
    """4 gloo ranks as a 2 (FSDP2) x 2 (tensor parallel) mesh: the same loss, metrics and weights
    after a step as 1 rank, read from the exported HF weights, which gather the DTensor shards as
    every push does. (tp = 2 on 2 ranks runs in tests/test_pipeline.py's sync-mode CLI run.)"""
    one = loop.run_until_complete(Trainer.start(cfg_for(1), name="t1tp"))
    tp = loop.run_until_complete(Trainer.start(cfg_for(4, tensor_parallel=2), name="ttp"))
    try:
        w0 = hf_weights(loop, tp, tmp_path / "init")
        assert all(torch.equal(w0[k], v) for k, v in hf_weights(loop, one, tmp_path / "init1").items())
        m1, m2 = gather(loop, one.train_step(batch), tp.train_step(batch))
        w1, w2 = hf_weights(loop, one, tmp_path / "one"), hf_weights(loop, tp, tmp_path / "tp")
    finally:
        gather(loop, one.close(), tp.close())
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)
    for k in ("grad_norm", "tokens", "samples", "mismatch_resp_max", "kl_sampler_learner", "is_ess", "entropy"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    assert w1.keys() == w2.keys()
    # As with FSDP: the shards' sums differ from the full ones in the last fp32 bits, and AdamW's first
    # step, g / (|g| + eps), amplifies that only where |g| ~ eps: every element within 5% of lr, and
    # nearly all within 1e-7.
    assert_same_step(w0, w1, w2, atol=5e-5, loose_frac=1e-3)


def test_bad_batch_refused_across_the_actor_boundary(loop, trainers, batch):
    _, two = trainers
    v = loop.run_until_complete(two.version())
    adv = batch.advantages.clone()
    adv[0] = float("nan")
    with pytest.raises(Exception, match="advantages has 1 non-finite"):
        loop.run_until_complete(two.train_step(replace(batch, advantages=adv)))
    assert loop.run_until_complete(two.version()) == v
    assert loop.run_until_complete(two.train_step(batch))["version"] == v + 1  # still healthy


def test_checkpoint_resumes_on_a_fresh_mesh(loop, trainers, batch, tmp_path):
    _, two = trainers
    loop.run_until_complete(two.save(str(tmp_path / "ckpt"), {"prompt_pos": 5}))
    saved = hf_weights(loop, two, tmp_path / "saved")
    b2 = make_batch(build_model(model_dir(ModelConfig()))[0], n=6, seed=9)
    want = loop.run_until_complete(two.train_step(b2))
    want_w = hf_weights(loop, two, tmp_path / "want")

    fresh = loop.run_until_complete(Trainer.start(cfg_for(2), name="t2b"))
    try:
        assert loop.run_until_complete(fresh.load(str(tmp_path / "ckpt"))) == {"prompt_pos": 5}
        assert loop.run_until_complete(fresh.version()) == want["version"] - 1
        restored = hf_weights(loop, fresh, tmp_path / "restored")
        assert all(torch.equal(restored[k], saved[k]) for k in saved)
        got = loop.run_until_complete(fresh.train_step(b2))
        got_w = hf_weights(loop, fresh, tmp_path / "got")
    finally:
        loop.run_until_complete(fresh.close())
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)


def test_push_weights_publishes_a_snapshot_that_survives_the_next_step(loop, trainers, batch, tmp_path):
    """rank 0 packs the gathered FSDP weights; a receiver reading after the next step still sees them."""
    from pipeline.weightsync import WeightReceiver
    from pipeline.weightsync.segment import Segment

    _, two = trainers
    handle = loop.run_until_complete(two.sync_handle(1))
    receiver = WeightReceiver(handle, rank=0)
    try:
        wv = loop.run_until_complete(two.push_weights())
        version = loop.run_until_complete(two.version())
        assert wv.version == version and wv.total_bytes == handle.plan.total_bytes
        want = hf_weights(loop, two, tmp_path / "pushed")
        loop.run_until_complete(two.train_step(batch))  # overlaps the transfer: must not tear the snapshot
        loop.run_until_complete(receiver.pull(version))
        seg = Segment(receiver.staged_segment(version), handle.plan.total_bytes, create=False)
        got = {k: v.clone() for k, v in handle.plan.unpack(seg.data, version)}
        seg.close()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        after = hf_weights(loop, two, tmp_path / "after")
        assert any(not torch.equal(after[k], want[k]) for k in want)  # the step did change the live weights
    finally:
        receiver.close()


def pull_pushed(loop, trainer: Trainer, transport: str) -> tuple[dict[str, torch.Tensor], int]:
    """One push of `trainer`'s current version over `transport`, pulled by a receiver in this process:
    the whole HF tensors it assembled from every rank's shards, and the version."""
    from pipeline.config import WeightSyncConfig
    from pipeline.weightsync import WeightReceiver
    from pipeline.weightsync.load import read_staged

    handle = loop.run_until_complete(trainer.sync_handle(1, "127.0.0.1", WeightSyncConfig(
        transport=transport, bucket_mb=1, timeout_s=60)))
    receiver = WeightReceiver(handle, rank=0)
    try:
        version = loop.run_until_complete(trainer.version())
        wv, _ = gather(loop, trainer.push_weights(), receiver.pull(version))  # collective: both at once
        assert wv.version == version and handle.shards.world == trainer.cfg.trainer.num_ranks
        return read_staged(receiver, version), version
    finally:
        receiver.close()


@pytest.mark.parametrize("transport", ["shm", "rdma", "collective"])
def test_sharded_push_from_two_ranks_is_bit_identical_to_the_export(loop, trainers, tmp_path, transport):
    """Each of the 2 FSDP ranks sends only its own shards (about half the bytes each, nothing
    gathered); the receiver's assembled tensors are exactly the gathered HF export."""
    _, two = trainers
    got, _ = pull_pushed(loop, two, transport)
    want = hf_weights(loop, two, tmp_path / "want")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_sharded_push_from_an_fsdp_by_tensor_parallel_mesh_is_the_export(loop, tmp_path, family):
    """4 ranks as 2 (FSDP2) x 2 (tensor parallel): column-, row- and 2-D sharded pieces, replicas
    sent once, assembled into exactly the gathered export, and into the HF checkpoint's own tensors
    (a push straight after loading it). qwen3: the tiny model (q/k norms); qwen2: its small checkpoint
    with Qwen's vocabulary (pipeline/models/family_checkpoint.py), whose q/k/v biases are column-sharded
    with the fused QKV weight, KV group by KV group."""
    from pipeline.models.hf import load_hf_state_dict
    from pipeline.models.family_checkpoint import ensure_family_checkpoint

    cfg = cfg_for(4, tensor_parallel=2)
    if family == "qwen2":
        cfg = dataclasses.replace(cfg, model=ModelConfig(hf_dir=str(ensure_family_checkpoint("qwen2"))))
    hf_dir = model_dir(cfg.model)
    tp = loop.run_until_complete(Trainer.start(cfg, name=f"ttpush{family}"))
    try:
        got, _ = pull_pushed(loop, tp, "shm")
        want = hf_weights(loop, tp, tmp_path / "want")
    finally:
        loop.run_until_complete(tp.close())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ckpt = load_hf_state_dict(hf_dir)
    assert set(got) == set(ckpt) - ({"lm_head.weight"} if read_hf_config(hf_dir)["tie_word_embeddings"] else set())
    assert [k for k in got if not torch.equal(got[k], ckpt[k].to(got[k].dtype))] == []
    if family == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in got
