"""PPO-clip policy loss with off-policy corrections, KL penalty and sampler/learner mismatch metrics.

Pure functions on tensors (no model, no torch.distributed). All per-token inputs are already
*shifted* to the prediction layout `[N, T-1]` (see pipeline/types.py): column `t` is the logprob of
`input_ids[:, t+1]`, so callers pass `behaviour_logprobs[:, 1:]` and `loss_mask[:, 1:]`.

Notation (ARCHITECTURE.md, "Importance sampling"): `logp` = log π_θ (carries the gradient),
`old` = log π_old (learner, weights before the step; detached), `mu` = log μ (sampler).

    ρ  = exp(old − mu)                       sampler → learner importance ratio (detached)
    r  = exp(logp − old)                     PPO ratio (ppo_is: exp(logp − mu))
    ℓ  = −w · min(r·A, clip(r, 1−ε, 1+ε)·A)  per token, plus kl_coef · KL(π_θ ‖ π_ref)

    none        w = 1
    tis         w = min(ρ, C)
    vanilla_is  w = ρ
    seq_is      w = min(exp(Σ_t mask·(old − mu)), C), one weight per sequence
    mis         w = ρ · 1[lo ≤ ρ ≤ hi]   (tokens outside the window are dropped; the normaliser
                                          keeps them, so dropping never up-weights the rest)
    ppo_is      w = 1, r = exp(logp − mu)

Aggregation: token_mean divides Σ ℓ·mask by the token count; seq_mean averages each sequence's
token mean over sequences. The denominators are arguments so a data-parallel trainer can pass
*global* counts and get the same loss and gradient as a single rank.
"""

from __future__ import annotations

import torch

from pipeline.config import TrainerConfig

# Log-ratios are clamped before exp so a wild sampler logprob gives a huge-but-finite weight.
_MAX_LOG_RATIO = 20.0


