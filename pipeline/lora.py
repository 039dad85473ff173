"""LoRA: low-rank adapters on the trainer's torchtitan model, pushed alone and served by vLLM's LoRA.

    apply_lora(model, LoraConfig(rank=16, alpha=32))   # freeze the base; A/B on every target Linear
    sd = peft_state_dict(model, arch, lcfg)             # PEFT names: what a weight push carries
    write_peft(dir, sd, lcfg, base_dir)                 # adapter_config.json + adapter_model.safetensors
    merged = merge_into_hf(hf_sd, sd, lcfg)             # base + scale * B @ A, under HF names

Each target Linear (the blocks' fused QKV `wqkv`, `wo`, and the FFN's `w1`, `w2`, `w3`) gets
`lora_A` [r, in] (PEFT's Kaiming-uniform init) and `lora_B` [out, r] (zeros, so a fresh adapter
changes nothing), and its output becomes W x + (alpha / r) B A x; every other parameter is frozen,
and the optimizer only sees the adapters. Names in the PEFT layout vLLM loads
(`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, ...): the fused QKV adapter
(one A, one B over the fused output, laid out KV group by KV group as torchtitan's FusedQKVLinear is)
is the same map as three adapters q/k/v sharing A, each with its block of B's rows.

Serving: the generators' engines run with vLLM's LoRA support (enable_lora; on CPU the Punica CPU
kernels, with compilation off) on the base weights they started from, and each version's adapter
is added as a LoRA of its own (`LoRARequest`), which every later request uses; the previous one is
removed. A weight push therefore carries the adapters only (`sync_bench --lora` measures it). An
engine can only switch adapters between requests, so `generator.on_update=keep` (requests frozen
mid-generation continue under the new version) is refused with LoRA; abort and drain work.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.config import LORA_TARGETS, LoraConfig
from pipeline.models import Arch, family

__all__ = ["apply_lora", "lora_parameters", "peft_state_dict", "write_peft", "read_peft",
           "merge_into_hf", "peft_names"]

def _targets(lcfg: "LoraConfig") -> list[str]:
    return [t.strip() for t in lcfg.targets.split(",") if t.strip()]


def _hook(module: torch.nn.Module, inputs, output):
    x = inputs[0]
    return output + module.lora_scale * F.linear(F.linear(x, module.lora_A), module.lora_B)


def apply_lora(model: torch.nn.Module, lcfg: "LoraConfig", dtype: torch.dtype | None = None) -> None:
    """Freeze every parameter of `model` and add trainable adapters to the target Linears, stored in
    `dtype` (default: the base weight's; the trainer keeps them float32 over a bf16 base)."""
    model.requires_grad_(False)
    for block in model.layers.values():
        for t in _targets(lcfg):
            lin = block.get_submodule(LORA_TARGETS[t])
            out_f, in_f = lin.weight.shape
            a = torch.empty(lcfg.rank, in_f, dtype=dtype or lin.weight.dtype, device=lin.weight.device)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's init of A; B starts at 0
            lin.register_parameter("lora_A", torch.nn.Parameter(a))
            lin.register_parameter("lora_B", torch.nn.Parameter(a.new_zeros(out_f, lcfg.rank)))
            lin.lora_scale = lcfg.alpha / lcfg.rank
            lin.register_forward_hook(_hook)


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def peft_names(arch: Arch, lcfg: "LoraConfig") -> list[str]:
    out = []
    modules = family(arch).lora_modules
    for i in range(arch.n_layers):
        for t in _targets(lcfg):
            parent, projs = modules[t]
            for proj in projs:
                out += [f"base_model.model.model.layers.{i}.{parent}.{proj}.lora_{ab}.weight" for ab in "AB"]
    return out


def peft_state_dict(model: torch.nn.Module, arch: Arch, lcfg: "LoraConfig") -> dict[str, torch.Tensor]:
    """The adapters under PEFT names (full tensors; a collective under FSDP, every rank calls it). The
    family names each target's HF projections and splits a fused one's B rows (its fused-QKV layout)."""
    fam = family(arch)
    out: dict[str, torch.Tensor] = {}
    for i, block in model.layers.items():
        pre = f"base_model.model.model.layers.{i}"
        for t in _targets(lcfg):
            lin = block.get_submodule(LORA_TARGETS[t])
            a, b = _full(lin.lora_A), _full(lin.lora_B)
            parent, projs = fam.lora_modules[t]
            parts = fam.qkv_split(arch, b) if len(projs) > 1 else {projs[0]: b}
            for proj, bb in parts.items():
                out[f"{pre}.{parent}.{proj}.lora_A.weight"] = a.clone()
                out[f"{pre}.{parent}.{proj}.lora_B.weight"] = bb.contiguous().clone()
    return out


def write_peft(out_dir: str | Path, sd: dict[str, torch.Tensor], lcfg: "LoraConfig", base: str = "") -> Path:
    """A PEFT adapter directory (what vLLM's LoRARequest and peft's PeftModel load)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "adapter_model.safetensors"))
    mods = sorted({k.split(".")[-3] for k in sd})  # "...q_proj.lora_A.weight" -> q_proj
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": lcfg.alpha,
         "target_modules": mods, "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base}, indent=2))
    return out


def read_peft(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "adapter_model.safetensors"))


def merge_into_hf(hf_sd: dict[str, torch.Tensor], peft_sd: dict[str, torch.Tensor],
                  lcfg: "LoraConfig") -> dict[str, torch.Tensor]:
    """HF weights with the adapters merged in: W + (alpha / r) B A for every adapted projection."""
    scale = lcfg.alpha / lcfg.rank
    out = dict(hf_sd)
    for k, a in peft_sd.items():
        if not k.endswith(".lora_A.weight"):
            continue
        name = k[len("base_model.model."):-len(".lora_A.weight")] + ".weight"
        b = peft_sd[k.replace(".lora_A.", ".lora_B.")]
        w = out[name]
        out[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def remove_dir(path: str | Path | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)
