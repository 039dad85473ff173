"""The tiny checkpoint: a real HF directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) that trainer (torchtitan), sampler (vLLM) and reference
(HF transformers) all load. Its architecture is a small Qwen3 (q/k norms, tied embeddings); its tokenizer
is character level (a BPE model with no merges), which suits the built-in string tasks.

    hf_dir = ensure_tiny_assets(cfg.model)   # built once from cfg.model.tiny, cached by its shape

Run `python -m pipeline.model [--cache-dir DIR]` to build it by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.config import ModelConfig, TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID, TINY_UNK_ID = 0, 1, 2, 3
"""The tiny tokenizer's special ids, which its files are written with. Code reads a checkpoint's ids
from its files (pipeline.tokens.SpecialTokens), never these."""
CHARS = string.ascii_lowercase + string.digits + " +-*=?.,:;()rev"
ROPE_THETA = 1_000_000.0
NORM_EPS = 1e-6
_ASSET_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def tiny_vocab() -> dict[str, int]:
    """The tiny tokenizer's vocabulary: special tokens, then CHARS."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    return vocab


def padded_vocab_size(n: int) -> int:
    """The embedding rows for `n` tokens: a multiple of 64."""
    return (n + 63) // 64 * 64


def build_tokenizer_json(path: Path) -> None:
    """Character-level tokenizer: BPE with an empty merge list, Fuse decoder (no added spaces)."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE(vocab=tiny_vocab(), merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


def hf_config(t: TinyModelConfig, vocab_size: int) -> dict:
    """The tiny checkpoint's config.json."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": t.dim,
        "intermediate_size": t.ffn_dim,
        "num_hidden_layers": t.n_layers,
        "num_attention_heads": t.n_heads,
        "num_key_value_heads": t.n_kv_heads,
        "head_dim": t.dim // t.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_seq_len,
        "rms_norm_eps": NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": TINY_BOS_ID,
        "eos_token_id": TINY_EOS_ID,
        "pad_token_id": TINY_PAD_ID,
        "torch_dtype": "float32",
    }


def tiny_config(cfg: ModelConfig) -> dict:
    """config.json of the tiny checkpoint `cfg.tiny` describes (no files needed)."""
    return hf_config(cfg.tiny, padded_vocab_size(len(tiny_vocab())))


def tiny_dir(cfg: ModelConfig) -> Path:
    """Cache folder keyed by the tiny shape and tokenizer, so a changed shape never reuses old files."""
    key = json.dumps({"tiny": asdict(cfg.tiny), "chars": CHARS, "format": 1}, sort_keys=True)
    return Path(cfg.cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:12]


def ensure_tiny_assets(cfg: ModelConfig) -> Path:
    """Build the tiny checkpoint deterministically from `cfg.tiny.seed`, once; return its dir."""
    from pipeline.models import arch_from_config, family

    out = tiny_dir(cfg)
    if all((out / f).is_file() for f in _ASSET_FILES):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    conf = tiny_config(cfg)
    (tmp / "config.json").write_text(json.dumps(conf, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": TINY_BOS_ID, "eos_token_id": TINY_EOS_ID, "pad_token_id": TINY_PAD_ID}, indent=2))
    build_tokenizer_json(tmp / "tokenizer.json")
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": cfg.tiny.max_seq_len, "clean_up_tokenization_spaces": False,
    }, indent=2))
    arch = arch_from_config(conf, "the tiny model")
    fam = family(arch)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.tiny.seed)
        model = fam.build(arch)
    sd = {k: v.detach().contiguous().clone() for k, v in fam.adapter(arch).to_hf(model.state_dict()).items()}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        tmp.rename(out)  # atomic publish; a concurrent builder may have won the race
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