def is_weights(old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
               cfg: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weight w [N, T-1] (detached) for the configured correction, and a bool
    mask of the loss tokens the correction truncated or dropped (for the `is_clip_frac` metric)."""
    mask = mask.to(old.dtype)
    log_rho = (old - mu).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO) * mask
    rho = torch.exp(log_rho)
    on = mask > 0
    c = cfg.correction
    if c in ("none", "ppo_is"):
        return torch.ones_like(rho), torch.zeros_like(on)
    if c == "tis":
        return rho.clamp(max=cfg.is_cap), (rho > cfg.is_cap) & on
    if c == "vanilla_is":
        return rho, torch.zeros_like(on)
    if c == "mis":
        keep = (rho >= cfg.mis_low) & (rho <= cfg.mis_high)
        return torch.where(keep, rho, torch.zeros_like(rho)), ~keep & on
    if c == "seq_is":
        seq = torch.exp(log_rho.sum(dim=1).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        return seq.clamp(max=cfg.is_cap)[:, None].expand_as(rho), (seq > cfg.is_cap)[:, None] & on
    raise ValueError(f"losses: unknown trainer.correction={c!r}")


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples: k1 = logp − ref; k3 = e^(ref−logp) − (ref−logp) − 1."""
    if estimator == "k1":
        return logp - ref
    if estimator == "k3":
        d = (ref - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(d) - d - 1
    raise ValueError(f"losses: unknown trainer.kl_estimator={estimator!r}")


def local_denominators(mask: torch.Tensor) -> tuple[float, float]:
    """(token count, count of sequences with ≥ 1 loss token) of this shard; all-reduce for DP."""
    return float(mask.sum().item()), float((mask.sum(dim=1) > 0).sum().item())


def policy_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    mu: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    cfg: TrainerConfig,
    ref: torch.Tensor | None = None,
    denominators: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (scalar, differentiable through `logp`) and per-shard *sums* for metrics.

    `denominators` = (global token count, global sequence count); defaults to this shard's.
    The returned sums are detached: `clip_tokens` (tokens where the clipped branch is active),
    `is_clip_tokens` (tokens the correction truncated or dropped), `kl_sum`, `tokens`.
    """
    mask = mask.to(logp.dtype)
    old, mu = old.detach(), mu.detach()
    n_tok, n_seq = denominators if denominators is not None else local_denominators(mask)
    adv = advantages.to(logp.dtype)[:, None]
    base = mu if cfg.correction == "ppo_is" else old
    ratio = torch.exp((logp - base).clamp(max=_MAX_LOG_RATIO))
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    w, affected = is_weights(old, mu, mask, cfg)
    per_token = -w * surrogate
    kl = torch.zeros_like(logp)
    if ref is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, ref.detach(), cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, mask, cfg.aggregation, n_tok, n_seq)
    with torch.no_grad():
        clip_active = (clipped * adv < ratio * adv) & (mask > 0)
        stats = {
            "clip_tokens": clip_active.sum().to(torch.float64),
            "is_clip_tokens": affected.sum().to(torch.float64),
            "kl_sum": (kl * mask).sum().to(torch.float64),
            "tokens": mask.sum().to(torch.float64),
        }
    return loss, stats


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, n_tok: float, n_seq: float) -> torch.Tensor:
    """Σ over the shard divided by global denominators (so shard losses sum to the global loss)."""
    if aggregation == "token_mean":
        return (per_token * mask).sum() / max(n_tok, 1.0)
    if aggregation == "seq_mean":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(n_seq, 1.0)
    raise ValueError(f"losses: unknown trainer.aggregation={aggregation!r}")


def mismatch_sums(old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-shard sums describing sampler (μ) vs learner (π_old) disagreement on the sampled tokens.

    Sum keys can be all-reduced with SUM, `mismatch_max` with MAX; `finalize_mismatch` turns them
    into the logged metrics. Sequences without loss tokens are skipped.
    """
    with torch.no_grad():
        old, mu, mask = old.double(), mu.double(), mask.double()
        diff = (old.exp() - mu.exp()).abs() * mask
        n = mask.sum(dim=1)
        has = n > 0
        log_rho = ((old - mu) * mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        rho = torch.exp(log_rho) * mask
        per_max = diff.max(dim=1).values
        return {
            "seqs": has.sum().double(),
            "resp_max_sum": per_max[has].sum(),
            "resp_mean_sum": (diff.sum(dim=1)[has] / n[has]).sum(),
            "k1_sum": ((mu - old) * mask).sum(),
            "tokens": mask.sum(),
            "rho_sum": rho.sum(),
            "rho_sq_sum": (rho * rho).sum(),
            "mismatch_max": per_max.max() if per_max.numel() else torch.zeros((), dtype=torch.float64),
        }


def finalize_mismatch(s: dict[str, float]) -> dict[str, float]:
    """Logged metrics from (globally reduced) sums.

    mismatch_resp_max / mismatch_resp_mean: mean over responses of the per-response max / mean of
    |p_sampler − p_learner|; mismatch_max: the largest token gap in the batch; kl_sampler_learner:
    k1 estimate of KL(μ ‖ π_old) = E_μ[log μ − log π_old]; is_ess: (Σρ)² / (n·Σρ²) over tokens.
    """
    seqs, tok = max(s["seqs"], 1.0), max(s["tokens"], 1.0)
    return {
        "mismatch_resp_max": s["resp_max_sum"] / seqs,
        "mismatch_resp_mean": s["resp_mean_sum"] / seqs,
        "mismatch_max": s["mismatch_max"],
        "kl_sampler_learner": s["k1_sum"] / tok,
        "is_ess": (s["rho_sum"] ** 2) / (tok * s["rho_sq_sum"]) if s["rho_sq_sum"] > 0 else 1.0,
    }


def token_entropy_sum(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over loss tokens of the entropy of π_θ(· | prefix); logits [N, T-1, V] already shifted."""
    with torch.no_grad():
        logz = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logz.exp() * logz).sum(dim=-1)
        return (ent * mask).sum().double()
