"""What the train step remembers besides the weights: π_old of the batch (`Proximal`), the per
micro-batch gradient shares for trainer.grad_variance (`GradChunks`), and mis_balance's copies of
earlier versions' weights (`Snapshots`).

Contract:
- Proximal lives for one batch. Each row's log π_old (and log π_ref) is recorded once, from a forward
  with the weights from before the batch's first optimizer step, before any step reads it; the
  once-per-batch metric sums (sampler/learner mismatch, π_old entropy) grow with each record.
- GradChunks lives for one optimizer step: `add` after each micro-batch's backward, `variance` after
  the last one and before the clip (which scales the gradients).
- Snapshots lives for the run (not checkpointed: a resumed run falls back to seq_is's weight until it
  has refilled). `balance_mixture` runs before the batch's first forward: it copies the weights of
  the current version once (the weights its generators served; a skipped batch's applied minibatch
  steps do not replace them), drops those older than buffer.max_staleness versions, scores the
  batch under each behaviour version of it (the current one with the live weights while they are
  still that version's, the others with their snapshots) and puts the live weights back before it
  returns, also when scoring raises. Only trainable parameters (requires_grad) are copied: the frozen
  ones (the LoRA base) are the same in every version. The copies are this rank's shards, so every
  rank keeps its own, in the compute dtype (`dtype`, model.dtype): a bf16 snapshot of the float32
  master is exactly what the forward of that version computed with, at half the memory; the live
  weights it puts back are copied at full precision.

Example:
    prox = Proximal(mask.shape, device, tcfg, score_ref, version)  # one batch
    mis = snapshots.balance_mixture(version, batch, plan, prox)  # mis_balance only: sets prox.log_mix
    prox.record(batch, rows, keep, ids, logp, entropy)            # each pre-step forward
    chunks = GradChunks(par)
    loss.backward(); chunks.add(model)                            # each micro-batch
    metrics.update(chunks.variance())                             # before the clip
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from pipeline import losses
from pipeline.config import TrainerConfig
from pipeline.trainer.parallel import Parallel, local, resharded
from pipeline.types import Batch

Plan = list[tuple[torch.Tensor, list[tuple[torch.Tensor, float]]]]  # see batches.minibatch_plan
Score = Callable[[torch.Tensor], torch.Tensor]  # token ids [n, T] -> log-probs [n, T-1] of a model


class Proximal:
    """π_old of one batch on this rank: log π_old (and log π_ref, when `score_ref` scores the KL
    reference) per row from pre-step forwards, and the once-per-batch metric sums."""

    def __init__(self, shape: torch.Size, device: torch.device, tcfg: TrainerConfig,
                 score_ref: Score | None = None, version: int | None = None) -> None:
        self.tcfg, self.device, self.score_ref, self.version = tcfg, device, score_ref, version
        self.logp = torch.zeros(shape, device=device)
        self.ref = torch.zeros(shape, device=device) if score_ref is not None else None
        self.log_mix: torch.Tensor | None = None  # mis_balance: per row, log Σ_j α_j q_j(y) (balance_log_mixture)
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}  # "mm_" + losses.MAX_KEYS, all-reduced with MAX

    def record(self, batch: Batch, rows: torch.Tensor, keep: float, ids: torch.Tensor,
               logp: torch.Tensor, entropy: torch.Tensor) -> None:
        """Store log π_old (and log π_ref) of `rows` from a pre-step forward, and add the rows'
        sampler/learner mismatch and π_old entropy (`entropy` [n, T-1], per token) to the once-per-batch sums. With `version` (the
        trainer's, which π_old is computed with) the mismatch is also split into the tokens that
        version made and the stale ones (losses.mismatch_sums)."""
        logp = logp.detach()
        mask = batch.loss_mask[rows, 1:].float().to(self.device) * keep
        mu = batch.behaviour_logprobs[rows, 1:].to(self.device).float()
        if keep:  # a padding micro-batch's dummy row may be a real row of another minibatch
            self.logp[rows] = logp
            if self.ref is not None:
                with torch.no_grad():
                    self.ref[rows] = self.score_ref(ids)
        current = None if self.version is None else batch.versions[rows, 1:].to(self.device) == self.version
        mm = losses.mismatch_sums(logp, mu, mask, self.tcfg, None if self.log_mix is None else self.log_mix[rows],
                                  current)
        for k in losses.MAX_KEYS:
            if k in mm:
                v = mm.pop(k).detach().cpu().double()
                self.maxes[f"mm_{k}"] = torch.maximum(self.maxes[f"mm_{k}"], v) if f"mm_{k}" in self.maxes else v
        for k, v in {"entropy_sum": (entropy.detach() * mask).sum().double(),
                     **{f"mm_{k}": v for k, v in mm.items()}}.items():
            self.sums[k] = self.sums.get(k, 0) + v.detach().cpu().double()


class GradChunks:
    """trainer.grad_variance: the squared norm of each micro-batch's share of the accumulated
    gradient (the accumulated gradient after it minus before it), then the variance of their sum."""

    def __init__(self, par: Parallel) -> None:
        self.par = par
        self.prev: dict[str, torch.Tensor] = {}
        self.sq: list[float] = []

    def add(self, model: torch.nn.Module) -> None:
        grads = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        with torch.no_grad():
            diffs = [(n, g - self.prev[n] if n in self.prev else g.clone()) for n, g in grads]
            self.sq.append(self.par.sq_norm(diffs))
            self.prev = {n: g.detach().clone() for n, g in grads}

    def variance(self) -> dict[str, float]:
        k = len(self.sq)
        if k < 2:  # one chunk has no spread to measure (a batch smaller than two micro-batches)
            return {"grad_var_chunks": float(k)}
        total = self.par.sq_norm((n, g.clone()) for n, g in self.prev.items())
        var = k / (k - 1) * max(sum(self.sq) - total / k, 0.0)
        return {"grad_var": var, "grad_var_rel": var / max(total, 1e-30), "grad_var_chunks": float(k)}


class Snapshots:
    """mis_balance: this rank's shards of the weights of the last `keep` versions before the current
    one (version -> a copy in `dtype` of the parameters that train: those with requires_grad; the frozen
    ones, the base under LoRA, are the same in every version), to score each sample under every
    behaviour version of its batch. `score` is the learner's forward at the sampling temperature on
    `model`."""

    def __init__(self, model: torch.nn.Module, keep: int, score: Score, dtype: torch.dtype) -> None:
        self.model, self.keep, self.score, self.dtype = model, keep, score, dtype
        self.weights: dict[int, list[torch.Tensor]] = {}

    def balance_mixture(self, version: int, batch: Batch, plan: Plan, prox: Proximal) -> dict[str, float]:
        """prox.log_mix[i] = log Σ_j α_j q_j(y_i) over the behaviour versions j of the batch
        (α_j = n_j / n). Every q_j is the trainer's, the version that made y_i included: a forward
        with the snapshot of version j (the current version's with the live weights, π_old's, while
        no step of it has been applied). One likelihood source, the one π_old comes from: the weight
        corrects for the mixture of behaviour versions only, and the sampler/learner numeric mismatch
        is not part of it (the mismatch metrics report it). A sample whose model tokens span versions
        (the config refuses mis_balance where that can happen), or a batch with a version no snapshot
        is kept for (after a resume), gets seq_is's weight (log_mix = Σ mask·mu), counted. Metrics:
        versions, mixed samples, fallback, scoring seconds, snapshot memory (per version kept) and
        the full-precision live copy made to put the live weights back."""
        t0 = time.monotonic()
        self._resharded()
        fresh = version not in self.weights  # the live weights are still the served ones of `version`
        if fresh:
            self.weights[version] = self._copy(self.dtype)
        for v in [v for v in self.weights if v < version - self.keep]:
            del self.weights[v]
        mask = batch.loss_mask[:, 1:].float()
        mu_seq = (batch.behaviour_logprobs[:, 1:].float() * mask).sum(1).double()
        own: list[int | None] = []
        for i in range(batch.num_samples):  # the one version of each sample's model tokens, or None
            vs = batch.versions[i, 1:][mask[i] > 0].unique().tolist()
            own.append(int(vs[0]) if len(vs) == 1 else None)
        versions = sorted({v for v in own if v is not None})
        log_mix = mu_seq.clone()
        fallback = any(v not in self.weights for v in versions)
        live: list[torch.Tensor] | None = None
        if versions and not fallback:
            counts = torch.tensor([sum(1 for v in own if v == j) for j in versions], dtype=torch.float64)
            logq = torch.full((batch.num_samples, len(versions)), float("nan"), dtype=torch.float64)
            # the live weights first, while nothing is loaded; any other version needs them copied to put back
            order = sorted(enumerate(versions), key=lambda kj: not (fresh and kj[1] == version))
            live = self._copy(None) if any(not (fresh and j == version) for j in versions) else None
            try:
                for k, j in order:
                    if not (fresh and j == version):
                        self._load(self.weights[j])
                    with torch.no_grad():
                        for _, micro in plan:
                            for rows, _keep in micro:
                                lp = self.score(batch.input_ids[rows])
                                logq[rows, k] = (lp * mask[rows].to(lp.device)).sum(1).double().cpu()
            finally:
                if live is not None:
                    self._load(live)
            rows = [i for i, v in enumerate(own) if v is not None and not torch.isnan(logq[i]).any()]
            if rows:
                log_mix[rows] = losses.balance_log_mixture(logq[rows], counts)
        prox.log_mix = log_mix.to(prox.device)
        return {"mis_balance/versions": float(len(versions)), "mis_balance/fallback": float(fallback),
                "mis_balance/mixed_samples": float(sum(v is None for v in own)),
                "mis_balance/score_s": time.monotonic() - t0, "mis_balance/snapshots": float(len(self.weights)),
                "mis_balance/snapshot_mb": _mb(self.weights[version]), "mis_balance/live_copy_mb": _mb(live or [])}

    def _trainable(self) -> list[torch.Tensor]:
        """This rank's shards of the parameters a step can change (requires_grad), in model order."""
        return [local(p) for p in self.model.parameters() if p.requires_grad]

    def _copy(self, dtype: torch.dtype | None) -> list[torch.Tensor]:
        """The trainable shards, in `dtype` (None: each parameter's own, an exact copy)."""
        with torch.no_grad():
            return [p.detach().to(dtype or p.dtype, copy=True) for p in self._trainable()]

    def _load(self, weights: list[torch.Tensor]) -> None:
        self._resharded()
        with torch.no_grad():
            for p, w in zip(self._trainable(), weights, strict=True):
                p.copy_(w)

    def _resharded(self) -> None:
        """Parameters always seen as this rank's shards (what the snapshots hold; parallel.resharded)."""
        resharded(self.model)


def _mb(tensors: list[torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20
