"""PPO-clip policy loss with off-policy corrections, KL penalty and sampler/learner mismatch metrics.

Pure functions on tensors (no model, no torch.distributed). All per-token inputs are already
*shifted* to the prediction layout `[N, T-1]` (see pipeline/types.py): column `t` is the logprob of
`input_ids[:, t+1]`, so callers pass `behaviour_logprobs[:, 1:]` and `loss_mask[:, 1:]`.

Three policies meet in one loss (the decoupled PPO objective of asynchronous RL, as in AReaL):
μ, the sampler that generated the tokens (vLLM, possibly several versions behind, its logprobs
shipped with each rollout); π_old, the learner's policy before this batch's first optimizer step
(the proximal policy the PPO clip is anchored to, constant over all minibatches and epochs of the
batch); π_θ, the policy being optimised. `logp` = log π_θ (carries the gradient), `old` = log π_old
(detached), `mu` = log μ. The importance weight w corrects for sampling from μ instead of π_old; the
clip keeps π_θ near π_old. With one minibatch and one epoch π_θ = π_old numerically, so r = 1.

    ρ   = exp(old − mu)                       sampler → learner importance ratio (detached)
    r   = exp(logp − old)                     PPO ratio (ppo_is: exp(logp − mu))
    s   = min(r·A, clip(r, 1−ε, 1+ε)·A)       clipped surrogate
    s'  = max(s, c·A) if A < 0 and c > 0      dual clip (c = dual_clip): bounds the objective of a
          else s                              negative-advantage token whose r ran far above 1
    ℓ   = −w · s'                             per token, plus kl_coef · k (k: kl_penalty, below)
                                              minus entropy_coef · H(π_θ(· | prefix))

    none        w = 1
    tis         w = min(ρ, C)
    vanilla_is  w = ρ
    seq_is      w = min(exp(clamp(Σ_t mask·(old − mu), ±20)), C), one weight per sequence
    geo_is      w = min(exp(clamp(Σ_t mask·(old − mu) / |y|, ±20)), C), one weight per sequence: the
                geometric mean of its token ratios, (π_old(y)/μ(y))^(1/|y|), length-normalised as
                GSPO's s_i is (the correction for ratio_level=sequence; seq_is's truncated product
                falls with length: mean weight 0.95 / 0.60 / 0.16 at 100 / 1,000 / 4,000 tokens for a
                per-token log-ratio spread of 0.05, geo_is's stays at 1)
    mis         w = ρ · 1[lo ≤ ρ ≤ hi]   (tokens outside the window are dropped; the normaliser
                                          keeps them, so dropping never up-weights the rest)
    geo_mask    w = 1[lo ≤ g ≤ hi], g = exp(clamp(Σ_t mask·(old − mu) / |y|, ±20)), one weight per
                sequence: geo_is's ratio as a window (the mis window), the sequence kept whole or dropped whole
    ppo_is      w = 1, r = exp(logp − mu)
    mis_balance w = min(exp(clamp(Σ_t mask·old − log Σ_j α_j q_j(y), ±20)), C), one weight per
                sequence: multiple importance sampling with the balance heuristic (Veach & Guibas 1995).
                A batch whose samples come from J behaviour versions, n_j samples from version j
                (α_j = n_j / n), weights each sample by π_old(y) / Σ_j α_j q_j(y), whatever version
                made it. q_j(y) is the sequence likelihood under version j, the trainer's for every j (its
                snapshot of j; π_old's weights for the current one), the source π_old has: the weight corrects for
                the mix of versions, not the sampler/learner mismatch (`balance_log_mixture` gets log q [N, J];
                pipeline/trainer/snapshots.py). With one version it is π_old(y)/q_j(y). A sample whose tokens span
                versions has no single proposal: it gets seq_is's weight (log_mix = Σ_t mask·mu), counted.

Per-token log-ratios are clamped to ±20 before exp (a wild sampler logprob gives a huge but finite
weight); seq_is clamps only the sum, since clamping each token first would change the product.

KL penalty (`kl_penalty`), per loss token y with x = log π_θ(y) − log π_ref(y). Both estimators'
values average to KL(π_θ ‖ π_ref) over y ~ π_θ (the logged `kl_ref`); their gradients differ. For
y ~ π_θ, the prefix held fixed (how the prefix moves with θ is the policy gradient's business):

    k1   value x                 gradient x · ∇log π_θ(y)             E = ∇KL(π_θ ‖ π_ref)
    k3   value e^(−x) − 1 + x    gradient (1 − e^(−x)) · ∇log π_θ(y)  E = ∇KL(π_ref ‖ π_θ)

since ∇KL(π_θ ‖ π_ref) = Σ_y π_θ ∇log π_θ · (x + 1) = E[x · ∇log π_θ] (Σ_y ∇π_θ = 0), and
E[(1 − π_ref/π_θ) ∇log π_θ] = −Σ_y π_ref ∇log π_θ = ∇KL(π_ref ‖ π_θ). k1's own derivative, ∇x = ∇log π_θ,
has mean zero, so k1 carries x as a detached weight on ∇log π_θ (a score-function term) instead: as a
plain loss it would regularise nothing. k3 descends the reverse (mass-covering) KL instead: it raises π_θ
wherever π_ref has mass, where k1 lowers π_θ wherever it exceeds π_ref; its weight 1 − e^(−x) never
exceeds 1, k1's x is unbounded. The tokens come from the sampler μ and the KL term takes no importance
weight, so off-policy the expectations are over μ, not π_θ.

Loss recipes (trainer.recipe; docs/training.md "Loss recipes") set the parts: the clip range is
[1 − clip_eps_low, 1 + clip_eps_high]; ratio_level=sequence replaces r_t by GSPO's
s_i = exp(mean_t log r_t) in GSPO-token's form sg(s_i)·exp(logp − sg(logp)) (value s_i, gradient
s_i·∇logp per token); weight_form=cispo replaces the clipped surrogate by
sg(clip(r, 1 − ε_low, 1 + ε_high))·A·logp (no dual clip). icepop is mis (default window [0.5, 5]).

The parts are looked up by name, one table per kind, in pipeline/loss_parts.py (RATIOS, SURROGATES,
CORRECTIONS, AGGREGATIONS), from the LossSpec the TrainerConfig resolves to (`loss_spec`); each part
returns its own sums. Adding a part: its function and table entry there, its name in the config's
LOSS_PARTS (pipeline/config/recipes.py), its line above, and a test against a direct computation.

Aggregation: token_mean divides Σ ℓ·mask by the token count; seq_mean averages each sequence's
token mean over sequences; constant divides Σ ℓ·mask by sequences × max_len (Dr. GRPO). The denominators are arguments so a data-parallel trainer can pass
*global* counts and get the same loss and gradient as a single rank.

Metrics: is_ess_raw = (Σρ)² / (n·Σρ²) over the n loss tokens, how far μ is from π_old; is_ess, the
same on the weights w the loss applies (after truncation / masking; 1 for none and ppo_is), how
many tokens the update effectively learns from, and is_ess_len{lo}_{hi}, is_ess over the tokens of the
responses with lo..hi loss tokens (ESS_LENGTHS), where a sequence weight's dependence on length shows. The sampler/learner gap metrics are reported over
every loss token and split in two (`mismatch_sums`' `current`): tokens of π_old's own version, where
a gap is the two engines disagreeing, and stale tokens, where it also holds the policy's drift.
"""

