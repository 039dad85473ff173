"""LoRA (pipeline/lora.py): only adapters train and only adapters are pushed; the PEFT layout merges
back to exactly the trainer's model; a pushed version served through vLLM's LoRA (a real CPU engine)
gives the trainer's logprobs, and the next version replaces it.

    .venv/bin/python -m pytest -q tests/test_lora.py -x
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from pipeline.config import Config, ConfigError, GeneratorConfig, LoraConfig, ModelConfig, TrainerConfig, load_config
from pipeline.models.hf import read_hf_config, token_logprobs
from pipeline.lora import lora_parameters
from pipeline.models.tiny import ensure_tiny
from pipeline.trainer.snapshots import Proximal
from pipeline.trainer.batches import minibatch_plan
from pipeline.trainer.step import TrainCore

from tests.conftest import REPO
from tests.test_trainer_core import make_batch, mis_cfg, trainer_log_mixture, with_versions

LORA = LoraConfig(rank=8, alpha=16.0)


def lora_cfg(**kw) -> Config:
    return Config(model=ModelConfig(hf_dir=str(ensure_tiny(cache_dir=REPO / ".cache" / "tiny-model"))),
                  generator=GeneratorConfig(on_update="abort"), trainer=TrainerConfig(lr=3e-3, lora=LORA, **kw))


def trained_core(steps: int = 2) -> TrainCore:
    core = TrainCore.from_config(lora_cfg())
    for s in range(steps):
        core.train_step(make_batch(core.model, seed=30 + s, mu_noise=0.1))
    return core


def test_only_the_adapters_train_and_a_push_carries_only_them(tiny_dir):
    from pipeline.weightsync import BucketPlan

    core = TrainCore.from_config(lora_cfg())
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    core.train_step(make_batch(core.model, seed=5, mu_noise=0.1))
    changed = {n for n, p in core.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)  # the base is frozen
    assert {n for n in before if ".lora_B" in n} <= changed  # B leaves 0: the adapter now does something
    conf = read_hf_config(tiny_dir)
    sd = core.state.hf_state_dict()
    assert len(sd) == conf["num_hidden_layers"] * 7 * 2  # q, k, v, o, gate, up, down; A and B each
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in sd)
    plan = BucketPlan.from_state_dict(core.state.hf_meta(), 1 << 20)
    assert {e.name for e in plan.entries} == set(sd)
    from pipeline.models.hf import export_hf

    full = sum(v.numel() * v.element_size() for v in export_hf(core.model, core.adapter).values())
    assert plan.total_bytes * 5 < full  # r = 8 on a 128-wide model: a fraction of the weights


def test_merged_export_is_the_trainers_model_and_peft_export_holds_the_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.lora import merge_into_hf, read_peft

    core = trained_core()
    core.state.export_hf(tmp_path / "merged", merged=True)
    core.state.export_hf(tmp_path / "peft")
    ids = torch.randint(4, 50, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = token_logprobs(core.model, ids)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        lp = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1)
        got = torch.gather(lp, 2, ids[:, 1:, None]).squeeze(-1)
    assert (got - want).abs().max() < 1e-4
    peft = read_peft(tmp_path / "peft" / "adapter")
    assert peft.keys() == core.state.hf_state_dict().keys()
    from safetensors.torch import load_file

    base = load_file(str(tmp_path / "peft" / "model.safetensors"))
    merged = merge_into_hf(base, peft, LORA)
    again = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert all(torch.allclose(merged[k], again[k], atol=1e-6) for k in again)


def test_mis_balance_snapshots_hold_only_the_adapters_and_score_as_full_copies():
    """With LoRA the frozen base is the same in every version: a snapshot (and the live copy put back)
    holds the adapters only, its reported bytes are theirs in the snapshot dtype, and log_mix is the
    log-mixture of forwards with whole copies of each version's weights."""
    c = mis_cfg(dataclasses.replace(lora_cfg(), generator=GeneratorConfig(on_update="drain")), max_staleness=2)
    core = TrainCore.from_config(c)
    copies = {}
    for v in range(2):
        copies[v] = {k: w.detach().clone() for k, w in core.model.state_dict().items()}
        core.train_step(make_batch(core.model, seed=50 + v, mu_noise=0.1))
    copies[2] = {k: w.detach().clone() for k, w in core.model.state_dict().items()}
    own = [0, 0, 1, 1, 2, 2]
    b = with_versions(make_batch(core.model, seed=52, mu_noise=0.2), own, 2)
    prox = Proximal(b.loss_mask[:, 1:].shape, core.device, c.trainer)
    m = core.snapshots.balance_mixture(core.version, b, minibatch_plan(6, 1, 1, 0, 0), prox)
    adapters = lora_parameters(core.model)
    assert [p for p in core.model.parameters() if p.requires_grad] == adapters
    mb = sum(p.numel() for p in adapters) * torch.float32.itemsize / 2**20  # model.dtype float32
    assert all(len(core.snapshots.weights[v]) == len(adapters) for v in range(3))
    assert m["mis_balance/snapshot_mb"] == pytest.approx(mb) and m["mis_balance/live_copy_mb"] == pytest.approx(mb)
    assert m["mis_balance/snapshot_mb"] < sum(p.numel() for p in core.model.parameters()) * 4 / 2**20 / 10
    assert prox.log_mix.tolist() == pytest.approx(trainer_log_mixture(c, copies, b, own), abs=1e-4)
    assert all(torch.equal(w, copies[2][k]) for k, w in core.model.state_dict().items())  # live weights back


