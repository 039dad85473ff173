"""The tiny checkpoint, `model.hf_dir: builtin:tiny`: a real HF directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json) that trainer
(torchtitan), sampler (vLLM) and reference (HF transformers) all load. Its architecture is a small Qwen3
(q/k norms, tied embeddings); its tokenizer is character level (a BPE model with no merges), which suits
the built-in string tasks.

    hf_dir = ensure_tiny()                                  # builtin:tiny: TINY, built once under CACHE_DIR
    hf_dir = ensure_tiny(TinySpec(seed=1, n_layers=3))      # another seed or shape (tests, benchmarks)
    python -m pipeline.models.tiny [--cache-dir DIR] [--seed N --dim N ...]   # the same; prints the folder

A run names another shape by its folder (model.hf_dir=<the printed folder>).
"""

from __future__ import annotations

import hashlib
import json
import string
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.models.assets import build_once

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_PAD_ID, TINY_BOS_ID, TINY_EOS_ID, TINY_UNK_ID = 0, 1, 2, 3
"""The tiny tokenizer's special ids, which its files are written with. Code reads a checkpoint's ids
from its files (pipeline.tokens.SpecialTokens), never these."""
CHARS = string.ascii_lowercase + string.digits + " +-*=?.,:;()rev"
ROPE_THETA = 1_000_000.0
NORM_EPS = 1e-6
CACHE_DIR = ".cache/tiny-model"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TinySpec:
    """Seed and shape of a tiny checkpoint; TINY is builtin:tiny's."""

    seed: int = 0
    """Seed for the random initial weights."""
    dim: int = 128
    """Hidden size (>= 8, divisible by n_heads; dim/n_heads is the head size, a multiple of 16)."""
    n_layers: int = 2
    """Transformer blocks (1..64)."""
    n_heads: int = 4
    """Attention heads (>= 1)."""
    n_kv_heads: int = 2
    """Key/value heads (divides n_heads)."""
    ffn_dim: int = 256
    """MLP hidden size (>= 8)."""
    max_seq_len: int = 256
    """Context length of the checkpoint (16..131072)."""

    def __post_init__(self) -> None:
        for ok, what in ((self.dim >= 8, "dim >= 8"), (1 <= self.n_layers <= 64, "n_layers in 1..64"),
                         (self.n_heads >= 1 and self.dim % self.n_heads == 0, "n_heads >= 1 dividing dim"),
                         ((self.dim // max(self.n_heads, 1)) % 16 == 0,
                          "a head size dim/n_heads that is a multiple of 16 (attention kernels)"),
                         (self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
                          "n_kv_heads >= 1 dividing n_heads"),
                         (self.ffn_dim >= 8, "ffn_dim >= 8"), (16 <= self.max_seq_len <= 131072,
                                                                "max_seq_len in 16..131072")):
            if not ok:
                raise ValueError(f"TinySpec: {self} needs {what}")


TINY = TinySpec()


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


def hf_config(spec: TinySpec = TINY) -> dict:
    """The config.json of the tiny checkpoint `spec` describes."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": padded_vocab_size(len(tiny_vocab())),
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.dim // spec.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_seq_len,
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


def tiny_dir(spec: TinySpec = TINY, cache_dir: str | Path = CACHE_DIR) -> Path:
    """Cache folder keyed by the seed, shape and tokenizer, so a changed one never reuses old files."""
    key = json.dumps({"tiny": asdict(spec), "chars": CHARS, "format": 1}, sort_keys=True)
    return Path(cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:12]


def _build(spec: TinySpec, out: Path) -> None:
    from pipeline.models import arch_from_config, family

    conf = hf_config(spec)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": TINY_BOS_ID, "eos_token_id": TINY_EOS_ID, "pad_token_id": TINY_PAD_ID}, indent=2))
    build_tokenizer_json(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": spec.max_seq_len, "clean_up_tokenization_spaces": False,
    }, indent=2))
    arch = arch_from_config(conf, "the tiny model")
    fam = family(arch)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = fam.build(arch)
    sd = {k: v.detach().contiguous().clone() for k, v in fam.adapter(arch).to_hf(model.state_dict()).items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def ensure_tiny(spec: TinySpec = TINY, cache_dir: str | Path = CACHE_DIR) -> Path:
    """The tiny checkpoint of `spec`, built deterministically from its seed once under `cache_dir`."""
    return build_once(tiny_dir(spec, cache_dir), lambda tmp: _build(spec, tmp), FILES)


def vocabulary_hash() -> str:
    """The tokenizer entry of a checkpoint fingerprint written before builtin:tiny, when an empty
    model.hf_dir meant the tiny model and its tokenizer was named by this hash of its vocabulary
    (pipeline/checkpoint.py accepts it for builtin:tiny's folder)."""
    return hashlib.sha256(json.dumps({"special": SPECIAL_TOKENS, "vocab": tiny_vocab()},
                                     sort_keys=True).encode()).hexdigest()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build a tiny checkpoint once (builtin:tiny without flags); "
                                             "prints its folder")
    ap.add_argument("--cache-dir", default=CACHE_DIR)
    for f in fields(TinySpec):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    args = ap.parse_args()
    print(ensure_tiny(TinySpec(**{f.name: getattr(args, f.name) for f in fields(TinySpec)}), args.cache_dir))
