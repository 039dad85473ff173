"""The trainer's parallelisms: the (fsdp, tp) device mesh of the trainer ranks, the model built on it
(LoRA, then tensor parallel, then FSDP2), the gradient norm and clip that know about both, and the
all-reduces of the step's metric sums. TrainCore owns one Parallel; nothing else here keeps state.

Mesh: trainer.tensor_parallel = tp divides the world; the ranks form a 2-D mesh (fsdp = world / tp,
tp), rank r at (r // tp, r % tp). The tp ranks of an fsdp index train the same rows: data is split
over the fsdp axis only (`dp_world`, `dp_rank`), so metric sums are divided by tp in `all_reduce`.

Tensor parallelism (tp > 1): each block's fused QKV and FFN w1/w3 are column-sharded and wo/w2
row-sharded over the tp axis (the family's plan, pipeline/models: torch DTensor Colwise/RowwiseParallel
on the torchtitan modules; the fused QKV weight and bias are laid out KV group by KV group, so a column
shard is whole heads), an untied
output head is column-sharded with its logits gathered (a head tied to the embedding stays whole,
or sharding would untie it); FSDP2 then shards over the fsdp axis (when it is > 1). Per-head norms (q/k norms)
act on each rank's own heads, so their gradients are summed over the tp axis before the norm
(`sq_norm`, in place). HF export gathers the DTensor shards (full_tensor); a weight push sends each
rank's own shards (trainer/shards.py) and the generators assemble them, so they get the same weights
as from tp = 1.

Precision (model.dtype below float32, i.e. bfloat16): the trainable parameters stay float32, and so
do their gradients and AdamW moments (the master: updates of lr 1e-6 would round to nothing in
bf16); FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) casts each block's
shards to bf16 as it gathers them for the forward and backward, and reduces the gradients in
float32 into the float32 shards, as torchtitan does. This path is taken on every rank count: one
rank is a fully_shard over a mesh of one (no autocast anywhere). Frozen weights (the LoRA base, the
KL reference) are stored in bf16 outright. Per trainable parameter: 4 bytes master + 4 gradient +
8 AdamW, plus the bf16 copy of the block being computed. Pushes and HF exports are cast to
model.dtype (state.py), so the generators get exactly master.to(bf16).

Contract: `clip_grad_norm`, `sq_norm` (under tp), `all_reduce`, `all_gather_object` and `barrier` are collectives: every
rank calls them in the same order with the same keys, or the ranks hang. `build` is a collective
when the mesh has more than one rank (FSDP2 and DTensor placement).

Example:
    par = Parallel(cfg.trainer, rank, world)   # torch.distributed already initialised when world > 1
    model, adapter = par.build(hf_dir, torch.bfloat16, cfg.trainer.lora)   # fp32 master, bf16 compute
    ref, _ = par.build(hf_dir, torch.bfloat16, cfg.trainer.lora, frozen=True)  # bf16 storage
    loss.backward()
    norm = par.clip_grad_norm(model, cfg.trainer.grad_clip)   # the global norm, before clipping
    metrics = par.all_reduce({"loss": loss_sum}, {"mismatch_max": mismatch_max})
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipeline.config import LoraConfig, TrainerConfig
from pipeline.lora import apply_lora
from pipeline.models import Arch, family, read_arch
from pipeline.models.hf import build_model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def resharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its parameters as this rank's shards: FSDP2 leaves the root's parameters
    gathered (in the compute dtype) after a forward that no backward followed."""
    if hasattr(model, "reshard"):
        model.reshard()
    return model


