"""Llama-family checkpoints (`model_type: llama`): Llama 2, Llama 3.x, SmolLM/SmolLM2, Mistral-style dense
models without a sliding window. No q/k norm, no attention or MLP bias, optional Llama 3.1/3.2 RoPE scaling
(`rope_scaling.rope_type: llama3`), tied or untied head. The rest is the dense decoder (decoder.py).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.models.decoder import Arch, Family, Fields, read_common

MODEL_TYPE = "llama"


def read(conf: dict, where: str | Path) -> Arch:
    f = Fields(conf, where, MODEL_TYPE)
    f.only("attention_bias", (False, None), "false (no q/k/v/o bias)")
    f.only("mlp_bias", (False, None), "false")
    f.only("sliding_window", (None,), "null (full attention)")
    return read_common(f, llama3_ok=True)


FAMILY = Family(MODEL_TYPE, read, "Llama 2/3.x, SmolLM, Mistral-style dense models without sliding window")
