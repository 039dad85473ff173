"""RMSNorm rounded as HF transformers and vLLM round it, in the compute dtype.

    norm = HFRMSNorm.Config(normalized_shape=576, eps=1e-5).build()   # torchtitan's RMSNorm, same state dict
    y = norm(x)                                                        # bf16 x: HF's order; float32 x: unchanged

Why not torch's RMSNorm as is: below float32, `F.rms_norm` multiplies the float32-normalised input
by the weight and rounds once. HF (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm) and vLLM (`ir.ops.rms_norm`,
its CPU path) round the normalised input to the input dtype first, then multiply by the weight in that
dtype: `weight * (x * rsqrt(mean(x²) + eps)).to(dtype)`. The two differ by one bf16 step on about a
quarter of the outputs. In the trainer's bf16 compute the weight is already bf16 (FSDP2's
MixedPrecisionPolicy casts the float32 master; the KL reference and a LoRA base are stored bf16), so
this module computes exactly HF's and vLLM's numbers. In float32 it calls torch's kernel as before:
both orders agree there but for the last float32 bit, and float32 results stay what they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.nn_modules import RMSNorm


class HFRMSNorm(RMSNorm):
    """torchtitan's RMSNorm (same Config fields, same `weight`) with HF's rounding below float32."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or self.weight is None:
            return super().forward(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # a weight held float32 beside bf16 activations computes as the bf16 model HF would load
        return self.weight.to(x.dtype) * h.to(x.dtype)
