"""The trainer's state in and out: the KL reference, the HF-named weights a push carries, the HF
export, and the distributed checkpoint (torch.distributed.checkpoint + trainer_state.json + RNG).
TrainerState holds references to TrainCore's model, reference, optimizer and schedule; it owns no
tensor itself and keeps no state of its own.

Checkpoint format (what old checkpoints hold, and what `load` reads):
- DCP keys `model.<param>`, `optim.<param>.<step|exp_avg|exp_avg_sq>` (trainable parameters only)
  and, when saved with a KL reference, `ref.<param>`; raw `named_parameters` names (DTensor shards
  under FSDP, so a checkpoint reloads at another world size). Each tensor in its storage dtype
  (parallel.py): trainable parameters and their moments float32 (the master), frozen ones (LoRA
  base, reference) in model.dtype. A checkpoint saved before the float32 master (model.dtype=bfloat16
  held everything in bf16) loads too: DCP casts each tensor into its destination's dtype.
- trainer_state.json (rank 0): the caller's counters (version, samples_seen, skipped_steps,
  entropy_coef), world, has_ref, the LR schedule, the optimizer's param groups and `data_state`.
- rng_rank<r>.pt: rank r's torch/python RNG.

Contract: every method but `set_reference` and `reset_optimizer` is a collective (FSDP gathers in
the state-dict hooks, DCP, the closing barrier): every rank calls it, in the same order. In
`export_hf` every rank gathers and rank 0 alone writes.

Weights out are in model.dtype, the generators' dtype (`dtype`): a push's tensors, the plan's
meta and an HF export are the float32 master cast to it, shard by shard (a push: each rank's own
shards, `push_boxes`, cast as they are packed, never gathered; an export: before the gather).

Example:
    state = TrainerState(cfg.trainer, par, hf_dir, model, adapter, ref_model, optimizer, scheduler, torch.bfloat16)
    sd = state.hf_state_dict()                     # the gathered weights in bf16 (adapters only under LoRA)
    boxes = state.push_boxes()                     # this rank's part of a push: [(box, local tensor)]
    state.export_hf(out_dir)                       # vLLM-loadable HF directory
    state.save(path, {"version": 3, ...}, data_state)
    saved = state.load(path)                       # trainer_state.json, tensors restored in place
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from pipeline.checkpoint import rng_state, set_rng_state
from pipeline.config import TrainerConfig
from pipeline.lora import merge_into_hf, peft_state_dict, write_peft
from pipeline.models import read_arch
from pipeline.models.hf import export_hf, save_hf_checkpoint
from pipeline.trainer.parallel import Parallel, local, resharded
from pipeline.trainer.shards import local_boxes
from pipeline.weightsync.shard_plan import Box

log = logging.getLogger(__name__)


class TrainerState:
    """One rank's view of the trainer's weights and optimizer for export and checkpoints."""

    def __init__(self, tcfg: TrainerConfig, par: Parallel, hf_dir: Path, model: torch.nn.Module, adapter: object,
                 ref_model: torch.nn.Module | None, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LambdaLR, dtype: torch.dtype) -> None:
        self.tcfg, self.par, self.hf_dir, self.dtype = tcfg, par, hf_dir, dtype
        self.model, self.adapter, self.ref_model = model, adapter, ref_model
        self.optimizer, self.scheduler = optimizer, scheduler

    def set_reference(self) -> bool:
        """Make the current weights the KL reference (after the supervised warm start), cast to the
        reference's dtype; False when there is no reference (trainer.kl_coef = 0). Both models are
        sharded alike (parallel.py), so each rank copies its own shards."""
        if self.ref_model is None:
            return False
        with torch.no_grad():
            for r, p in zip(resharded(self.ref_model).parameters(), resharded(self.model).parameters(), strict=True):
                local(r).copy_(local(p))
        return True

    def reset_optimizer(self) -> None:
        """Drop AdamW's moments and step counts (after the supervised warm start): the first RL step
        starts them afresh, as in a run without a warm start, instead of following the demonstrations'
        momentum and gradient scale. The param groups and the LR schedule are untouched."""
        self.optimizer.state.clear()

    # ------------------------------------------------------------------ weights out

    def hf_meta(self) -> dict[str, torch.Tensor]:
        """HF-named meta tensors (global shapes, no data) for a weight-sync plan. Collective under
        FSDP: torchtitan's fused-QKV state_dict hook gathers, so every rank must call it."""
        if self.tcfg.lora.rank:  # a push carries the adapters only
            return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self.hf_state_dict().items()}
        sd = {k: torch.empty(v.shape, dtype=self.dtype, device="meta") for k, v in self.model.state_dict().items()
              if ".lora_" not in k}
        return self.adapter.to_hf(sd)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """What a weight push carries, in model.dtype: full HF-named tensors, or with LoRA the
        adapters alone under PEFT names (pipeline/lora.py); a collective under FSDP, so every rank
        must call it."""
        if self.tcfg.lora.rank:
            return {k: v.to(self.dtype) for k, v in self._peft().items()}
        return export_hf(self.model, self.adapter, self.dtype)

    def push_boxes(self) -> list[tuple[Box, torch.Tensor]]:
        """This rank's part of a weight push: (box of an HF tensor, tensor) pairs, the same boxes in
        the same order at every call. Without LoRA: views of this rank's own shards (float32 master;
        the push casts them to model.dtype as it packs: pipeline/trainer/shards.py), no gather. With
        LoRA (small): the adapters gathered under PEFT names, all sent by rank 0; a collective then,
        so every rank must call it."""
        if not self.tcfg.lora.rank:
            return local_boxes(self.model, self.adapter)
        peft = self._peft()
        if self.par.rank:
            return []
        return [((k, (0,) * v.dim(), tuple(v.shape)), v) for k, v in peft.items()]

    def _peft(self) -> dict[str, torch.Tensor]:
        """The adapters under PEFT names in their float32 master precision (collective under FSDP)."""
        return peft_state_dict(self.model, read_arch(self.hf_dir), self.tcfg.lora)

    def export_hf(self, out_dir: str | Path, merged: bool = False) -> str:
        """Write a vLLM-loadable HF directory. Collective: every rank gathers, rank 0 writes. With
        LoRA: the (frozen) base weights and the adapters as PEFT in out_dir/adapter, which a
        generator started on out_dir serves (a restart, the warm start); `merged`: base + adapters
        merged into the weights instead (a model any HF or vLLM loader serves as is)."""
        lcfg = self.tcfg.lora
        peft = self._peft() if lcfg.rank else None  # collective: before rank 0's writes
        if self.par.rank == 0:
            save_hf_checkpoint(self.model, self.adapter, self.hf_dir, Path(out_dir), self.dtype)
            if peft is not None and merged:  # merged from the float32 adapters, then cast to the base's dtype
                path = Path(out_dir) / "model.safetensors"
                save_file({k: v.contiguous() for k, v in merge_into_hf(load_file(str(path)), peft, lcfg).items()},
                          str(path), metadata={"format": "pt"})
            elif peft is not None:
                write_peft(Path(out_dir) / "adapter", {k: v.to(self.dtype) for k, v in peft.items()}, lcfg,
                           str(self.hf_dir))
        else:
            export_hf(self.model, self.adapter, self.dtype)  # pairs with rank 0's gathers in save_hf_checkpoint
        self.par.barrier()
        return str(out_dir)

    # ------------------------------------------------------------------ checkpoints

    def _dcp_state(self, with_ref: bool) -> dict[str, torch.Tensor]:
        """Parameters and AdamW moments by parameter name (DTensor shards under FSDP), and the KL
        reference's parameters when `with_ref` (it may be the warm-start policy, not the checkpoint the
        run started from). Raw `named_parameters`, not `state_dict()`: torchtitan's fused-QKV
        state-dict hooks rename keys, which torch's get_state_dict cannot map back to parameters."""
        out: dict[str, torch.Tensor] = {}
        for name, p in resharded(self.model).named_parameters():
            out[f"model.{name}"] = p.detach()
            if not p.requires_grad:  # frozen (the base under LoRA): no optimizer state
                continue
            st = self.optimizer.state[p]
            if not st:  # fresh optimizer: materialise AdamW state so DCP can load into it in place
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.detach()),
                          exp_avg_sq=torch.zeros_like(p.detach()))
            for k, v in st.items():
                out[f"optim.{name}.{k}"] = v
        if with_ref:
            out.update({f"ref.{name}": p.detach() for name, p in resharded(self.ref_model).named_parameters()})
        return out

    def save(self, path: str | Path, counters: dict[str, float], data_state: dict | None) -> str:
        """Weights + optimizer via torch.distributed.checkpoint (sharded, reloadable at another world
        size); the caller's `counters`, LR schedule, optimizer hyper-parameters and data position in
        trainer_state.json (rank 0); this rank's torch/python RNG in rng_rank<r>.pt."""
        path = Path(path)
        dcp.save(self._dcp_state(self.ref_model is not None), checkpoint_id=str(path))
        torch.save(rng_state(), path / f"rng_rank{self.par.rank}.pt")
        if self.par.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            state = {**counters, "world": self.par.world, "has_ref": self.ref_model is not None,
                     "scheduler": self.scheduler.state_dict(), "param_groups": groups,
                     "data_state": data_state or {}}
            (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        self.par.barrier()
        return str(path)

    def load(self, path: str | Path) -> dict:
        """Restore the tensors, optimizer and schedule `save` wrote, in place; returns the saved
        trainer_state.json (the caller takes its counters and data_state). trainer.lr and
        trainer.weight_decay are this config's (they may change on resume); the LR schedule's
        position is the checkpoint's. A rank the checkpoint had no RNG file for (it was saved at a
        smaller world size) keeps its seeded RNG."""
        path = Path(path)
        meta = path / "trainer_state.json"
        if not meta.is_file():
            raise FileNotFoundError(f"trainer: {meta} missing; {path} is not a trainer checkpoint")
        state = json.loads(meta.read_text())
        with_ref = self.ref_model is not None and state.get("has_ref", False)
        if self.ref_model is not None and not with_ref:
            log.warning("trainer: %s holds no KL reference (saved with trainer.kl_coef=0); the reference "
                        "is the checkpoint's policy from here on", path)
        with torch.no_grad():
            dcp.load(self._dcp_state(with_ref), checkpoint_id=str(path))
            if self.ref_model is not None and not with_ref:
                self.set_reference()
        for g, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            g.update(saved)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = [self.tcfg.lr] * len(self.optimizer.param_groups)
        for g, lam in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            g.update(initial_lr=self.tcfg.lr, lr=self.tcfg.lr * lam(self.scheduler.last_epoch),
                     weight_decay=self.tcfg.weight_decay)
        rng = path / f"rng_rank{self.par.rank}.pt"
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
        self.par.barrier()
        return state
