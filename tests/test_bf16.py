"""model.dtype=bfloat16 on the tiny torchtitan model: float32 master weights and AdamW state, bf16
compute through FSDP2's MixedPrecisionPolicy (one rank: a one-rank gloo group in this process, as
the trainer actor sets up), and pushes / exports that are exactly the master cast to bf16."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from pipeline.config import Config, GeneratorConfig, LoraConfig, ModelConfig, TrainerConfig, WeightSyncConfig
from actors.trainer import Trainer
from pipeline.generator.llm import stop_engine
from pipeline.models.hf import build_model, export_hf, model_dir, token_logprobs
from pipeline.tokens import load_tokenizer
from pipeline.trainer.parallel import local, resharded
from pipeline.trainer.snapshots import Proximal
from pipeline.trainer.batches import minibatch_plan
from pipeline.trainer.step import TrainCore
from pipeline.weightsync import WeightReceiver, WeightSender, load_into_vllm, vllm_engine_kwargs
from pipeline.weightsync.segment import Segment
from tests.test_trainer import gather
from tests.test_trainer_core import make_batch, replace
from tests.test_weightsync_vllm import COMPLETION, PROMPT, vllm_logprobs


@pytest.fixture()
def one_rank():
    """A one-rank gloo group: the FSDP2 mixed-precision path needs torch.distributed, on one rank too."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture()
