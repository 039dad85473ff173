"""The trainer (torchtitan) and the reference (HF transformers) model the same function."""

import json

import torch

from pipeline.models.hf import build_model, export_hf, load_hf_state_dict, token_logprobs
from pipeline.models.tiny import TINY_EOS_ID, TinySpec, ensure_tiny
from pipeline.tokens import load_tokenizer


def _batch(vocab: int, n=3, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, t), generator=g)


def test_torchtitan_logits_equal_hf_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    model, _ = build_model(tiny_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    ids = _batch(model.tok_embeddings.weight.shape[0])
    with torch.no_grad():
        diff = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4, diff


def test_hf_to_torchtitan_to_hf_round_trip_is_bit_exact(tiny_dir):
    model, adapter = build_model(tiny_dir)
    src = load_hf_state_dict(tiny_dir)
    out = export_hf(model, adapter)
    assert sorted(src) == sorted(out)
    for k in src:
        assert src[k].dtype == out[k].dtype and torch.equal(src[k], out[k]), k


def test_tiny_assets_are_deterministic_per_seed(tmp_path):
    a = ensure_tiny(TinySpec(seed=1), tmp_path / "a")
    b = ensure_tiny(TinySpec(seed=1), tmp_path / "b")
    c = ensure_tiny(TinySpec(seed=2), tmp_path / "c")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert ensure_tiny(TinySpec(seed=1), tmp_path / "a") == a


def test_tokenizer_is_character_level_and_round_trips(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    ids = tok("rev abc=")["input_ids"]
    assert len(ids) == len("rev abc=") and tok.decode(ids) == "rev abc="
    assert tok.eos_token_id == TINY_EOS_ID == json.loads((tiny_dir / "config.json").read_text())["eos_token_id"]


def test_token_logprobs_align_with_next_token(tiny_dir):
    model, _ = build_model(tiny_dir)
    ids = _batch(model.tok_embeddings.weight.shape[0], n=2, t=6)
    with torch.no_grad():
        lp = token_logprobs(model, ids)
        manual = torch.log_softmax(model(ids[:, :3]).float(), -1)[:, 1, :].gather(1, ids[:, 2:3]).squeeze(1)
    assert lp.shape == (2, 5)
    assert torch.allclose(lp[:, 1], manual, atol=1e-5)
