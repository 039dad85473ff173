"""The llama and qwen2 families through the real engine and the real CLI, on small checkpoints with the
family's real tokenizer (pipeline/models/family_checkpoint.py: a Llama 3.x-style config with SmolLM2's
tokenizer, untied head and llama3 RoPE scaling; Qwen2.5-0.5B's config shrunk, q/k/v bias, Qwen's tokenizer).
Qwen3's equivalents are tests/test_verify.py, tests/test_lora.py and tests/test_chat_prompts.py.

- one bf16 vLLM engine per family: its greedy tokens are the trainer's argmax (or within bf16's noise of
  it) and its prompt logprobs the trainer's within bf16 tolerance; qwen2: what it serves is the HF
  checkpoint's tensors bit for bit (the fused qkv weight and bias checked against q/k/v_proj); llama
  (an engine with LoRA on): a trained adapter pushed and served gives what the merged HF export computes
  in transformers (fp32), and what the trainer computes;
- the CLI, a few steps with `weight_sync.verify=every`: llama on rdma, qwen2 on shm; every push verified
  and the split mismatch metrics reported within bf16's noise.

    flock /tmp/rl-heavy.lock .venv/bin/python -m pytest -q tests/test_family_engines.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from pipeline.config import Config, GeneratorConfig, LoraConfig, ModelConfig, TrainerConfig
from pipeline.models.hf import token_logprobs
from pipeline.models.family_checkpoint import ensure_family_checkpoint
from pipeline.tokens import load_tokenizer
from pipeline.trainer.step import TrainCore
from tests.test_bf16 import one_rank, restored_environ  # noqa: F401  (fixtures)
from tests.test_verify import assert_two_verified_pushes_and_small_mismatch

from .conftest import REPO

pytestmark = pytest.mark.slow
LORA = LoraConfig(rank=8, alpha=16.0)
QUESTIONS = ["What is 17 + 25?", "Name a prime number larger than 10."]
LP_TOL = 0.05
"""|vLLM bf16 − trainer fp32| on one prompt logprob: bf16 activations on logprobs near −log(vocab) ≈ −11."""


def chat_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   return_dict=False)


async def generate(llm, ids: list[int], sp, lora_request=None):
    from vllm import TokensPrompt

    out = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=os.urandom(4).hex(),
                                  lora_request=lora_request):
        pass
    return out


async def prompt_logprobs(llm, ids: list[int], lora_request=None) -> torch.Tensor:
    from vllm import SamplingParams

    out = await generate(llm, ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), lora_request)
    return torch.tensor([out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))])


def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([ids]))[0].float()


def family_cfg(family: str, **trainer) -> Config:
    hf_dir = ensure_family_checkpoint(family)
    return Config(model=ModelConfig(hf_dir=str(hf_dir), dtype="bfloat16"),
                  generator=GeneratorConfig(on_update="abort", max_model_len=256),
                  trainer=TrainerConfig(lr=1e-3, **trainer))


def start_engine(cfg: Config, loop):
    from pipeline.generator.llm import start_llm

    from pipeline.generator.llm import engine_args
    from pipeline.weightsync import vllm_engine_kwargs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = engine_args(cfg, cfg.model.hf_dir, 0, vllm_engine_kwargs())
    return loop.run_until_complete(asyncio.to_thread(start_llm, args))


def check_greedy_and_logprobs(loop, llm, model, tok) -> dict:
    """vLLM's greedy continuation of each chat prompt and its prompt logprobs over prompt + continuation,
    against the trainer's forward of the same tokens."""
    from vllm import SamplingParams

    worst, exact, steps = 0.0, 0, 0
    for q in QUESTIONS:
        ids = chat_ids(tok, q)
        out = loop.run_until_complete(generate(llm, ids, SamplingParams(max_tokens=8, temperature=0.0)))
        gen = list(out.outputs[0].token_ids)
        assert len(gen) >= 1
        full = ids + gen
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([full])).float(), -1)[0]
        for i, t in enumerate(gen):  # the engine's pick is the trainer's argmax, or as likely within bf16 noise
            row = lp[len(ids) - 1 + i]
            steps += 1
            exact += int(row.argmax().item() == t)
            assert row.max().item() - row[t].item() < LP_TOL, (q, i, t, row.argmax().item())
        served = loop.run_until_complete(prompt_logprobs(llm, full))
        diff = (served - trainer_logprobs(model, full)).abs()
        assert diff.max().item() < LP_TOL and diff.mean().item() < LP_TOL / 5, (q, diff.max(), diff.mean())
        worst = max(worst, diff.max().item())
    assert exact >= steps // 2, (exact, steps)  # near-ties aside, the same tokens
    return {"worst": worst, "exact": exact, "steps": steps}


