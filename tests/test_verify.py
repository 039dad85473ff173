"""weight_sync.verify on real components: a vLLM engine on the shrunk Qwen3 checkpoint (bf16, the real
vocabulary) serves a bf16 trainer's push bit for bit as its worker reads it back (CPU kernel copies
through the kernel), names a tensor corrupted in the engine, and the start-up corruption reaches every
served tensor; with shadow weights the corruption drops the copy staged before it, so the swap
serves only what the push wrote into a clone of the corrupted weights. The CLI's verified runs:
collective with 2 trainer ranks (each checksumming its own shards) in tests/test_pipeline.py's
sync-mode run (fp32, tensor-parallel); rdma in tests/test_chat_prompts.py and shm in
tests/test_family_engines.py (qwen2) and tests/test_smollm2_run.py, with the split mismatch metrics
within bf16's noise.

    flock /tmp/rl-heavy.lock .venv/bin/python -m pytest -q tests/test_verify.py
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from pipeline.config import Config, ModelConfig, TrainerConfig, WeightSyncConfig
from pipeline.generator.llm import stop_engine
from pipeline.models.qwen3_checkpoint import ensure_checkpoint, qwen3_config
from pipeline.trainer.step import TrainCore
from pipeline.weightsync import (WeightLoadError, WeightReceiver, WeightSender, load_into_vllm, load_shadow,
                                 swap_into_vllm, vllm_engine_kwargs)
from pipeline.weightsync.checksum import compare
from pipeline.weightsync.verify import VerifyError, check, corrupt_served, served_checksums
from tests.test_bf16 import one_rank, restored_environ  # noqa: F401  (fixtures)
from tests.test_trainer_core import make_batch

from .conftest import REPO

pytestmark = pytest.mark.slow
SMALL = dict(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1)
FLIPPED = "model.layers.1.self_attn.k_norm.weight"


@pytest.fixture(scope="module")
def qwen_dir():
    return ensure_checkpoint(qwen3_config(**SMALL), seed=0, cache_dir=REPO / ".cache" / "qwen3")


def flip_one_bit(worker) -> None:
    """In the engine's worker: one bit of one served weight."""
    p = dict(worker.model_runner.get_model().named_parameters())[FLIPPED]
    p.data.view(torch.int16)[3] ^= 1 << 4


def test_engine_serves_the_push_bit_for_bit_and_names_a_corrupted_tensor(restored_environ, one_rank, qwen_dir,
                                                                         loop):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc carries flip_one_bit
    from vllm.engine.arg_utils import AsyncEngineArgs
    from pipeline.generator.llm import start_llm

    core = TrainCore.from_config(Config(model=ModelConfig(hf_dir=str(qwen_dir), dtype="bfloat16"), trainer=TrainerConfig(lr=1e-3)))
    core.train_step(make_batch(core.model, mu_noise=0.1))  # weights the checkpoint does not hold
    args = AsyncEngineArgs(model=str(qwen_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
                           **vllm_engine_kwargs())
    llm = loop.run_until_complete(asyncio.to_thread(start_llm, args))
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_mb=16, timeout_s=60), core.state.hf_meta(), 1)
    receiver = WeightReceiver(sender.handle(), rank=0)

    async def run():
        await asyncio.gather(sender.push(core.state.hf_state_dict(), 1), receiver.pull(1))
        ref = sender.checksums(1)
        stale = await served_checksums(llm, 60)  # the checkpoint's weights: every trained tensor differs
        await corrupt_served(llm, 60)  # raises unless every served tensor changed
        await load_into_vllm(llm, receiver, 1, timeout_s=60)
        served = await served_checksums(llm, 60)
        n = check(ref, served, generator=0, version=1)
        await llm.collective_rpc(flip_one_bit)
        flipped = await served_checksums(llm, 60)
        # shadow weights: v2 loads into a copy of the served v1 at stage time; the start-up corruption
        # drops that clean copy, so only a copy cloned from the corrupted weights can be swapped in
        core.train_step(make_batch(core.model, mu_noise=0.1))
        await asyncio.gather(sender.push(core.state.hf_state_dict(), 2), receiver.pull(2))
        await load_shadow(llm, receiver, 2, 60)
        await corrupt_served(llm, 60)
        with pytest.raises(WeightLoadError, match="the shadow copy holds version None, not 2"):
            await swap_into_vllm(llm, receiver, 2, 60)
        await load_shadow(llm, receiver, 2, 60)
        await swap_into_vllm(llm, receiver, 2, 60)
        shadow_n = check(sender.checksums(2), await served_checksums(llm, 60), generator=0, version=2)
        assert len(compare(ref, *await served_checksums(llm, 60))) >= 10  # v2 served, not v1
        return ref, stale, served, n, flipped, shadow_n

    try:
        ref, stale, served, n, flipped, shadow_n = loop.run_until_complete(run())
    finally:
        receiver.close()
        sender.close()
        stop_engine(llm)
    tensors, parts = served
    # fused projections against their HF parts; the LM head's packed copy against the tied embedding
    assert parts["model.layers.0.self_attn.qkv_proj.weight"] == [
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert parts["lm_head.weight@kernel"] == ["model.embed_tokens.weight"]
    # every pushed HF tensor is checked: each served tensor is an HF one or the fused copy of its parts
    # (how many depends on the kernels vLLM picks on this CPU: fused kept packed or split back)
    covered = {name for t in tensors for name in parts.get(t, [t])}
    assert n == shadow_n == len(tensors) and covered >= set(ref), sorted(set(ref) - covered)
    assert "model.layers.0.mlp.down_proj.weight" in tensors
    assert len(compare(ref, *stale)) >= 10  # a step moved most tensors, and the check sees it
    with pytest.raises(VerifyError, match=rf"generator0 does not serve weight version 1 bit for bit: 1 tensor\(s\) "
                                          rf"differ from the trainer's: {FLIPPED}: served checksum"):
        check(ref, flipped, generator=0, version=1)


def assert_two_verified_pushes_and_small_mismatch(out) -> None:
    """A 2-step CLI run's records: both pushes verified, and per step a sampler/learner mismatch that
    is bf16 sampler noise (bf16 engines against a bf16 forward of the same weights)."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pushes"] == {"started": 2, "verified": 2}, summary["pushes"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "mismatch_max" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch_cur_frac"] + r["mismatch_stale_frac"] == pytest.approx(1.0)
        assert r["mismatch_max"] < 0.1 and abs(r["kl_sampler_learner"]) < 0.02, r
