"""TrainCore: the torch-level trainer of one rank (no Monarch): model, FSDP2, AdamW, LR schedule,
RL and SFT steps, distributed checkpoints, HF export.

    core = TrainCore(cfg, rank, world)      # torch.distributed already initialised when world > 1
    metrics = core.train_step(batch)        # every rank passes the full Batch and takes its shard
    core.save(path); core.load(path)        # torch.distributed.checkpoint + trainer_state.json + RNG
    core.export_hf(out_dir)                 # vLLM-loadable HF directory (collective; rank 0 writes)

PPO minibatches and epochs: one batch is one policy version. log π_old is taken once, with the
weights from before the batch's first optimizer step; then for each of `trainer.epochs` passes the
rows `tensor_split(range(N), trainer.minibatches)` each get a forward/backward (accumulated over
micro-batches of `trainer.micro_batch_size`), a gradient clip and an optimizer step. The PPO ratio
π_θ / π_old leaves 1 after the first of them, which is what makes the clip bite; the IS weight keeps
correcting μ → π_old with the sampler's logprobs (decoupled objective, see pipeline/losses.py). The
LR scheduler steps once per optimizer step, so trainer.warmup_steps counts optimizer steps. With
minibatches = epochs = 1 this is one plain step on the whole batch.

Data parallelism: each minibatch is split across ranks, rank r training on
`tensor_split(minibatch_rows, world)[r]`, so the union over ranks is the single-rank minibatch.
Loss denominators are the minibatch's *global* token / sequence counts (every rank sees the full
batch, so no collective is needed for them), and each rank's loss is scaled by `world` because
FSDP2 averages gradients across ranks; the sum of shard gradients then equals the single-rank
gradient. Every rank runs the same number of micro-batches per minibatch, computed from the global
minibatch size (an empty one runs a zero-weighted row), so FSDP collectives always pair up.

Tensor parallelism (trainer.tensor_parallel = tp > 1): the ranks form a 2-D mesh (fsdp = world / tp,
tp), rank r at (r // tp, r % tp). Each block's fused QKV and FFN w1/w3 are column-sharded and wo/w2
row-sharded over the tp axis (torch DTensor Colwise/RowwiseParallel on the torchtitan modules; the
fused QKV weight is laid out KV group by KV group, so a column shard is whole heads), an untied
output head is column-sharded with its logits gathered (a head tied to the embedding stays whole,
or sharding would untie it); FSDP2 then shards over the fsdp axis (when it is
> 1). The tp ranks of an fsdp index train the same rows: data is split over the fsdp axis only,
losses are scaled by its size, and metric sums are divided by tp. The q/k norms act on each rank's
own heads, so their gradients are summed over the tp axis before the clip. Weight export gathers
the DTensor shards (full_tensor), so the generators get the same weights as from tp = 1.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import losses
from pipeline.checkpoint import rng_state, set_rng_state
from pipeline.config import Config
from pipeline.model import build_model, export_hf, model_dir, read_hf_config, save_hf_checkpoint
from pipeline.train_checks import BadBatchError, EmptyBatchError, check_batch, check_sft
from pipeline.types import Batch

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """An optimizer step's loss or gradient norm was NaN/inf; that step's weight update was not
    applied and the version does not advance: the step is skipped (see TrainCore.train_step). With
    several minibatches, the steps of the same batch before it stay applied (nothing is snapshotted)."""


class NonFiniteWeightsError(FloatingPointError):
    """A parameter holds NaN/inf after an optimizer step: the weights are corrupt and must never be
    pushed or saved. Not a skipped step; the run stops."""


class TooManySkippedSteps(RuntimeError):
    """trainer.max_skipped_steps steps in a row were skipped; the run stops."""


def skipped_step_error(err: BaseException) -> BaseException | None:
    """The trainer's reason for skipping a step if `err` is one (NonFiniteLossError, EmptyBatchError),
    raised in-process or arriving through an actor call as Monarch's ActorError, which carries the
    original exception, unpickled with its type, as `.exception`; None for any other error."""
    inner = getattr(err, "exception", err)
    return inner if isinstance(inner, (NonFiniteLossError, EmptyBatchError)) else None


def minibatch_plan(n: int, minibatches: int, world: int, rank: int,
                   micro_batch_size: int) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, float]]]]:
    """Per minibatch: (its global row indices, this rank's micro-batches as (rows, weight)).

    Weight 0 marks a padding micro-batch (one dummy row): its count depends only on the global
    minibatch size, so every rank runs the same number of forwards and backwards per step.
    """
    plan = []
    for mb in torch.tensor_split(torch.arange(n), minibatches):
        rows = torch.tensor_split(mb, world)[rank]
        most = math.ceil(len(mb) / world)
        k = max(1, math.ceil(most / (micro_batch_size or max(most, 1))))
        chunks = torch.tensor_split(rows, k) if len(rows) else [rows] * k
        plan.append((mb, [(c, 1.0) if len(c) else (torch.zeros(1, dtype=torch.long), 0.0) for c in chunks]))
    return plan


class _GradChunks:
    """trainer.grad_variance: the squared norm of each micro-batch's share of the accumulated
    gradient (the accumulated gradient after it minus before it), then the variance of their sum."""

    def __init__(self) -> None:
        self.prev: dict[str, torch.Tensor] = {}
        self.sq: list[float] = []

    def add(self, core: "TrainCore") -> None:
        grads = [(n, p.grad) for n, p in core.model.named_parameters() if p.grad is not None]
        with torch.no_grad():
            diffs = [(n, g - self.prev[n] if n in self.prev else g.clone()) for n, g in grads]
            self.sq.append(core._sq_norm(diffs))
            self.prev = {n: g.detach().clone() for n, g in grads}

    def variance(self, core: "TrainCore") -> dict[str, float]:
        k = len(self.sq)
        if k < 2:  # one chunk has no spread to measure (a batch smaller than two micro-batches)
            return {"grad_var_chunks": float(k)}
        total = core._sq_norm((n, g.clone()) for n, g in self.prev.items())
        var = k / (k - 1) * max(sum(self.sq) - total / k, 0.0)
        return {"grad_var": var, "grad_var_rel": var / max(total, 1e-30), "grad_var_chunks": float(k)}


@dataclass
class _Proximal:
    """π_old of one batch on this rank: log π_old (and log π_ref) per row from pre-step forwards,
    and the once-per-batch metric sums (sampler/learner mismatch, π_old entropy)."""

    logp: torch.Tensor
    ref: torch.Tensor | None
    log_mix: torch.Tensor | None = None  # mis_balance: per row, log Σ_j α_j q_j(y) (balance_log_mixture)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    mx: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class TrainCore:
    def __init__(self, cfg: Config, rank: int = 0, world: int = 1) -> None:
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.rank, self.world = rank, world
        self.tp = self.tcfg.tensor_parallel
        if world % self.tp:
            raise ValueError(f"trainer.tensor_parallel={self.tp} does not divide the {world} trainer ranks")
        self.dp_world, self.dp_rank = world // self.tp, rank // self.tp  # the data-parallel (fsdp) axis
        self.tp_group = None
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

            self.mesh = init_device_mesh(self.tcfg.device, (self.dp_world, self.tp), mesh_dim_names=("fsdp", "tp"))
            self.tp_group = self.mesh["tp"].get_group() if self.tp > 1 else None
        elif self.tp > 1:
            raise RuntimeError(f"TrainCore: trainer.tensor_parallel={self.tp} needs torch.distributed over its ranks")
        self.model, self.adapter = self._build(dtype)
        self.ref_model = None
        if self.tcfg.kl_coef > 0:  # frozen reference for the KL penalty: initial policy until set_reference
            self.ref_model, _ = self._build(dtype)
            self.ref_model.requires_grad_(False)
        self.entropy_coef = self.tcfg.entropy_coef  # adapted after each step when trainer.entropy_target > 0
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.tcfg.lr,
                                           weight_decay=self.tcfg.weight_decay)
        warm = self.tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warm + 1)) if warm else 1.0)
        self.version = 0
        # mis_balance: the weights of the last max_staleness versions before this one (version -> a
        # copy of every parameter, this rank's shard), to score each sample under every behaviour
        # version of its batch; not checkpointed (a resumed run falls back to seq_is until refilled)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.samples_seen = 0
        self.skipped_steps = self.consecutive_skips = 0  # see train_step
        # The sampler's logprobs are of the temperature-scaled distribution it sampled from
        # (generator.logprobs_mode=processed, enforced by Config), so the learner scores the same.
        self.temperature = cfg.generator.temperature

    def _build(self, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
        model, adapter = build_model(self.hf_dir, self.device, dtype)
        if self.tcfg.lora.rank:  # before any sharding: the adapters are parameters like the others
            from pipeline.lora import apply_lora

            apply_lora(model, self.tcfg.lora)
        if self.tp > 1:
            self._tensor_parallel(model)
        if self.mesh is not None and self.dp_world > 1:
            from torch.distributed.fsdp import fully_shard

            dp = self.mesh["fsdp"]
            for block in model.layers.values():
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
        return model, adapter

    def _tensor_parallel(self, model: torch.nn.Module) -> None:
        """Shard the blocks' projections and the output head over the tp axis (module docstring)."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        conf, tp = read_hf_config(self.hf_dir), self.tp
        for key in ("num_key_value_heads", "intermediate_size", "vocab_size"):
            if conf[key] % tp:
                raise ValueError(f"trainer.tensor_parallel={tp} does not divide the model's {key}={conf[key]} "
                                 "(attention is sharded by KV head group, the FFN and output head by columns)")
        mesh = self.mesh["tp"]
        plan = {"attention.qkv_linear.wqkv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
        for block in model.layers.values():
            parallelize_module(block, mesh, plan)
        if model.lm_head.weight is not model.tok_embeddings.weight:  # a tied head stays whole (and tied)
            parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})

    # ------------------------------------------------------------------ steps

    def _micro_batches(self, n: int) -> list[tuple[torch.Tensor, float]]:
        """This rank's (row indices, weight) micro-batches of all n rows taken as one minibatch."""
        return minibatch_plan(n, 1, self.dp_world, self.dp_rank, self.tcfg.micro_batch_size)[0][1]

    def _logprobs(self, model: torch.nn.Module, ids: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(ids)[:, :-1].float() / temperature
        return torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(-1), logits

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One batch = one policy version (`_train_batch`), or a skipped step: a batch with no loss
        tokens (EmptyBatchError) or a non-finite loss or gradient norm (NonFiniteLossError) raises,
        the version stays, and the caller gives the batch back (ReplayBufferCore.skip_batch). With
        minibatches > 1, optimizer steps of the batch before a non-finite one stay applied: the
        weights moved under an unchanged version. That is accepted, not undone (no snapshot): the next
        batch's π_old is recomputed from the current weights, so its loss stays exact, and the
        change reaches the generators with the next version. trainer.max_skipped_steps skips in a row
        raise TooManySkippedSteps. Metrics include `skipped_steps`, the run's total so far."""
        try:
            metrics = self._train_batch(batch)
        except (NonFiniteLossError, EmptyBatchError) as e:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.tcfg.max_skipped_steps:
                raise TooManySkippedSteps(
                    f"trainer: {self.consecutive_skips} steps in a row skipped at version {self.version} "
                    f"(trainer.max_skipped_steps={self.tcfg.max_skipped_steps}); last: {e}") from e
            raise
        self.consecutive_skips = 0
        return {**metrics, "skipped_steps": float(self.skipped_steps)}

    def _train_batch(self, batch: Batch) -> dict[str, float]:
        """trainer.minibatches × trainer.epochs optimizer steps against a fixed π_old (module
        docstring). Raises before touching the weights on bad input; a non-finite loss or gradient
        norm raises NonFiniteLossError before that step's update. Returns globally reduced metrics
        (same on every rank); per-step ones are averaged over the batch's optimizer steps."""
        check_batch(batch, self.vocab_size)
        t = self.tcfg
        if batch.num_samples < t.minibatches:
            raise BadBatchError(f"trainer: batch has {batch.num_samples} samples, fewer than "
                                f"trainer.minibatches={t.minibatches}")
        mask_all = batch.loss_mask[:, 1:].float()
        plan = minibatch_plan(batch.num_samples, t.minibatches, self.dp_world, self.dp_rank, t.micro_batch_size)
        self.model.train()
        prox = _Proximal(torch.zeros(mask_all.shape, device=self.device),
                         torch.zeros(mask_all.shape, device=self.device) if self.ref_model is not None else None)
        mis = self._balance_mixture(batch, plan, prox) if t.correction == "mis_balance" else {}
        # π_old of minibatches 1.. with the pre-step weights, before any update. Minibatch 0's is
        # its own first forward (the weights are still pre-step then), which saves that forward and
        # keeps minibatches = epochs = 1 exactly the single-step computation.
        with torch.no_grad():
            for _, micro in plan[1:]:
                for rows, keep in micro:
                    ids = batch.input_ids[rows].to(self.device)
                    logp, logits = self._logprobs(self.model, ids, self.temperature)
                    self._record_proximal(prox, batch, rows, keep, ids, logp, logits)
        steps = []
        for epoch in range(t.epochs):
            for m, (mb_rows, micro) in enumerate(plan):
                den = losses.local_denominators(mask_all[mb_rows])  # the full minibatch: global counts
                if den[0] == 0:  # no loss tokens: every rank sees that and skips the same step
                    continue
                try:
                    steps.append(self._ppo_step(batch, micro, den, prox, first=epoch == 0 and m == 0))
                except NonFiniteLossError as e:
                    if not steps:
                        raise
                    raise NonFiniteLossError(f"{e}; {len(steps)} earlier optimizer step(s) of this batch "
                                             "stay applied") from e
        once = self._all_reduce(prox.sums, prox.mx)
        self.version += 1
        self.samples_seen += batch.num_samples
        tok = float(mask_all.sum())

        def mean(f) -> float:
            return sum(f(s) for s in steps) / len(steps)

        def frac(key: str) -> float:
            return mean(lambda s: s[key] / max(s["tokens"], 1.0))

        mm = losses.finalize_mismatch({k[3:]: v for k, v in once.items() if k.startswith("mm_")})
        entropy, coef = once["entropy_sum"] / max(tok, 1.0), self.entropy_coef
        self.entropy_coef = losses.adapt_entropy_coef(coef, entropy, self.tcfg)  # same on every rank
        return {"loss": mean(lambda s: s["loss"]), "grad_norm": mean(lambda s: s["grad_norm"]),
                "lr": steps[0]["lr"], "version": float(self.version), "tokens": tok,
                "samples": float(batch.num_samples), "optimizer_steps": float(len(steps)),
                "clip_frac": frac("clip_tokens"), "dual_clip_frac": frac("dual_clip_tokens"),
                "is_clip_frac": frac("is_clip_tokens"), "kl_ref": frac("kl_sum"),
                "entropy": entropy, "entropy_coef": coef,
                "staleness_mean": float(batch.staleness().float().mean()), **mm, **mis,
                **{f"grad/{k[5:]}": v for k, v in steps[0].items() if k.startswith("grad_var")}}

    def _balance_mixture(self, batch: Batch, plan, prox: "_Proximal") -> dict[str, float]:
        """mis_balance: prox.log_mix[i] = log Σ_j α_j q_j(y_i) over the behaviour versions j of the
        batch (α_j = n_j / n); q_j is the sampler's own likelihood for the version that made y_i and
        the snapshot of version j, scored here, for the others. Takes this version's snapshot first
        and keeps the snapshots of the last buffer.max_staleness versions before it (older samples are dropped
        as stale). A sample whose
        model tokens span versions, or a batch with a version no snapshot is kept for (after a
        resume), gets seq_is's weight (log_mix = Σ mask·mu). Metrics: versions, mixed samples,
        fallback, scoring seconds, snapshot memory."""
        import time

        t0 = time.monotonic()
        keep = self.cfg.buffer.max_staleness
        self._resharded()
        with torch.no_grad():  # the first batch of a version: the weights its generators served (a skipped
            if self.version not in self.snapshots:  # batch's applied minibatch steps do not replace them)
                self.snapshots[self.version] = [_local(p).detach().clone() for p in self.model.parameters()]
        for v in [v for v in self.snapshots if v < self.version - keep]:
            del self.snapshots[v]
        mask = batch.loss_mask[:, 1:].float()
        mu_seq = (batch.behaviour_logprobs[:, 1:].float() * mask).sum(1).double()
        own: list[int | None] = []
        for i in range(batch.num_samples):  # the one version of each sample's model tokens, or None
            vs = batch.versions[i, 1:][mask[i] > 0].unique().tolist()
            own.append(int(vs[0]) if len(vs) == 1 else None)
        versions = sorted({v for v in own if v is not None})
        log_mix = mu_seq.clone()
        fallback = any(v not in self.snapshots for v in versions)
        if versions and not fallback:
            counts = torch.tensor([sum(1 for v in own if v == j) for j in versions], dtype=torch.float64)
            logq = torch.full((batch.num_samples, len(versions)), float("nan"), dtype=torch.float64)
            live = [_local(p).detach().clone() for p in self.model.parameters()] if len(versions) > 1 else None
            try:
                for k, j in enumerate(versions):
                    if len(versions) > 1:  # q_j of the other versions' samples: forwards with version j's weights
                        self._resharded()
                        with torch.no_grad():
                            for p, w in zip(self.model.parameters(), self.snapshots[j]):
                                _local(p).copy_(w)
                            for _, micro in plan:
                                for rows, _keep in micro:
                                    ids = batch.input_ids[rows].to(self.device)
                                    lp = self._logprobs(self.model, ids, self.temperature)[0]
                                    logq[rows, k] = (lp * mask[rows].to(lp.device)).sum(1).double().cpu()
                    for i, v in enumerate(own):  # the version that made a sample: the sampler's own likelihood
                        if v == j:
                            logq[i, k] = mu_seq[i]
            finally:
                if live is not None:
                    self._resharded()
                    with torch.no_grad():
                        for p, w in zip(self.model.parameters(), live):
                            _local(p).copy_(w)
            rows = [i for i, v in enumerate(own) if v is not None and not torch.isnan(logq[i]).any()]
            if rows:
                log_mix[rows] = losses.balance_log_mixture(logq[rows], counts)
        prox.log_mix = log_mix.to(self.device)
        snap_bytes = sum(sum(w.numel() * w.element_size() for w in ws) for ws in self.snapshots.values())
        return {"mis_balance/versions": float(len(versions)), "mis_balance/fallback": float(fallback),
                "mis_balance/mixed_samples": float(sum(v is None for v in own)),
                "mis_balance/score_s": time.monotonic() - t0, "mis_balance/snapshot_mb": snap_bytes / 2**20}

    def _resharded(self) -> None:
        """FSDP2 may leave the root's parameters unsharded after a forward; reshard so parameters are
        always seen as this rank's shards (what the snapshots hold)."""
        if hasattr(self.model, "reshard"):
            self.model.reshard()

    def _record_proximal(self, prox: "_Proximal", batch: Batch, rows: torch.Tensor, keep: float,
                         ids: torch.Tensor, logp: torch.Tensor, logits: torch.Tensor) -> None:
        """Store log π_old (and log π_ref) of `rows` from a pre-step forward, and add the rows'
        sampler/learner mismatch and π_old entropy to the once-per-batch sums."""
        logp = logp.detach()
        mask = batch.loss_mask[rows, 1:].float().to(self.device) * keep
        mu = batch.behaviour_logprobs[rows, 1:].to(self.device).float()
        if keep:  # a padding micro-batch's dummy row may be a real row of another minibatch
            prox.logp[rows] = logp
            if prox.ref is not None:
                with torch.no_grad():
                    prox.ref[rows] = self._logprobs(self.ref_model, ids, self.temperature)[0]
        mm = losses.mismatch_sums(logp, mu, mask, self.tcfg, None if prox.log_mix is None else prox.log_mix[rows])
        prox.mx = torch.maximum(prox.mx, mm.pop("mismatch_max").cpu())
        for k, v in {"entropy_sum": losses.token_entropy_sum(logits, mask),
                     **{f"mm_{k}": v for k, v in mm.items()}}.items():
            prox.sums[k] = prox.sums.get(k, 0) + v.detach().cpu().double()

    def _ppo_step(self, batch: Batch, micro: list[tuple[torch.Tensor, float]], den: tuple[float, float],
                  prox: "_Proximal", first: bool) -> dict[str, float]:
        """Forward/backward over one minibatch's micro-batches, then clip and step; returns the
        step's globally reduced sums plus grad_norm and lr. `first`: the batch's first step, whose
        forward is still π_old and is recorded as such."""
        sums: dict[str, torch.Tensor] = {}
        chunks = _GradChunks() if first and self.tcfg.grad_variance else None
        for rows, keep in micro:
            ids = batch.input_ids[rows].to(self.device)
            mask = batch.loss_mask[rows, 1:].float().to(self.device) * keep
            mu = batch.behaviour_logprobs[rows, 1:].to(self.device).float()
            logp, logits = self._logprobs(self.model, ids, self.temperature)
            if first:
                self._record_proximal(prox, batch, rows, keep, ids, logp, logits)
            ref = prox.ref[rows] if prox.ref is not None else None
            ent = losses.token_entropy(logits) if self.entropy_coef > 0 else None
            loss, stats = losses.policy_loss(logp, prox.logp[rows], mu, mask, batch.advantages[rows].to(self.device),
                                             self.tcfg, ref=ref, denominators=den, entropy=ent,
                                             entropy_coef=self.entropy_coef,
                                             log_mix=None if prox.log_mix is None else prox.log_mix[rows])
            (loss * self.dp_world).backward()
            if chunks is not None:
                chunks.add(self)
            for k, v in {"loss": loss.detach().double(), **stats}.items():
                sums[k] = sums.get(k, 0) + v.detach().cpu().double()
        red = self._all_reduce(sums)
        if chunks is not None:
            red.update(chunks.variance(self))
        if not math.isfinite(red["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: loss is {red['loss']} at version {self.version}; "
                                     "step skipped, weights not updated by it")
        red["lr"] = self.scheduler.get_last_lr()[0]
        red["grad_norm"] = self._clip_and_step()
        self.scheduler.step()
        return red

    def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, lr: float | None = None) -> dict[str, float]:
        """Supervised cross-entropy on demonstration tokens (loss_mask in the Batch token layout);
        one optimizer step at `lr` (default: the schedule's) that does not advance the RL version or
        the LR schedule."""
        check_sft(input_ids, loss_mask, self.vocab_size)
        mask_all = loss_mask[:, 1:].float()
        n_tok = float(mask_all.sum())
        self.model.train()
        total = torch.zeros((), dtype=torch.float64)
        for rows, keep in self._micro_batches(input_ids.shape[0]):
            logp, _ = self._logprobs(self.model, input_ids[rows].to(self.device))
            loss = -(logp * mask_all[rows].to(self.device) * keep).sum() / n_tok
            (loss * self.dp_world).backward()
            total += loss.detach().double().cpu()
        loss_v = self._all_reduce({"loss": total})["loss"]
        if not math.isfinite(loss_v):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: sft loss is {loss_v}; step skipped, weights not updated")
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if lr is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
        try:
            norm = self._clip_and_step()
        finally:
            for g, v in zip(self.optimizer.param_groups, saved):
                g["lr"] = v
        return {"loss": loss_v, "grad_norm": norm, "tokens": n_tok}

    def _clip_and_step(self) -> float:
        if self.tp > 1:
            norm = self._tp_clip()
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"trainer: grad norm is {norm} at version {self.version}; "
                                     "step skipped, weights not updated")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_weights()
        return norm

    def _tp_clip(self) -> float:
        """Gradient clip under tensor parallelism: first sum the grads of parameters that are plain
        (or only fsdp-sharded) but computed from this rank's heads alone (the q/k norms) over the tp
        axis; then the global norm, each DTensor's from its own shards, each other tensor once."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = math.sqrt(self._sq_norm((n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None))
        if math.isfinite(norm) and norm > self.tcfg.grad_clip:
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(self.tcfg.grad_clip / (norm + 1e-6))
        return norm

    def _sq_norm(self, named: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Σ ||g||² of named gradient-shaped tensors as the global tensors they stand for: each
        DTensor from its own shards, each other tensor once. Under tensor parallelism the grads of
        parameters that are plain (or only fsdp-sharded) but computed from this rank's heads alone
        (the q/k norms) are first summed over the tp axis, in place."""
        from torch.distributed.tensor import DTensor

        sq = 0.0
        for name, g in named:
            on_tp = isinstance(g, DTensor) and g.device_mesh.mesh_dim_names and "tp" in g.device_mesh.mesh_dim_names
            if self.tp > 1 and not on_tp and (".q_norm." in name or ".k_norm." in name):
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.tp_group)
            n = torch.linalg.vector_norm(g.detach())
            sq += float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2
        return sq

    def _check_weights(self) -> None:
        """Raise NonFiniteWeightsError on every rank if any rank's parameters hold NaN/inf, so such
        weights are never pushed (one all-reduce: a rank raising alone would hang the others)."""
        from torch.distributed.tensor import DTensor

        params = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in self.model.named_parameters()]
        with torch.no_grad():
            bad = torch.stack([(~torch.isfinite(p)).sum() for _, p in params])
        total = self._all_reduce({"nonfinite": bad.sum()}, per_shard=True)["nonfinite"]
        if total:
            names = [n for (n, _), b in zip(params, bad.tolist()) if b][:3]
            raise NonFiniteWeightsError(f"trainer: {int(total)} non-finite parameter value(s) after the optimizer "
                                        f"step at version {self.version} (on this rank: {names or 'none'}); "
                                        "the weights are corrupt and are not pushed")

    def _all_reduce(self, sums: dict[str, torch.Tensor], mx: torch.Tensor | None = None,
                    per_shard: bool = False) -> dict[str, float]:
        """SUM-reduce `sums`; MAX-reduce `mx` into "mm_mismatch_max" when given. Every rank must make
        the same calls (same keys, same `mx is None`)."""
        keys = sorted(sums)
        vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
        if self.distributed:
            # gloo reduces CPU tensors; nccl needs them on the device.
            vec = vec.to(self.device)
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            if mx is not None:
                mx = mx.to(self.device)
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        if self.tp > 1 and not per_shard:  # the tp ranks of an fsdp index computed the same rows: count them once
            vec = vec / self.tp
        out = dict(zip(keys, vec.cpu().tolist()))
        if mx is not None:
            out["mm_mismatch_max"] = float(mx)
        return out

    def set_reference(self) -> bool:
        """Make the current weights the KL reference (after the supervised warm start); False when
        there is no reference (trainer.kl_coef = 0)."""
        if self.ref_model is None:
            return False
        with torch.no_grad():
            for r, p in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                r.copy_(p)
        return True

    # ------------------------------------------------------------------ weights out

    def hf_meta(self) -> dict[str, torch.Tensor]:
        """HF-named meta tensors (global shapes, no data) for a weight-sync plan. Collective under
        FSDP: torchtitan's fused-QKV state_dict hook gathers, so every rank must call it."""
        if self.tcfg.lora.rank:  # a push carries the adapters only
            return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self.hf_state_dict().items()}
        sd = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self.model.state_dict().items()
              if ".lora_" not in k}
        return self.adapter.to_hf(sd)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """What a weight push carries: full HF-named tensors, or with LoRA the adapters alone under
        PEFT names (pipeline/lora.py); a collective under FSDP, so every rank must call it."""
        if self.tcfg.lora.rank:
            from pipeline.lora import peft_state_dict

            return peft_state_dict(self.model, read_hf_config(self.hf_dir), self.tcfg.lora)
        return export_hf(self.model, self.adapter)

    def export_hf(self, out_dir: str | Path, merged: bool = False) -> str:
        """Write a vLLM-loadable HF directory. Collective: every rank gathers, rank 0 writes. With
        LoRA: the (frozen) base weights and the adapters as PEFT in out_dir/adapter, which a
        generator started on out_dir serves (a restart, the warm start); `merged`: base + adapters
        merged into the weights instead (a model any HF or vLLM loader serves as is)."""
        lcfg = self.tcfg.lora
        peft = self.hf_state_dict() if lcfg.rank else None  # collective: before rank 0's writes
        if self.rank == 0:
            save_hf_checkpoint(self.model, self.adapter, self.hf_dir, Path(out_dir))
            if peft is not None:
                from safetensors.torch import load_file, save_file

                from pipeline.lora import merge_into_hf, write_peft

                if merged:
                    path = Path(out_dir) / "model.safetensors"
                    save_file({k: v.contiguous() for k, v in merge_into_hf(load_file(str(path)), peft, lcfg).items()},
                              str(path), metadata={"format": "pt"})
                else:
                    write_peft(Path(out_dir) / "adapter", peft, lcfg, str(self.hf_dir))
        else:
            export_hf(self.model, self.adapter)  # pairs with rank 0's gathers inside save_hf_checkpoint
        self._barrier()
        return str(out_dir)

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _dcp_state(self, with_ref: bool) -> dict[str, torch.Tensor]:
        """Parameters and AdamW moments by parameter name (DTensor shards under FSDP), and the KL
        reference's parameters when `with_ref` (it may be the warm-start policy, not the checkpoint the
        run started from). Raw
        `named_parameters`, not `state_dict()`: torchtitan's fused-QKV state-dict hooks rename keys,
        which torch's get_state_dict cannot map back to parameters."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
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
            out.update({f"ref.{name}": p.detach() for name, p in self.ref_model.named_parameters()})
        return out

    def save(self, path: str | Path, data_state: dict | None = None) -> str:
        """Weights + optimizer via torch.distributed.checkpoint (sharded, reloadable at another world
        size); version, LR schedule, optimizer hyper-parameters and the caller's data position in
        trainer_state.json (rank 0); this rank's torch/python RNG in rng_rank<r>.pt."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        dcp.save(self._dcp_state(self.ref_model is not None), checkpoint_id=str(path))
        torch.save(rng_state(), path / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            state = {"version": self.version, "samples_seen": self.samples_seen, "world": self.world,
                     "skipped_steps": self.skipped_steps, "entropy_coef": self.entropy_coef,
                     "has_ref": self.ref_model is not None,
                     "scheduler": self.scheduler.state_dict(), "param_groups": groups,
                     "data_state": data_state or {}}
            (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        self._barrier()
        return str(path)

    def load(self, path: str | Path) -> dict:
        """Restore what `save` wrote, in place; returns the saved data_state. trainer.lr and
        trainer.weight_decay are this config's (they may change on resume); the LR schedule's
        position is the checkpoint's. A rank the checkpoint had no RNG file for (it was saved at a
        smaller world size) keeps its seeded RNG."""
        import torch.distributed.checkpoint as dcp

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
        self.version, self.samples_seen = int(state["version"]), int(state["samples_seen"])
        self.skipped_steps = int(state["skipped_steps"])  # the run's total goes on (trainer/skipped_steps)
        # an adapted coefficient goes on; a changed trainer.entropy_coef without a target takes the new value
        self.entropy_coef = float(state.get("entropy_coef", self.tcfg.entropy_coef)) \
            if self.tcfg.entropy_target > 0 else self.tcfg.entropy_coef
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = [self.tcfg.lr] * len(self.optimizer.param_groups)
        for g, lam in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            g.update(initial_lr=self.tcfg.lr, lr=self.tcfg.lr * lam(self.scheduler.last_epoch),
                     weight_decay=self.tcfg.weight_decay)
        rng = path / f"rng_rank{self.rank}.pt"
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
        self._barrier()
        return state["data_state"]
