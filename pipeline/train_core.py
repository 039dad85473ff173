"""TrainCore: the torch-level trainer of one rank (no Monarch): model, FSDP2, AdamW, LR schedule,
RL and SFT steps, distributed checkpoints, HF export.

    core = TrainCore(cfg, rank, world)      # torch.distributed already initialised when world > 1
    metrics = core.train_step(batch)        # every rank passes the full Batch and takes its shard
    core.save(path); core.load(path)        # torch.distributed.checkpoint + trainer_state.json
    core.export_hf(out_dir)                 # vLLM-loadable HF directory (collective; rank 0 writes)

Data parallelism: rank r trains on `tensor_split(range(N), world)[r]`. Loss denominators are the
*global* token / sequence counts (every rank sees the full batch, so no collective is needed for
them), and each rank's loss is scaled by `world` because FSDP2 averages gradients across ranks;
the sum of shard gradients then equals the single-rank gradient. Every rank runs the same number
of micro-batches (an empty one runs a zero-weighted row) so FSDP collectives always pair up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import losses
from pipeline.config import Config
from pipeline.model import build_model, export_hf, model_dir, read_hf_config, save_hf_checkpoint
from pipeline.train_checks import check_batch, check_sft
from pipeline.types import Batch


class NonFiniteLossError(FloatingPointError):
    """The step's loss or gradient norm was NaN/inf; the weights were left untouched."""