from __future__ import annotations

import torch

from pipeline.config import TrainerConfig
from pipeline.loss_parts import (AGGREGATIONS, CORRECTIONS, MAX_LOG_RATIO, RATIOS, SURROGATES, LossSpec, loss_spec,
                                 lookup)


def balance_log_mixture(logq: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """log Σ_j α_j q_j(y_i) [N], α_j = n_j / Σ n: the balance heuristic's denominator, from
    logq [N, J] (log q_j(y_i), sequence log-likelihoods; -inf where q_j(y_i) = 0) and counts [J]
    (n_j, samples of the batch made by version j)."""
    counts = counts.to(logq.dtype)
    return torch.logsumexp(logq + (counts / counts.sum()).log()[None, :], dim=1)


def is_weights(old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
               cfg: TrainerConfig | LossSpec,
               log_mix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weight w [N, T-1] (detached) for the configured correction (CORRECTIONS), and a
    bool mask of the loss tokens the correction truncated or dropped (for the `is_clip_frac` metric).
    `log_mix` [N]: mis_balance's per-sample log Σ_j α_j q_j(y) (`balance_log_mixture`)."""
    spec = loss_spec(cfg)
    mask = mask.to(old.dtype)
    diff = torch.where(mask > 0, (old - mu).detach(), torch.zeros_like(old))  # where, not ·mask: inf·0 = nan
    return lookup(CORRECTIONS, "correction", spec.correction)(diff, mask, old, spec, log_mix)


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL penalty for sampled tokens, x = logp − ref. Its value estimates KL(π_θ ‖ π_ref) for
    either estimator; its gradient through `logp` is, in expectation over tokens from π_θ,
    k1: ∇KL(π_θ ‖ π_ref) (value x, gradient x·∇logp, a score-function term);
    k3: ∇KL(π_ref ‖ π_θ) (value e^(−x) − 1 + x, gradient (1 − e^(−x))·∇logp). See the module docstring."""
    x = logp - ref
    if estimator == "k1":
        # logp − sg(logp) is 0 in value and ∇logp in gradient: the value stays x, the gradient is x·∇logp.
        return x.detach() * (1 + logp - logp.detach())
    if estimator == "k3":
        d = (-x).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return torch.exp(d) - d - 1
    raise ValueError(f"losses: unknown trainer.kl_estimator={estimator!r}")


def token_advantages(advantages: torch.Tensor, old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                     reward_coef: float, distill_coef: float) -> torch.Tensor:
    """On-policy distillation's per-token advantage [N, T-1] (detached): the group advantage [N] times
    reward_coef, plus distill_coef · −(log π_old(y_t) − log π_teacher(y_t)) on every loss token, the
    reverse-KL estimator on the sampled token (no discounting; Agarwal et al. 2024, Thinking Machines
    2025). `old` is the learner's log-prob before the batch's first step (the student whose samples
    these are, up to the importance correction), `teacher` the teacher's, both shifted like `mask`."""
    mask = mask.to(old.dtype)
    gap = torch.where(mask > 0, (teacher.to(old.dtype) - old).detach(), torch.zeros_like(old))
    return (reward_coef * advantages.to(old.dtype)[:, None] + distill_coef * gap) * mask


def distill_sums(old: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                 buckets: tuple[int, ...] = (0, 16, 64)) -> dict[str, torch.Tensor]:
    """Per-shard sums of the reverse KL estimate log π_old − log π_teacher over the loss tokens, in
    total and by the token's position in its completion (buckets' lower edges), for the
    `distill/rkl*` metrics (sum and token count per bucket)."""
    with torch.no_grad():
        m = mask.double()
        x = torch.where(m > 0, old.double() - teacher.double(), torch.zeros_like(m))
        pos = (m.cumsum(dim=1) - 1) * m  # 0 at each completion's first loss token
        out = {"rkl_sum": x.sum(), "rkl_tokens": m.sum()}
        for k, lo in enumerate(buckets):
            hi = buckets[k + 1] if k + 1 < len(buckets) else None
            sel = m * (pos >= lo) * (pos < hi if hi is not None else 1)
            out[f"rkl_b{k}_sum"], out[f"rkl_b{k}_tokens"] = (x * sel).sum(), sel.sum()
        return out


def finalize_distill(s: dict[str, float]) -> dict[str, float]:
    """distill/rkl: the mean reverse KL estimate log π_old − log π_teacher per loss token, and by
    completion position (tokens 0-15, 16-63, 64 on), from `distill_sums` reduced and prefixed
    `distill_` (the trainer's first minibatch); {} when the batch had no teacher."""
    if "distill_rkl_tokens" not in s:
        return {}
    out = {"distill/rkl": s["distill_rkl_sum"] / max(s["distill_rkl_tokens"], 1.0)}
    for k, name in enumerate(("0_15", "16_63", "64_")):
        n = s[f"distill_rkl_b{k}_tokens"]
        out[f"distill/rkl_pos{name}"] = s[f"distill_rkl_b{k}_sum"] / n if n else float("nan")
    return out


def local_denominators(mask: torch.Tensor) -> tuple[float, float]:
    """(token count, count of sequences with ≥ 1 loss token) of this shard; all-reduce for DP."""
    return float(mask.sum().item()), float((mask.sum(dim=1) > 0).sum().item())


def policy_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    mu: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    cfg: TrainerConfig | LossSpec,
    ref: torch.Tensor | None = None,
    denominators: tuple[float, float] | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    log_mix: torch.Tensor | None = None,
    max_len: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (scalar, differentiable through `logp` and `entropy`) and per-shard *sums* for metrics.

    `denominators` = (global token count, global sequence count); defaults to this shard's.
    `entropy` [N, T-1]: per-token entropy of π_θ (`token_entropy`), rewarded with `entropy_coef`
    (the caller's current coefficient: fixed, or adapted by `adapt_entropy_coef`).
    `log_mix` [N]: mis_balance's per-sample mixture log-likelihood (`balance_log_mixture`).
    `max_len`: aggregation=constant's normaliser per sequence (Batch.max_len: generator.max_new_tokens, or
    task.max_total_tokens for multi-turn rollouts).
    The returned sums are detached: `clip_tokens` (tokens where the clipped branch is active; under
    cispo, where the weight is clipped), split into `clip_low_tokens` and `clip_high_tokens`,
    `dual_clip_tokens` (negative-advantage tokens held at c·A by the dual clip), `is_clip_tokens`
    (tokens the correction truncated or dropped), `kl_sum`, `tokens`; with ratio_level=sequence also
    `seq_ratio_n`, `seq_ratio_sum`, `seq_ratio_sq_sum` (GSPO's s_i over the sequences with loss tokens)
    and `seq_clip_seqs` (sequences whose s_i left the clip range).
    """
    spec = loss_spec(cfg)
    mask = mask.to(logp.dtype)
    old, mu = old.detach(), mu.detach()
    n_tok, n_seq = denominators if denominators is not None else local_denominators(mask)
    adv = advantages.to(logp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # [N] per sequence, or [N, T-1] per token (distillation)
    on = mask > 0
    base = mu if spec.anchor_at_sampler else old
    log_ratio, ratio_sums = lookup(RATIOS, "ratio_level", spec.ratio)(logp, base, mask, spec)
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    surrogate, clip_sums = lookup(SURROGATES, "weight_form", spec.surrogate)(ratio, adv, logp, on, spec)
    w, affected = is_weights(old, mu, mask, spec, log_mix)
    per_token = -w * surrogate
    kl = torch.zeros_like(logp)
    if ref is not None and spec.kl_coef > 0:
        kl = kl_penalty(logp, ref.detach(), spec.kl_estimator)
        per_token = per_token + spec.kl_coef * kl
    if entropy is not None and entropy_coef > 0:
        per_token = per_token - entropy_coef * entropy
    loss = aggregate(per_token, mask, spec.aggregation, n_tok, n_seq, max_len)
    with torch.no_grad():
        stats = {**clip_sums, "is_clip_tokens": affected.sum().to(torch.float64),
                 "kl_sum": (kl * mask).sum().to(torch.float64), "tokens": mask.sum().to(torch.float64),
                 **ratio_sums}
    return loss, stats


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, n_tok: float, n_seq: float,
              max_len: int = 0) -> torch.Tensor:
    """Σ over the shard divided by global denominators (so shard losses sum to the global loss), by the
    AGGREGATIONS entry (constant: Σ ℓ·mask / (n_seq · max_len), Dr. GRPO's, max_len > 0 required)."""
    return lookup(AGGREGATIONS, "aggregation", aggregation)(per_token, mask, n_tok, n_seq, max_len)


ESS_LENGTHS = (0, 128, 512, 2048)
"""Lower edges of the response-length buckets (loss tokens per response) of the is_ess_len* metrics."""

MAX_KEYS = ("mismatch_max", "mismatch_cur_max", "mismatch_stale_max")
"""The keys of `mismatch_sums` that are all-reduced with MAX (the others with SUM)."""


def mismatch_sums(old: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor,
                  cfg: TrainerConfig, log_mix: torch.Tensor | None = None,
                  current: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-shard sums describing sampler (μ) vs learner (π_old) disagreement on the sampled tokens,
    and the importance weights `cfg.correction` applies to them.

    `current` [N, T-1] bool: the tokens sampled by the version π_old was computed with (the
    trainer's current version). With it the gap sums are also split: `cur_*` over those tokens
    (sampler/learner disagreement proper: same weights, two engines) and `stale_*` over the others
    (that plus the policy drift since the older version that made them).
    The `MAX_KEYS` are all-reduced with MAX, the rest with SUM; `finalize_mismatch` turns them into
    the logged metrics. Sequences without loss tokens (in a split: without its tokens) are skipped.

    Example:
        s = mismatch_sums(old, mu, mask, cfg, current=versions[:, 1:] == trainer_version)
        m = finalize_mismatch({k: float(v) for k, v in s.items()})   # one shard: nothing to reduce
    """
    with torch.no_grad():
        old, mu, mask = old.double(), mu.double(), mask.double()
        gap = (old.exp() - mu.exp()).abs()
        log_rho = ((old - mu) * mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        rho = torch.exp(log_rho) * mask
        w = is_weights(old, mu, mask, cfg, None if log_mix is None else log_mix.double())[0] * mask
        out = {**_gap_sums("", gap, old - mu, mask),
               "rho_sum": rho.sum(), "rho_sq_sum": (rho * rho).sum(),
               "w_sum": w.sum(), "w_sq_sum": (w * w).sum()}
        length = mask.sum(dim=1)
        for k, lo in enumerate(ESS_LENGTHS):  # the applied weights by response length
            hi = ESS_LENGTHS[k + 1] if k + 1 < len(ESS_LENGTHS) else float("inf")
            inside = ((length >= lo) & (length < hi)).double()[:, None]
            wk = w * inside
            out.update({f"ess_len{k}_tokens": (mask * inside).sum(), f"ess_len{k}_w_sum": wk.sum(),
                        f"ess_len{k}_w_sq_sum": (wk * wk).sum()})
        if current is not None:
            cur = current.to(mask.device).bool()
            out.update(_gap_sums("cur_", gap, old - mu, mask * cur))
            out.update(_gap_sums("stale_", gap, old - mu, mask * ~cur))
        return out


def _gap_sums(prefix: str, gap: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gap sums over the tokens of `mask`, keys prefixed (the max as "mismatch_{prefix}max")."""
    diff = gap * mask
    n = mask.sum(dim=1)
    has = n > 0
    per_max = diff.max(dim=1).values
    return {
        f"{prefix}seqs": has.sum().double(),
        f"{prefix}resp_max_sum": per_max[has].sum(),
        f"{prefix}resp_mean_sum": (diff.sum(dim=1)[has] / n[has]).sum(),
        f"{prefix}k1_sum": (-log_ratio * mask).sum(),
        f"{prefix}tokens": mask.sum(),
        f"mismatch_{prefix}max": per_max.max() if per_max.numel() else torch.zeros((), dtype=torch.float64),
    }


def finalize_mismatch(s: dict[str, float]) -> dict[str, float]:
    """Logged metrics from (globally reduced) sums.

    mismatch_resp_max / mismatch_resp_mean: mean over responses of the per-response max / mean of
    |p_sampler − p_learner|; mismatch_max: the largest token gap in the batch; kl_sampler_learner:
    k1 estimate of KL(μ ‖ π_old) = E_μ[log μ − log π_old]; is_ess_raw: (Σρ)² / (n·Σρ²) over
    tokens; is_ess: the same on the applied weights w (0 when the correction zeroed every token), and
    is_ess_len{lo}_{hi} on the tokens of the responses of lo..hi loss tokens (absent for a bucket without any).
    All of these are over every loss token. When the sums carry the split (`current` given to
    `mismatch_sums`), the same four gap metrics over the current-version tokens and over the stale
    ones: mismatch_{cur,stale}_resp_max, mismatch_{cur,stale}_resp_mean, mismatch_{cur,stale}_max,
    kl_sampler_learner_{cur,stale}, and mismatch_{cur,stale}_frac, the split's share of the loss
    tokens. A split without tokens reports 0 for each (its frac says so).
    """
    seqs, tok = max(s["seqs"], 1.0), max(s["tokens"], 1.0)

    def ess(total: float, sq: float) -> float:
        return total * total / (tok * sq) if sq > 0 else (0.0 if s["tokens"] > 0 else 1.0)

    out = {
        "mismatch_resp_max": s["resp_max_sum"] / seqs,
        "mismatch_resp_mean": s["resp_mean_sum"] / seqs,
        "mismatch_max": s["mismatch_max"],
        "kl_sampler_learner": s["k1_sum"] / tok,
        "is_ess_raw": ess(s["rho_sum"], s["rho_sq_sum"]),
        "is_ess": ess(s["w_sum"], s["w_sq_sum"]),
    }
    for k, lo in enumerate(ESS_LENGTHS):  # the buckets with tokens
        n = s.get(f"ess_len{k}_tokens", 0.0)
        if n > 0:
            hi = f"{ESS_LENGTHS[k + 1] - 1}" if k + 1 < len(ESS_LENGTHS) else ""
            sq = s[f"ess_len{k}_w_sq_sum"]
            out[f"is_ess_len{lo}_{hi}"] = s[f"ess_len{k}_w_sum"] ** 2 / (n * sq) if sq > 0 else 0.0
    for part in ("cur", "stale"):
        if f"{part}_tokens" in s:
            n_seq, n_tok = max(s[f"{part}_seqs"], 1.0), s[f"{part}_tokens"]
            out.update({f"mismatch_{part}_resp_max": s[f"{part}_resp_max_sum"] / n_seq,
                        f"mismatch_{part}_resp_mean": s[f"{part}_resp_mean_sum"] / n_seq,
                        f"mismatch_{part}_max": s[f"mismatch_{part}_max"],
                        f"kl_sampler_learner_{part}": s[f"{part}_k1_sum"] / max(n_tok, 1.0),
                        f"mismatch_{part}_frac": n_tok / tok if s["tokens"] > 0 else 0.0})
    return out


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy [N, T-1] of softmax(logits), differentiable (the entropy bonus)."""
    logz = torch.log_softmax(logits.float(), dim=-1)
    return -(logz.exp() * logz).sum(dim=-1)


def adapt_entropy_coef(coef: float, entropy: float, cfg: TrainerConfig) -> float:
    """The adaptive entropy coefficient after a step whose mean token entropy was `entropy`: it
    moves by entropy_adapt_rate · (entropy_target − entropy) within [0, entropy_coef_max]; with
    entropy_target = 0 it stays `coef`. A non-finite entropy leaves it unchanged."""
    if cfg.entropy_target <= 0 or entropy != entropy or abs(entropy) == float("inf"):
        return coef
    return min(max(coef + cfg.entropy_adapt_rate * (cfg.entropy_target - entropy), 0.0), cfg.entropy_coef_max)
