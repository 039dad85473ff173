"""Rotary position embedding as HF transformers and vLLM compute it, in the compute dtype.

    rope = HFRoPE.Config(head_dim=64, theta=1e6).build()   # one per attention layer: no table
    q, k = rope(q, k, positions)                            # rotate-half (GPT-NeoX) layout, HF row order

Why not torchtitan's CosSinRoPE: it keeps a cos/sin table of max_position_embeddings rows in every
layer (1 GiB fp32 at Qwen3-0.6B per model), as a buffer that `model.to(bf16)` rounds for the KL
reference while the float32-master policy keeps it float32, and rotates in float32. HF and vLLM
compute the angles in float32, cast cos/sin to the query's dtype and rotate in that dtype; so does
this module, on the fly from `inv_freq` (head_dim / 2 floats, kept float32 whatever the model is
cast to), so the policy (bf16 compute over fp32 masters), the reference (bf16) and the engine
rotate with the same numbers.

`llama3` scaling (Llama 3.1 / 3.2) is HF's `_compute_llama3_parameters`, line for line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torchtitan.protocols.module import Module


def inv_freq(head_dim: int, theta: float, llama3: dict | None = None) -> torch.Tensor:
    """float32 [head_dim / 2]: HF's default RoPE frequencies, then llama3 scaling when given
    (keys factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if not llama3:
        return freq
    factor, low, high = llama3["factor"], llama3["low_freq_factor"], llama3["high_freq_factor"]
    old_len = llama3["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class HFRoPE(Module):
    """RoPE for query/key [B, L, heads, head_dim] at `positions` [B or 1, L] (default 0 .. L-1)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        head_dim: int
        max_seq_len: int
        """max_position_embeddings, for torchtitan's Decoder.Config.max_seq_len; no table is sized by it."""
        theta: float = 10000.0
        llama3: dict | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        c = self.config
        freq = inv_freq(c.head_dim, c.theta, c.llama3)  # on the default device (meta under torch.device("meta"))
        return freq if device is None else freq.to(device)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        self.inv_freq = self._inv_freq(buffer_device or self.inv_freq.device)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.inv_freq = self._inv_freq(self.inv_freq.device)  # a model-wide .to(bf16) must not round it
        return out

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            positions = torch.arange(query.shape[1], device=query.device)[None]
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(query.device)  # [B|1, L, hd/2]
        emb = torch.cat((angles, angles), dim=-1)[:, :, None, :]
        cos, sin = emb.cos().to(query.dtype), emb.sin().to(query.dtype)
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
