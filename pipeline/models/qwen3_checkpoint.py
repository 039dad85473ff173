"""A Qwen3 checkpoint with real shapes and random weights: Qwen3-0.6B's (or 1.7B's, 4B's, 8B's) config.json,
bf16 safetensors under HF names, and Qwen3's real tokenizer (pipeline/models/qwen3_tokenizer.py), so every
loader (HF transformers, vLLM, this project's torchtitan trainer) takes the path a downloaded Qwen3-0.6B takes.

    conf = qwen3_config()                                   # Qwen3-0.6B exactly
    conf = qwen3_config(model="Qwen3-1.7B")                 # Qwen3-1.7B exactly (also Qwen3-4B, Qwen3-8B)
    conf = qwen3_config(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1)   # shrunk for tests
    hf_dir = build_checkpoint("/tmp/q3", conf, seed=0)      # writes the folder, returns it
    hf_dir = ensure_checkpoint(conf, seed=0)                # the same, built once under .cache/qwen3

A shrunk config keeps what makes the checkpoint Qwen3 rather than a toy: the 151,936-row vocabulary
and its tokenizer, head_dim 128, q/k norms, the model's tying (tied but for Qwen3-8B), RoPE θ = 1e6,
bf16. Weights are drawn N(0, 0.02) (the config's initializer_range) and every RMSNorm weight is 1, as an
untrained Qwen3 is initialised; the logits of such a model are near uniform over the vocabulary. Like the real
Qwen3-0.6B file, model.safetensors stores `lm_head.weight` too, equal to `model.embed_tokens.weight`
(tied models must load with or without it; this project's own saves leave it out).

    python -m tools.build.make_qwen3 --out DIR [--model Qwen3-1.7B] [--layers N --hidden H --ffn F --heads Q --kv-heads KV]
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.models.assets import build_once
from pipeline.models.qwen3_tokenizer import CACHE_DIR, ENDOFTEXT_ID, IM_END_ID, copy_tokenizer, tokenizer_dir

VOCAB_SIZE = 151_936
"""Rows of the embedding: the tokenizer's 151,669 ids padded for the kernels, as Qwen3 ships it."""
HEAD_DIM = 128

QWEN3_0_6B: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB_SIZE,
}
"""Qwen3-0.6B's config.json, field for field."""

QWEN3_1_7B: dict = {**QWEN3_0_6B, "hidden_size": 2048, "intermediate_size": 6144}
"""Qwen3-1.7B's config.json: 0.6B's but hidden 2048 and FFN 6144 (28 layers, 16 query / 8 KV heads of 128,
the same vocabulary, tied embeddings, 40,960 positions)."""

QWEN3_4B: dict = {**QWEN3_0_6B, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                  "num_hidden_layers": 36, "max_window_layers": 36}
"""Qwen3-4B's config.json: 36 layers, hidden 2560, FFN 9728, 32 query / 8 KV heads of 128, tied embeddings,
the same vocabulary and 40,960 positions (4,022,468,096 parameters, the embedding counted once)."""

QWEN3_8B: dict = {**QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                  "num_hidden_layers": 36, "max_window_layers": 36, "tie_word_embeddings": False}
"""Qwen3-8B's config.json: 36 layers, hidden 4096, FFN 12288, 32 query / 8 KV heads of 128, an untied LM
head, the same vocabulary and 40,960 positions (8,190,735,360 parameters, the head counted apart)."""

MODELS: dict[str, dict] = {"Qwen3-0.6B": QWEN3_0_6B, "Qwen3-1.7B": QWEN3_1_7B, "Qwen3-4B": QWEN3_4B,
                           "Qwen3-8B": QWEN3_8B}
"""The shapes `qwen3_config(model=...)` starts from, by the name of the Hugging Face repository."""

_FORMAT = 1  # bump when the files written here change


