"""This rank's pieces of the HF-named weights, without a gather: for every trainable parameter its
local shard (FSDP2's rows, a tensor-parallel DTensor's rows or columns, both under 2-D), named by
the box of the HF tensor it covers. What a sharded weight push (pipeline/weightsync/shard_plan.py)
packs on each trainer rank.

Contract: pure given the model (no collective, no copy): every rank calls `local_boxes` on its own
model and gets views of its own shards, in `named_parameters` order, which is the same on every
rank. The HF names are the model family's adapter's (pipeline/models); the fused QKV weight and bias
(laid out KV group by KV group: hpk query heads, one key head, one value head) split into runs of
whole rows of q_proj / k_proj / v_proj (the family's `qkv_row_runs`), as its state-dict hook splits
the whole tensor. A parameter the HF state
dict does not carry (a tied output head: named_parameters yields it once) is skipped, as in export.
A shard that is not one box of the global tensor is refused; the shard plan then checks that the
ranks' boxes cover every element exactly once.

Example:
    for (name, start, size), t in local_boxes(model, adapter):
        # t is this rank's block [start, start + size) of HF tensor `name` (float32 master)
        ...
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from pipeline.models import family
from pipeline.trainer.parallel import local, resharded
from pipeline.weightsync.shard_plan import Box

FUSED_QKV = ".wqkv."


def local_boxes(model: torch.nn.Module, adapter) -> list[tuple[Box, torch.Tensor]]:
    """(box of an HF tensor, this rank's tensor holding it) for every parameter's local shard."""
    out: list[tuple[Box, torch.Tensor]] = []
    for name, p in resharded(model).named_parameters():
        if ".lora_" in name:  # LoRA adapters: a push carries them under PEFT names (TrainerState)
            continue
        t = local(p).detach()
        start, size = _box(name, p, t)
        if FUSED_QKV in name:
            out.extend(_qkv_runs(model, adapter, name, start, size, t))
            continue
        hf = list(adapter.to_hf({name: None}))
        if hf:
            out.append(((hf[0], start, size), t))
    return out


def _box(name: str, p: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not isinstance(p, DTensor):
        return (0,) * p.dim(), tuple(p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(t.shape):
        raise RuntimeError(f"weight push: the local shard of {name} is {tuple(t.shape)}, not one block "
                           f"{tuple(shape)} of the global tensor {tuple(p.shape)} (placements {p.placements})")
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _qkv_runs(model, adapter, name: str, start, size, t: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """Rows [a, a + n) of a fused wqkv as runs of q_proj / k_proj / v_proj rows (the family's layout)."""
    prefix, _, param = name.rpartition(FUSED_QKV)
    names = {proj: next(iter(adapter.to_hf({f"{prefix}.{key}.{param}": None})))
             for proj, key in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"))}
    a = start[0]
    return [((names[proj], (dst, *start[1:]), (m, *size[1:])), t[row - a:row - a + m])
            for proj, row, dst, m in family(adapter.arch).qkv_row_runs(adapter.arch, a, size[0])]