def restored_environ():
    """An engine built in this process (under a process group) leaves vLLM's variables in os.environ
    (LOCAL_WORLD_SIZE among them), which every later engine's proc would inherit and start without its
    worker process: the environment goes back as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def bf16_cfg(**trainer) -> Config:
    # LoRA adapters switch between requests only; mis_balance needs each sample from one version
    on_update = "abort" if "lora" in trainer else "drain" if "correction" in trainer else "keep"
    return Config(model=ModelConfig(dtype="bfloat16"), generator=GeneratorConfig(on_update=on_update),
                  trainer=TrainerConfig(**trainer))


def master(core: TrainCore) -> dict[str, torch.Tensor]:
    return {n: local(p).detach().clone() for n, p in resharded(core.model).named_parameters()}


def steps(core: TrainCore, n: int) -> None:
    for i in range(n):
        core.train_step(make_batch(core.model, seed=i, mu_noise=0.1))


def changed_fraction(a: dict, b: dict) -> float:
    return sum(int((a[k] != b[k]).sum()) for k in a) / sum(a[k].numel() for k in a)


def test_bf16_steps_at_a_small_lr_move_the_fp32_master(one_rank):
    core = TrainCore.from_config(bf16_cfg(lr=1e-6))
    assert all(p.dtype == torch.float32 for p in core.model.parameters())
    before = master(core)
    steps(core, 10)
    after = master(core)
    assert all(v.dtype == torch.float32 for st in core.optimizer.state.values() for k, v in st.items() if k != "step")
    # Updates of ~1e-6 round to nothing on bf16 weights of ~1e-2 (the old path: 1.9% moved); the master keeps them.
    assert changed_fraction(before, after) > 0.9
    assert changed_fraction({k: v.bfloat16() for k, v in before.items()},
                            {k: v.bfloat16() for k, v in after.items()}) < 0.2


def test_the_bf16_push_is_the_fp32_master_cast_to_bf16(one_rank):
    core = TrainCore.from_config(bf16_cfg(lr=1e-4))
    steps(core, 2)
    want = {k: v.to(torch.bfloat16) for k, v in export_hf(core.model, core.adapter).items()}  # the fp32 master
    assert all(v.dtype == torch.float32 for v in export_hf(core.model, core.adapter).values())
    meta = core.state.hf_meta()
    sd = core.state.hf_state_dict()
    assert sd.keys() == want.keys() == meta.keys()
    assert all(meta[k].dtype == torch.bfloat16 and meta[k].shape == want[k].shape for k in want)
    assert all(sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], want[k]) for k in want)
    # what the sender packs (the bytes every receiver reads): the plan says bf16, the tensors are the cast master
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_mb=1, timeout_s=30), meta, num_receivers=1)
    try:
        slot = sender.pack(sd, 1)
        packed = dict(sender.plan.unpack(sender.transport.slots[slot].data))
        assert {e.dtype for e in sender.plan.entries} == {"bfloat16"}
        assert all(torch.equal(packed[k], want[k]) for k in want)
    finally:
        sender.close()


def test_bf16_export_writes_the_master_cast_to_bf16(one_rank, tmp_path):
    core = TrainCore.from_config(bf16_cfg(lr=1e-4))
    steps(core, 1)
    core.state.export_hf(tmp_path / "hf")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = export_hf(core.model, core.adapter)
    assert written.keys() == want.keys()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(torch.equal(written[k], want[k].to(torch.bfloat16)) for k in want)


def test_checkpoint_holds_the_fp32_master_and_a_bf16_checkpoint_loads_upcast(one_rank, tmp_path):
    cfg = bf16_cfg(lr=1e-4)
    core = TrainCore.from_config(cfg)
    steps(core, 2)
    core.save(tmp_path / "fp32", {"pos": 1})
    back = TrainCore.from_config(cfg)
    back.load(tmp_path / "fp32")
    assert all(torch.equal(a, b) for a, b in zip(master(core).values(), master(back).values()))
    # A checkpoint of the old bf16 path: every parameter and moment in bf16, plain tensors (one rank had no FSDP).
    old = {k: local(v).detach().to(torch.bfloat16) if k.startswith("model.") or not k.endswith(".step")
           else local(v).detach() for k, v in core.state._dcp_state(False).items()}
    core.save(tmp_path / "bf16", {"pos": 1})
    dcp.save(old, checkpoint_id=str(tmp_path / "bf16"))  # replaces the tensors; trainer_state.json stays
    back = TrainCore.from_config(cfg)
    assert back.load(tmp_path / "bf16") == {"pos": 1}
    got = back.state._dcp_state(False)
    for k, v in old.items():
        assert local(got[k]).dtype == (torch.float32 if v.dtype == torch.bfloat16 else v.dtype), k
        assert torch.equal(local(got[k]), v.to(local(got[k]).dtype)), k
    steps(back, 1)  # and it trains on


def test_bf16_kl_reference_is_the_bf16_cast_of_the_warm_started_master(one_rank, tmp_path):
    core = TrainCore.from_config(bf16_cfg(lr=1e-4, kl_coef=0.1))
    assert all(p.dtype == torch.bfloat16 for p in core.ref_model.parameters())
    steps(core, 1)
    assert core.state.set_reference()
    ref = {n: local(p) for n, p in resharded(core.ref_model).named_parameters()}
    assert all(torch.equal(ref[n], v.bfloat16()) for n, v in master(core).items())
    core.save(tmp_path / "ck")
    back = TrainCore.from_config(bf16_cfg(lr=1e-4, kl_coef=0.1))
    back.load(tmp_path / "ck")
    assert all(torch.equal(local(p), ref[n]) for n, p in resharded(back.ref_model).named_parameters())


def test_bf16_policy_and_kl_reference_compute_the_same_logprobs_at_the_same_weights(one_rank):
    """RoPE rotates in the compute dtype for both (pipeline/models/rope.py), as vLLM does: the fp32-master
    policy computing in bf16 and the bf16-stored reference are one function before any step (a RoPE
    table cast with the model would leave the policy's float32 and the reference's bf16)."""
    core = TrainCore.from_config(bf16_cfg(lr=1e-4, kl_coef=0.1))
    ids = torch.randint(4, 60, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pol, ref = token_logprobs(core.model, ids), token_logprobs(core.ref_model, ids)
    resharded(core.model), resharded(core.ref_model)
    assert torch.equal(pol, ref), (pol - ref).abs().max()


def test_bf16_policy_computes_hf_transformers_bf16_logprobs(one_rank, tmp_path):
    """The trainer's bf16 compute (the float32 master cast by FSDP2's policy) is HF's bf16 function on a
    qwen3 checkpoint whose norm weights are random (the q/k norms included): its RMSNorms round the
    normalised input to bf16 before the weight (pipeline/models/norm.py). torch's order, one rounding
    after the weight, gives a mean |Δ log p| of ~6e-3 here; HF's gives 0 on this machine's kernels."""
    from transformers import AutoModelForCausalLM

    from pipeline.trainer.parallel import Parallel
    from tests.test_model_families import VOCAB, write_checkpoint

    d = write_checkpoint(tmp_path / "qwen3", "qwen3")
    model, _ = Parallel(TrainerConfig(), 0, 1).build(d, torch.bfloat16, LoraConfig())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = token_logprobs(model, ids)
        ref = torch.gather(torch.log_softmax(hf(ids).logits.float()[:, :-1], -1), 2, ids[:, 1:, None])[..., 0]
    resharded(model)
    assert (ours - ref).abs().mean().item() <= 5e-4, (ours - ref).abs().mean()


def test_bf16_mis_balance_snapshots_are_bf16_and_the_master_is_put_back_exactly(one_rank):
    cfg = bf16_cfg(lr=1e-4, correction="mis_balance")
    cfg = dataclasses.replace(cfg, buffer=dataclasses.replace(cfg.buffer, max_staleness=3))
    core = TrainCore.from_config(cfg)
    masters = {}
    for v in range(2):
        masters[v] = master(core)
        core.train_step(make_batch(core.model, seed=v))
    b = make_batch(core.model, seed=7, mu_noise=0.2)
    ver = torch.where(b.loss_mask > 0, 1, -1).long()
    ver[:3][b.loss_mask[:3] > 0] = 0
    ver[5][b.loss_mask[5] > 0] = 2  # the current version: scored with the live weights
    b = replace(b, versions=ver, trainer_version=2)
    live = master(core)
    prox = Proximal(b.loss_mask[:, 1:].shape, core.device, cfg.trainer)
    m = core.snapshots.balance_mixture(core.version, b, minibatch_plan(6, 1, 1, 0, 0), prox)
    assert m["mis_balance/versions"] == 3 and m["mis_balance/fallback"] == 0
    assert all(torch.equal(a, b) for a, b in zip(live.values(), master(core).values()))
    for v in (0, 1):
        assert all(w.dtype == torch.bfloat16 and torch.equal(w, want.bfloat16())
                   for w, want in zip(core.snapshots.weights[v], masters[v].values()))
    first = prox.log_mix.clone()  # the current version scored with the live float32 master
    core.snapshots.balance_mixture(core.version, b, minibatch_plan(6, 1, 1, 0, 0), prox)
    assert torch.equal(prox.log_mix, first)  # ... and now with its bf16 snapshot: the same forward
    core.train_step(b)


def test_bf16_lora_adapters_train_in_fp32_over_a_bf16_base(one_rank):
    core = TrainCore.from_config(bf16_cfg(lr=1e-3, lora=LoraConfig(rank=8, alpha=16)))
    dtypes = {n: p.dtype for n, p in core.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    steps(core, 1)
    sd = core.state.hf_state_dict()
    assert sd and all(v.dtype == torch.bfloat16 for v in sd.values())
    assert any(v.abs().sum() > 0 for k, v in sd.items() if ".lora_B." in k)


def test_bf16_without_torch_distributed_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        TrainCore.from_config(bf16_cfg())


# ---------------------------------------------------------------- heavy: Monarch trainer meshes, a vLLM engine


def pushed(loop, trainer: Trainer) -> dict[str, torch.Tensor]:
    """What a generator receives from `trainer`'s push of its current version: the unpacked bytes."""
    handle = loop.run_until_complete(trainer.sync_handle(1))
    receiver = WeightReceiver(handle, rank=0)
    try:
        wv = loop.run_until_complete(trainer.push_weights())
        loop.run_until_complete(receiver.pull(wv.version))
        seg = Segment(receiver.staged_segment(wv.version), handle.plan.total_bytes, create=False)
        got = {k: v.clone() for k, v in handle.plan.unpack(seg.data, wv.version)}
        seg.close()
    finally:
        receiver.close()
    assert {e.dtype for e in handle.plan.entries} == {"bfloat16"}
    return got


