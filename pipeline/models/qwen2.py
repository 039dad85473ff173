"""Qwen2 / Qwen2.5 checkpoints (`model_type: qwen2`): the dense decoder with a bias on the q/k/v projections
(always, as HF's Qwen2Attention has it; none on o_proj), no q/k norm, no RoPE scaling, the sliding window
refused (HF applies it only with use_sliding_window).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.models.decoder import Arch, Family, Fields, read_common, refuse_sliding_window

MODEL_TYPE = "qwen2"


def read(conf: dict, where: str | Path) -> Arch:
    f = Fields(conf, where, MODEL_TYPE)
    refuse_sliding_window(f)
    return read_common(f, qkv_bias=True)


FAMILY = Family(MODEL_TYPE, read, "Qwen2/Qwen2.5 (q/k/v bias)")