def test_config_refuses_lora_with_keep_or_tensor_parallel_and_bad_values():
    tiny = REPO / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError, match="generator.on_update.*adapter"):
        load_config(tiny, ["trainer.lora.rank=16"])  # tiny.yaml updates with keep
    with pytest.raises(ConfigError, match="trainer.tensor_parallel"):
        load_config(tiny, ["trainer.lora.rank=16", "generator.on_update=abort", "trainer.num_ranks=2",
                           "trainer.tensor_parallel=2"])
    for ov, key in (("trainer.lora.rank=7", "trainer.lora.rank"), ("trainer.lora.alpha=0", "trainer.lora.alpha"),
                    ("trainer.lora.targets=wq", "trainer.lora.targets"),
                    ("trainer.lora.targets=wo,wo", "trainer.lora.targets")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(tiny, [ov, "generator.on_update=abort"])
    assert load_config(tiny, ["trainer.lora.rank=16", "generator.on_update=drain"]).trainer.lora.rank == 16


@pytest.mark.slow
def test_pushed_adapters_served_by_vllm_lora_give_the_trainers_logprobs(tiny_dir, loop, tmp_path):
    """Trainer -> WeightSender (shm) -> WeightReceiver -> load_lora_into_vllm -> vLLM's CPU LoRA:
    prompt logprobs with the served adapter equal the trainer's; the next version replaces it (the
    previous adapter's directory stays for a request still naming it; the generator's Engine removes it at the
    next update)."""
    from vllm import SamplingParams, TokensPrompt
    from pipeline.generator.llm import start_llm

    from pipeline.config import WeightSyncConfig
    from pipeline.generator.llm import engine_args, stop_engine
    from pipeline.weightsync import WeightReceiver, WeightSender, load_lora_into_vllm, vllm_engine_kwargs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env_before = dict(os.environ)
    cfg = lora_cfg()
    cfg = dataclasses.replace(cfg, generator=dataclasses.replace(cfg.generator, max_model_len=128))
    core = TrainCore.from_config(cfg)
    ids = [int(x) for x in torch.randint(4, 50, (16,), generator=torch.Generator().manual_seed(2))]

    async def served(llm, req) -> torch.Tensor:
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=os.urandom(4).hex(),
                                      lora_request=req):
            pass
        return torch.tensor([out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))])

    async def go():
        llm = start_llm(engine_args(cfg, tiny_dir, 0, vllm_engine_kwargs()))
        sender = WeightSender(WeightSyncConfig(transport="shm", timeout_s=60), core.state.hf_meta(), num_receivers=1)
        receiver = WeightReceiver(sender.handle(), rank=0)
        res, req = [], None
        try:
            for v in (1, 2):
                core.train_step(make_batch(core.model, seed=40 + v, mu_noise=0.1))
                with torch.no_grad():
                    want = token_logprobs(core.model, torch.tensor([ids]))[0]
                await asyncio.gather(sender.push(core.state.hf_state_dict(), v), receiver.pull(v))
                prev = req
                req = await load_lora_into_vllm(llm, receiver, v, 60, str(tmp_path), LORA, prev)
                got = await served(llm, req)
                base = await served(llm, None)
                res.append((v, (got - want).abs().max().item(), (base - want).abs().max().item(),
                            await llm.get_weight_version(), prev is None or os.path.exists(prev.lora_path)))
        finally:
            receiver.close()
            sender.close()
            stop_engine(llm)
        return res

    try:
        res = loop.run_until_complete(asyncio.wait_for(go(), 300))
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    for v, err, base_err, label, prev_kept in res:
        assert err < 1e-3, (v, err)  # base + this version's adapter, as the trainer has it
        assert base_err > 1e-2, (v, base_err)  # and the adapter matters
        assert label == str(v) and prev_kept