@pytest.mark.slow
def test_bf16_two_rank_fsdp_push_matches_one_rank(loop, tmp_path):
    """1 rank (FSDP2 over a mesh of one) and 2 ranks take the same bf16-compute step: the same loss
    within bf16 rounding, and pushed bf16 weights within one bf16 step of each other (the ranks' bf16
    partial gradients round apart, AdamW's g / (|g| + eps) keeps that near lr)."""
    batch = make_batch(build_model(model_dir(ModelConfig()))[0], n=6, mu_noise=0.2, seed=3)

    def cfg(ranks: int) -> Config:
        return Config(model=ModelConfig(dtype="bfloat16"), trainer=TrainerConfig(num_ranks=ranks, lr=1e-3,
                                                                                 init_timeout_s=240))

    one, two = gather(loop, Trainer.start(cfg(1), name="b1"), Trainer.start(cfg(2), name="b2"))
    try:
        w0 = pushed(loop, one)
        m1, m2 = gather(loop, one.train_step(batch), two.train_step(batch))
        w1, w2 = pushed(loop, one), pushed(loop, two)
        loop.run_until_complete(one.export_hf(str(tmp_path / "one")))
        exported = load_file(str(tmp_path / "one" / "model.safetensors"))
    finally:
        gather(loop, one.close(), two.close())
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-2, abs=1e-4)
    assert all(torch.equal(exported[k], w1[k]) for k in w1)  # the export is the push
    differ = total = 0
    for k in w1:
        assert w1[k].dtype == torch.bfloat16
        torch.testing.assert_close(w2[k].float(), w1[k].float(), rtol=1e-2, atol=3e-3, msg=k)
        differ += int((w1[k] != w2[k]).sum())
        total += w1[k].numel()
    assert differ <= 0.05 * total, f"{differ} of {total} pushed weights differ"
    assert sum(int((w1[k] != w0[k]).sum()) for k in w1) > 0.5 * total  # the step moved them