class TrainCore:
    def __init__(self, cfg: Config, rank: int = 0, world: int = 1) -> None:
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.rank, self.world = rank, world
        torch.manual_seed(cfg.run.seed)
        self.hf_dir = model_dir(cfg.model)
        self.vocab_size = int(read_hf_config(self.hf_dir)["vocab_size"])
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.tcfg.device == "cuda" \
            else torch.device("cpu")
        dtype = getattr(torch, cfg.model.dtype)
        self.distributed = dist.is_available() and dist.is_initialized()
        if world > 1 and not self.distributed:
            raise RuntimeError(f"TrainCore: world={world} but torch.distributed is not initialised")
        self.mesh = None
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.tcfg.device, (world,), mesh_dim_names=("fsdp",))
        self.model, self.adapter = self._build(dtype)
        self.ref_model = None
        if self.tcfg.kl_coef > 0:  # frozen initial policy for the KL penalty
            self.ref_model, _ = self._build(dtype)
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.tcfg.lr,
                                           weight_decay=self.tcfg.weight_decay)
        warm = self.tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warm + 1)) if warm else 1.0)
        self.version = 0
        self.samples_seen = 0

    def _build(self, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
        model, adapter = build_model(self.hf_dir, self.device, dtype)
        if self.mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for block in model.layers.values():
                fully_shard(block, mesh=self.mesh)
            fully_shard(model, mesh=self.mesh)
        return model, adapter

    # ------------------------------------------------------------------ steps

    def _shard_rows(self, n: int) -> tuple[torch.Tensor, int]:
        """This rank's sample indices and the micro-batch count every rank runs."""
        rows = torch.tensor_split(torch.arange(n), self.world)[self.rank]
        most = math.ceil(n / self.world)
        mbs = self.tcfg.micro_batch_size or max(most, 1)
        return rows, max(1, math.ceil(most / mbs))

    def _micro_batches(self, n: int):
        """Yield (row indices, weight) per micro-batch; weight 0 marks a padding micro-batch."""
        rows, k = self._shard_rows(n)
        for chunk in torch.tensor_split(rows, k) if len(rows) else [rows] * k:
            yield (chunk, 1.0) if len(chunk) else (torch.zeros(1, dtype=torch.long), 0.0)

    def _logprobs(self, model: torch.nn.Module, ids: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(ids)[:, :-1].float() / temperature
        return torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(-1), logits

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One RL optimizer step on `batch`; raises before touching the weights on bad input or a
        non-finite loss / gradient norm. Returns globally reduced metrics (same on every rank)."""
        check_batch(batch, self.vocab_size)
        mask_all = batch.loss_mask[:, 1:].float()
        denominators = losses.local_denominators(mask_all)  # the full batch: global counts
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        maxes = torch.zeros((), dtype=torch.float64)
        for rows, keep in self._micro_batches(batch.num_samples):
            ids = batch.input_ids[rows].to(self.device)
            mask = mask_all[rows].to(self.device) * keep
            mu = batch.behaviour_logprobs[rows, 1:].to(self.device).float()
            # The sampler's logprobs are of the temperature-scaled distribution it sampled from
            # (generator.logprobs_mode=processed), so the learner scores the same distribution.
            logp, logits = self._logprobs(self.model, ids, self.cfg.generator.temperature)
            old = logp.detach()  # one epoch per batch: π_old is the pre-step policy, numerically π_θ
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.ref_model, ids, self.cfg.generator.temperature)[0]
            loss, stats = losses.policy_loss(logp, old, mu, mask, batch.advantages[rows].to(self.device),
                                             self.tcfg, ref=ref, denominators=denominators)
            (loss * self.world).backward()
            mm = losses.mismatch_sums(old, mu, mask)
            maxes = torch.maximum(maxes, mm.pop("mismatch_max").cpu())
            step_sums = {"loss": loss.detach().double(), "entropy_sum": losses.token_entropy_sum(logits, mask),
                         **stats, **{f"mm_{k}": v for k, v in mm.items()}}
            for k, v in step_sums.items():
                sums[k] = sums.get(k, 0) + v.detach().cpu().double()
        red = self._all_reduce(sums, maxes)
        if not math.isfinite(red["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: loss is {red['loss']} at version {self.version}; "
                                     "step skipped, weights not updated")
        grad_norm = self._clip_and_step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.version += 1
        self.samples_seen += batch.num_samples
        tok = max(red["tokens"], 1.0)
        mm = losses.finalize_mismatch({k[3:]: v for k, v in red.items() if k.startswith("mm_")})
        return {"loss": red["loss"], "grad_norm": grad_norm, "lr": lr, "version": float(self.version),
                "tokens": red["tokens"], "samples": float(batch.num_samples),
                "clip_frac": red["clip_tokens"] / tok, "is_clip_frac": red["is_clip_tokens"] / tok,
                "kl_ref": red["kl_sum"] / tok, "entropy": red["entropy_sum"] / tok,
                "staleness_mean": float(batch.staleness().float().mean()), **mm}

    def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        """Supervised cross-entropy on demonstration tokens (loss_mask in the Batch token layout);
        one optimizer step that does not advance the RL version or the LR schedule."""
        check_sft(input_ids, loss_mask, self.vocab_size)
        mask_all = loss_mask[:, 1:].float()
        n_tok = float(mask_all.sum())
        self.model.train()
        total = torch.zeros((), dtype=torch.float64)
        for rows, keep in self._micro_batches(input_ids.shape[0]):
            logp, _ = self._logprobs(self.model, input_ids[rows].to(self.device))
            loss = -(logp * mask_all[rows].to(self.device) * keep).sum() / n_tok
            (loss * self.world).backward()
            total += loss.detach().double().cpu()
        loss_v = self._all_reduce({"loss": total}, torch.zeros((), dtype=torch.float64))["loss"]
        if not math.isfinite(loss_v):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: sft loss is {loss_v}; step skipped, weights not updated")
        return {"loss": loss_v, "grad_norm": self._clip_and_step(), "tokens": n_tok}

    def _clip_and_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: grad norm is {norm} at version {self.version}; "
                                     "step skipped, weights not updated")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _all_reduce(self, sums: dict[str, torch.Tensor], mx: torch.Tensor) -> dict[str, float]:
        keys = sorted(sums)
        vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
        if self.distributed:
            # gloo reduces CPU tensors; nccl needs them on the device.
            vec, mx = vec.to(self.device), mx.to(self.device)
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        out = dict(zip(keys, vec.cpu().tolist()))
        out["mm_mismatch_max"] = float(mx)
        return out

    # ------------------------------------------------------------------ weights out

    def hf_meta(self) -> dict[str, torch.Tensor]:
        """HF-named meta tensors (global shapes, no data) for a weight-sync plan. Collective under
        FSDP: torchtitan's fused-QKV state_dict hook gathers, so every rank must call it."""
        sd = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self.model.state_dict().items()}
        return self.adapter.to_hf(sd)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors; a collective under FSDP, so every rank must call it."""
        return export_hf(self.model, self.adapter)

    def export_hf(self, out_dir: str | Path) -> str:
        """Write a vLLM-loadable HF directory. Collective: every rank gathers, rank 0 writes."""
        if self.rank == 0:
            save_hf_checkpoint(self.model, self.adapter, self.hf_dir, Path(out_dir))
        else:
            export_hf(self.model, self.adapter)  # pairs with rank 0's gathers inside save_hf_checkpoint
        self._barrier()
        return str(out_dir)

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _dcp_state(self) -> dict[str, torch.Tensor]:
        """Parameters and AdamW moments by parameter name (DTensor shards under FSDP). Raw
        `named_parameters`, not `state_dict()`: torchtitan's fused-QKV state-dict hooks rename keys,
        which torch's get_state_dict cannot map back to parameters."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            out[f"model.{name}"] = p.detach()
            st = self.optimizer.state[p]
            if not st:  # fresh optimizer: materialise AdamW state so DCP can load into it in place
                st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.detach()),
                          exp_avg_sq=torch.zeros_like(p.detach()))
            for k, v in st.items():
                out[f"optim.{name}.{k}"] = v
        return out

    def save(self, path: str | Path, data_state: dict | None = None) -> str:
        """Weights + optimizer via torch.distributed.checkpoint (sharded, reloadable at another world
        size); version, LR schedule, optimizer hyper-parameters and the caller's data position in
        trainer_state.json (rank 0)."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        dcp.save(self._dcp_state(), checkpoint_id=str(path))
        if self.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            state = {"version": self.version, "samples_seen": self.samples_seen, "world": self.world,
                     "scheduler": self.scheduler.state_dict(), "param_groups": groups,
                     "data_state": data_state or {}}
            (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        self._barrier()
        return str(path)

    def load(self, path: str | Path) -> dict:
        """Restore what `save` wrote, in place; returns the saved data_state."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        meta = path / "trainer_state.json"
        if not meta.is_file():
            raise FileNotFoundError(f"trainer: {meta} missing; {path} is not a trainer checkpoint")
        state = json.loads(meta.read_text())
        with torch.no_grad():
            dcp.load(self._dcp_state(), checkpoint_id=str(path))
        for g, saved in zip(self.optimizer.param_groups, state["param_groups"]):
            g.update(saved)
        self.version, self.samples_seen = int(state["version"]), int(state["samples_seen"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._barrier()
        return state["data_state"]