def test_qwen2_engine_serves_the_checkpoint_and_the_trainers_logprobs(restored_environ, one_rank, loop):
    """Greedy tokens and prompt logprobs against the trainer (fp32 forward of the bf16 checkpoint); the
    served tensors, the fused qkv weight and bias among them, are the checkpoint's HF tensors bit for bit."""
    from safetensors.torch import load_file

    from pipeline.generator.llm import stop_engine
    from pipeline.weightsync import checksum
    from pipeline.weightsync.served import KERNEL
    from pipeline.weightsync.verify import check, served_checksums

    cfg = family_cfg("qwen2")
    core = TrainCore.from_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32")))
    tok = load_tokenizer(cfg.model.hf_dir)
    llm = start_engine(cfg, loop)
    try:
        res = check_greedy_and_logprobs(loop, llm, core.model, tok)
        served = loop.run_until_complete(served_checksums(llm, 60))
    finally:
        stop_engine(llm)
    hf = load_file(os.path.join(cfg.model.hf_dir, "model.safetensors"))
    del hf["lm_head.weight"]  # tied: the file's copy of the embedding, which the engine serves as the embedding
    ref = checksum.of_dict(hf)
    tensors, parts = served
    assert parts["model.layers.0.self_attn.qkv_proj.bias"] == [
        f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    assert check(ref, served, generator=0, version=0) == len(tensors)
    per_layer = ["input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias",
                 "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight"]
    # each Linear as a parameter, or read through its CPU kernel (`@kernel`: oneDNN's packed copy, or where
    # oneDNN cannot make one for a shape, vLLM's torch-linear fallback on the kept parameter)
    assert {n.removesuffix(KERNEL) for n in tensors} == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        *(f"model.layers.{i}.{n}" for i in range(2) for n in per_layer)}, sorted(tensors)
    print("qwen2", res)


def test_llama_engine_serves_the_trainers_logprobs_and_a_pushed_adapter_the_merged_export(
        restored_environ, one_rank, loop, tmp_path):
    """One engine with LoRA on: greedy tokens and prompt logprobs of the base against the trainer; then a
    trained adapter pushed over shm and served through vLLM's LoRA computes what the merged HF export
    computes in transformers (fp32), and what the trainer computes."""
    from transformers import AutoModelForCausalLM

    from pipeline.config import WeightSyncConfig
    from pipeline.generator.llm import stop_engine
    from pipeline.weightsync import WeightReceiver, WeightSender, load_lora_into_vllm

    cfg = family_cfg("llama", lora=LORA)
    tok = load_tokenizer(cfg.model.hf_dir)
    base = TrainCore.from_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"),
                                         trainer=dataclasses.replace(cfg.trainer, lora=LoraConfig())))
    core = TrainCore.from_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32")))
    with torch.no_grad():  # an adapter far from zero, so that serving it or not is visible
        gen = torch.Generator().manual_seed(7)
        for n, p in core.model.named_parameters():
            if ".lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    core.state.export_hf(tmp_path / "merged", merged=True)
    ids = chat_ids(tok, QUESTIONS[0]) + chat_ids(tok, QUESTIONS[1])[1:]
    want = trainer_logprobs(core.model, ids)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        merged = torch.gather(torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1), 1,
                              torch.tensor(ids[1:])[:, None])[:, 0]
    assert (merged - want).abs().max().item() < 1e-4  # the merged export is the trainer's model

    llm = start_engine(cfg, loop)
    sender = WeightSender(WeightSyncConfig(transport="shm", timeout_s=60), core.state.hf_meta(), num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)

    async def serve_adapter():
        await asyncio.gather(sender.push(core.state.hf_state_dict(), 1), receiver.pull(1))
        req = await load_lora_into_vllm(llm, receiver, 1, 60, str(tmp_path / "lora"), LORA, None)
        return await prompt_logprobs(llm, ids, req), await prompt_logprobs(llm, ids)

    try:
        res = check_greedy_and_logprobs(loop, llm, base.model, tok)
        with_adapter, without = loop.run_until_complete(asyncio.wait_for(serve_adapter(), 120))
    finally:
        receiver.close()
        sender.close()
        stop_engine(llm)
    err = (with_adapter - merged).abs()
    assert err.max().item() < LP_TOL and err.mean().item() < LP_TOL / 5, (err.max(), err.mean())
    assert (without - merged).abs().max().item() > max(0.2, 20 * err.max().item())  # the adapter matters
    assert (without - trainer_logprobs(base.model, ids)).abs().max().item() < LP_TOL
    print("llama", res, err.max().item(), (without - merged).abs().max().item())


def run_cli(family: str, transport: str, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
         f"model.hf_dir={ensure_family_checkpoint(family)}", "model.dtype=bfloat16",
         "task.name=pipeline.tasks.dataset", "task.path=examples/gsm8k_style.jsonl", "task.eval_prompts=0",
         "run.warm_start_steps=0", "run.steps=2", "run.eval_every=0", "run.progress=false",
         "run.checkpoint_every=0", "buffer.batch_groups=2", "buffer.group_size=2", "generator.concurrency=4",
         "generator.max_new_tokens=16", f"weight_sync.transport={transport}", "weight_sync.verify=every",
         f"run.out_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)


# llama's CLI run is the real SmolLM2 (a llama checkpoint) in tests/test_smollm2_run.py, every push verified
@pytest.mark.parametrize("family,transport", [("qwen2", "shm")])
def test_cli_run_verifies_every_push_and_reports_small_mismatch(family, transport, tmp_path):
    out = tmp_path / "run"
    p = run_cli(family, transport, out)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    assert_two_verified_pushes_and_small_mismatch(out)