@pytest.mark.slow
def test_vllm_serves_exactly_the_bf16_cast_of_the_master(restored_environ, one_rank, tiny_dir, loop):
    """A bf16 engine loaded by a push from a bf16 TrainCore holds master.to(bf16) bit for bit, read
    back from the engine's parameters (fused projections are the HF tensors concatenated; the CPU
    backend repacks Linear weights for oneDNN and empties them, so those are checked through the
    logprobs: vLLM's equal a bf16 torchtitan forward of master.to(bf16))."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc carries `served` below
    from vllm.engine.arg_utils import AsyncEngineArgs
    from pipeline.generator.llm import start_llm

    core = TrainCore.from_config(bf16_cfg(lr=1e-3))
    steps(core, 3)
    want = {k: v.to(torch.bfloat16) for k, v in export_hf(core.model, core.adapter).items()}
    args = AsyncEngineArgs(model=str(tiny_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
                           **vllm_engine_kwargs())

    async def start():
        return start_llm(args)

    llm = loop.run_until_complete(start())
    ids = load_tokenizer(tiny_dir)(PROMPT + COMPLETION)["input_ids"]
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_mb=1, timeout_s=60), core.state.hf_meta(), 1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    try:
        before = vllm_logprobs(loop, llm, ids)

        async def sync():
            await asyncio.gather(sender.push(core.state.hf_state_dict(), 1), receiver.pull(1))
            await load_into_vllm(llm, receiver, 1, timeout_s=60)
            return await llm.collective_rpc(served)

        got = loop.run_until_complete(sync())[0]
        after = vllm_logprobs(loop, llm, ids)
    finally:
        receiver.close()
        sender.close()
        stop_engine(llm)
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    checked = []
    for name, t in got.items():
        if t.numel() == 0:  # a Linear the CPU backend repacked
            continue
        f = next((f for f in fused if f in name), None)
        expect = want.get(name, want["model.embed_tokens.weight"]) if f is None else \
            torch.cat([want[name.replace(f"{f}.", f"{f.split('.')[0]}.{p}.")] for p in fused[f]])
        assert t.dtype == torch.bfloat16 and torch.equal(t, expect), name
        checked.append(name)
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"} <= set(checked)
    model, adapter = build_model(tiny_dir, dtype=torch.bfloat16)
    model.load_state_dict(adapter.from_hf(dict(want)), strict=False)
    with torch.no_grad():
        ref = token_logprobs(model, torch.tensor([ids]))[0]
    assert (after - ref).abs().max().item() <= 2e-2, (after, ref)  # bf16 kernels apart (4e-3 measured)
    assert (after - before).abs().max().item() > 5e-2, "vLLM still serves the old weights"


def served(worker) -> dict[str, torch.Tensor]:
    """In the engine's worker: its model's parameters as served."""
    return {n: p.detach().cpu().clone() for n, p in worker.model_runner.get_model().named_parameters()}