class Parallel:
    """This rank's place in the trainer mesh and the collectives over it (module docstring)."""

    def __init__(self, tcfg: TrainerConfig, rank: int, world: int) -> None:
        self.rank, self.world, self.tp = rank, world, tcfg.tensor_parallel
        if world % self.tp:
            raise ValueError(f"trainer.tensor_parallel={self.tp} does not divide the {world} trainer ranks")
        self.dp_world, self.dp_rank = world // self.tp, rank // self.tp  # the data-parallel (fsdp) axis
        self.device = torch.device("cuda", torch.cuda.current_device()) if tcfg.device == "cuda" \
            else torch.device("cpu")
        self.distributed = dist.is_available() and dist.is_initialized()
        if world > 1 and not self.distributed:
            raise RuntimeError(f"TrainCore: world={world} but torch.distributed is not initialised")
        if self.tp > 1 and not self.distributed:
            raise RuntimeError(f"TrainCore: trainer.tensor_parallel={self.tp} needs torch.distributed over its ranks")
        self.mesh = init_device_mesh(tcfg.device, (self.dp_world, self.tp), mesh_dim_names=("fsdp", "tp")) \
            if self.distributed else None
        self.tp_group = self.mesh["tp"].get_group() if self.tp > 1 else None
        self.per_head: tuple[str, ...] = ()  # the family's per-head parameters (`sq_norm`), set by `build`

    def build(self, hf_dir: Path, dtype: torch.dtype, lora: LoraConfig,
              frozen: bool = False) -> tuple[torch.nn.Module, object]:
        """The model of `hf_dir` on this rank's device, sharded over the mesh, computing in `dtype`;
        returns it and its torchtitan state-dict adapter. Trainable parameters are float32 (the master
        the optimizer steps); below float32 the forward and backward run in `dtype` through FSDP2's
        MixedPrecisionPolicy (module docstring). Frozen parameters (the base under LoRA, or all of
        them when `frozen`: the KL reference) are stored in `dtype`, since nothing updates them."""
        mixed = dtype != torch.float32
        if mixed and self.mesh is None:
            raise RuntimeError(f"TrainCore: model.dtype={dtype} trains float32 master weights with {dtype} compute "
                               "through FSDP2, which needs torch.distributed initialised (the trainer actor does "
                               "so on every rank count, 1 included)")
        model, adapter = build_model(hf_dir, self.device, dtype if frozen or lora.rank else torch.float32)
        if lora.rank:  # before any sharding: the adapters are parameters like the others
            apply_lora(model, lora, dtype if frozen else torch.float32)
        if frozen:
            model.requires_grad_(False)
        arch = read_arch(hf_dir)
        self.per_head = family(arch).per_head_params(arch)
        if self.tp > 1:
            self._tensor_parallel(model, arch)
        if self.mesh is not None and (self.dp_world > 1 or mixed):
            # reduce_dtype float32: gradients are reduced and kept in the master's precision
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if mixed \
                else MixedPrecisionPolicy()
            dp = self.mesh["fsdp"]
            for block in model.layers.values():
                fully_shard(block, mesh=dp, mp_policy=mp)
            # a frozen model never runs a backward, which is what reshards a root left gathered after its forward
            fully_shard(model, mesh=dp, mp_policy=mp, reshard_after_forward=True if frozen else None)
        return model, adapter

    def _tensor_parallel(self, model: torch.nn.Module, arch: Arch) -> None:
        """Shard the blocks' projections and the output head over the tp axis, by the family's plan
        (module docstring)."""
        from pipeline.models.decoder import tp_sizes

        for key, size in tp_sizes(arch).items():
            if size % self.tp:
                raise ValueError(f"trainer.tensor_parallel={self.tp} does not divide the model's {key}={size} "
                                 "(attention is sharded by KV head group, the FFN and output head by columns)")
        mesh = self.mesh["tp"]
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {path: styles[style]() for path, style in family(arch).tp_plan.items()}
        for block in model.layers.values():
            parallelize_module(block, mesh, plan)
        if model.lm_head.weight is not model.tok_embeddings.weight:  # a tied head stays whole (and tied)
            parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Scale the gradients to a global norm of at most `max_norm`; returns the norm before (NaN/inf
        left unscaled for the caller to refuse). Under tp: the q/k norms' grads are summed over the tp
        axis first, then the norm is each DTensor's from its own shards, each other tensor once."""
        if self.tp == 1:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        norm = math.sqrt(self.sq_norm((n, p.grad) for n, p in named))
        if math.isfinite(norm) and norm > max_norm:
            with torch.no_grad():
                for _, p in named:
                    p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def sq_norm(self, named: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Σ ||g||² of named gradient-shaped tensors as the global tensors they stand for: each
        DTensor from its own shards, each other tensor once. Under tensor parallelism the grads of
        parameters that are plain (or only fsdp-sharded) but computed from this rank's heads alone
        (the q/k norms) are first summed over the tp axis, in place."""
        sq = 0.0
        for name, g in named:
            on_tp = isinstance(g, DTensor) and g.device_mesh.mesh_dim_names and "tp" in g.device_mesh.mesh_dim_names
            if self.tp > 1 and not on_tp and any(part in name for part in self.per_head):
                dist.all_reduce(local(g), group=self.tp_group)
            n = torch.linalg.vector_norm(g.detach())
            sq += float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2
        return sq

    def all_reduce(self, sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor] | None = None,
                   per_shard: bool = False) -> dict[str, float]:
        """SUM-reduce `sums` and MAX-reduce `maxes` (scalars) into one dict of floats. Sums of the
        rows a rank trained count once per tp group; `per_shard` sums (of each rank's own shard) are
        not divided; maxes never are. Every rank must make the same calls (same keys in both)."""
        keys, mkeys = sorted(sums), sorted(maxes or {})
        vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
        mvec = torch.stack([torch.as_tensor(maxes[k], dtype=torch.float64) for k in mkeys]) if mkeys else None
        if self.distributed:
            # gloo reduces CPU tensors; nccl needs them on the device.
            vec = vec.to(self.device)
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            if mvec is not None:
                mvec = mvec.to(self.device)
                dist.all_reduce(mvec, op=dist.ReduceOp.MAX)
        if self.tp > 1 and not per_shard:  # the tp ranks of an fsdp index computed the same rows: count them once
            vec = vec / self.tp
        out = dict(zip(keys, vec.cpu().tolist()))
        if mvec is not None:
            out.update(zip(mkeys, mvec.cpu().tolist()))
        return out

    def all_gather_object(self, obj: object) -> list:
        """Every rank's `obj` (picklable), in rank order; a collective."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