def qwen3_config(layers: int | None = None, hidden: int | None = None, ffn: int | None = None,
                 heads: int | None = None, kv_heads: int | None = None, model: str = "Qwen3-0.6B") -> dict:
    """`model`'s config (a name in MODELS) with the given sizes replaced (None keeps the model's).
    head_dim stays 128, so the attention width is heads·128 whatever `hidden` is, as in Qwen3 itself."""
    if model not in MODELS:
        raise ValueError(f"qwen3_config: model={model!r} is not one of {', '.join(MODELS)}")
    conf = dict(MODELS[model])
    for key, value in (("num_hidden_layers", layers), ("hidden_size", hidden), ("intermediate_size", ffn),
                       ("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value is not None:
            if value < 1:
                raise ValueError(f"qwen3_config: {key}={value} must be >= 1")
            conf[key] = value
    if conf["num_attention_heads"] % conf["num_key_value_heads"]:
        raise ValueError(f"qwen3_config: num_attention_heads={conf['num_attention_heads']} is not a multiple "
                         f"of num_key_value_heads={conf['num_key_value_heads']}")
    conf["max_window_layers"] = conf["num_hidden_layers"]
    return conf


def tensor_shapes(conf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint under its HF name, in file order, with its shape. Follows the
    config's model_type: q/k norms for qwen3, q/k/v biases for qwen2 (pipeline/models/family_checkpoint.py
    writes qwen2 and llama configs), neither for llama; `lm_head.weight` always (a copy when tied)."""
    d, f = conf["hidden_size"], conf["intermediate_size"]
    hd = conf.get("head_dim") or d // conf["num_attention_heads"]
    q, kv = conf["num_attention_heads"] * hd, conf["num_key_value_heads"] * hd
    kind = conf["model_type"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (conf["vocab_size"], d)}
    for i in range(conf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d)})
        if kind == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if kind == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        shapes.update({
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (conf["vocab_size"], d)
    return shapes


BIAS_STD = 0.5
"""Spread of the q/k/v biases a qwen2 checkpoint is drawn with: large enough that a bias dropped or
misplaced (by a loader, a shard or a push) moves the logits far beyond bf16's noise (Qwen2.5's own
q/k biases reach tens)."""


def random_weights(conf: dict, seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights: norms 1, the rest N(0, initializer_range) drawn in float32 from `seed`; lm_head is a
    copy of the embedding when the config ties them (a copy: safetensors refuses shared storage)."""
    gen = torch.Generator().manual_seed(seed)
    std = conf["initializer_range"]
    sd: dict[str, torch.Tensor] = {}
    for name, shape in tensor_shapes(conf).items():
        if name == "lm_head.weight" and conf["tie_word_embeddings"]:
            sd[name] = sd["model.embed_tokens.weight"].clone()
        elif name.endswith("norm.weight"):
            sd[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            sd[name] = torch.empty(shape).normal_(0.0, BIAS_STD, generator=gen).to(torch.bfloat16)
        else:
            sd[name] = torch.empty(shape).normal_(0.0, std, generator=gen).to(torch.bfloat16)
    return sd


def build_checkpoint(out: str | Path, conf: dict, seed: int = 0, cache_dir: str | Path = CACHE_DIR,
                     tokenizer: Path | None = None) -> Path:
    """Write a loadable folder at `out` (config.json, model.safetensors, tokenizer files): Qwen3's tokenizer,
    or the tokenizer files of folder `tokenizer` (every file but the config, weights and README)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        copy_tokenizer(out, cache_dir)
    else:
        for src in sorted(Path(tokenizer).iterdir()):
            if src.is_file() and src.name not in ("config.json", "model.safetensors", "README.md"):
                shutil.copy2(src, out / src.name)
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    save_file(random_weights(conf, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def checkpoint_dir(conf: dict, seed: int, cache_dir: str | Path = CACHE_DIR, tokenizer: Path | None = None) -> Path:
    """The cache folder of one (config, seed), under the tokenizer it is built with (a `tokenizer` folder
    is keyed by its name, which the builders here make a hash of their inputs)."""
    tok = tokenizer_dir(cache_dir).name if tokenizer is None else Path(tokenizer).name
    extra = {} if conf.get("model_type") == "qwen3" else {"bias_std": BIAS_STD}
    key = json.dumps({"conf": conf, "seed": seed, "format": _FORMAT, "tok": tok, **extra}, sort_keys=True)
    return Path(cache_dir) / f"checkpoint-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_checkpoint(conf: dict, seed: int = 0, cache_dir: str | Path = CACHE_DIR,
                      tokenizer: Path | None = None) -> Path:
    """`build_checkpoint` once per (config, seed, tokenizer) under `cache_dir`, published atomically; returns it."""
    return build_once(checkpoint_dir(conf, seed, cache_dir, tokenizer),
                      lambda tmp: build_checkpoint(tmp, conf, seed, cache_dir, tokenizer), ("model.safetensors",))
