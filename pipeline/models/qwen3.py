"""Qwen3 dense checkpoints (`model_type: qwen3`): the dense decoder with RMSNorm on each head's q and k
before RoPE, no attention bias, no RoPE scaling, the sliding window refused. Its real tokenizer and
checkpoints with real shapes are built offline by qwen3_tokenizer.py and qwen3_checkpoint.py.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.models.decoder import Arch, Family, Fields, read_common, refuse_sliding_window

MODEL_TYPE = "qwen3"


def read(conf: dict, where: str | Path) -> Arch:
    f = Fields(conf, where, MODEL_TYPE)
    f.only("attention_bias", (False, None), "false (no q/k/v/o bias)")
    refuse_sliding_window(f)
    return read_common(f, qk_norm=True)


FAMILY = Family(MODEL_TYPE, read, "Qwen3 dense (q/k norm)")
