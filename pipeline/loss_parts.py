"""The policy loss's parts, one table per kind: the spec a TrainerConfig resolves to, and each part's formula.

    spec = loss_spec(cfg.trainer)                 # once, after the recipe has filled the parts
    w, dropped = CORRECTIONS[spec.correction](diff, mask, old, spec, log_mix)

`policy_loss` (pipeline/losses.py, whose docstring has the symbols) composes one part of each kind:

    RATIOS        token | sequence               (logp, base, mask, spec) -> log r, sums
    SURROGATES    ppo | cispo                    (ratio, adv, logp, on, spec) -> s, sums
    CORRECTIONS   none | tis | seq_is | ...      (diff, mask, old, spec, log_mix) -> w, dropped
    AGGREGATIONS  token_mean | seq_mean | constant  (per_token, mask, n_tok, n_seq, max_len) -> loss

Each part returns its own per-shard sums (the trainer all-reduces them); a part whose sums the trainer
turns into per-batch metrics also has an entry in STEP_METRICS. The table keys are the values the
config accepts: pipeline/config/recipes.py LOSS_PARTS lists them (the config package imports nothing
of the project), and importing this module checks that the two agree.

Adding a part: its function here, its entry in the table, its name in LOSS_PARTS, and a test that holds
it against a direct computation (tests/test_losses.py); nothing else branches on the names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from pipeline.config.recipes import LOSS_PARTS

if TYPE_CHECKING:
    from pipeline.config import TrainerConfig

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped before exp so a wild sampler logprob gives a huge-but-finite weight."""


@dataclass(frozen=True)
class LossSpec:
    """The loss a TrainerConfig asks for, its recipe resolved: one name per kind and their parameters."""

    ratio: str
    """RATIOS key (trainer.ratio_level)."""
    surrogate: str
    """SURROGATES key (trainer.weight_form)."""
    correction: str
    """CORRECTIONS key (trainer.correction)."""
    aggregation: str
    """AGGREGATIONS key (trainer.aggregation)."""
    eps_low: float
    eps_high: float
    dual_clip: float
    is_cap: float
    mis_low: float
    mis_high: float
    kl_coef: float
    kl_estimator: str
    reward_coef: float
    """The group advantage's weight in each token's advantage (token_advantages)."""
    distill_coef: float
    """The teacher's per-token advantage's weight (token_advantages)."""

    @property
    def anchor_at_sampler(self) -> bool:
        """ppo_is: the PPO ratio is exp(logp − mu), anchored at the sampler instead of π_old."""
        return self.correction == "ppo_is"


def loss_spec(cfg: TrainerConfig | LossSpec) -> LossSpec:
    """The spec of a TrainerConfig whose recipe is resolved (its __post_init__ did that); a spec as is."""
    if isinstance(cfg, LossSpec):
        return cfg
    return LossSpec(ratio=cfg.ratio_level, surrogate=cfg.weight_form, correction=cfg.correction,
                    aggregation=cfg.aggregation, eps_low=cfg.clip_eps_low, eps_high=cfg.clip_eps_high,
                    dual_clip=cfg.dual_clip, is_cap=cfg.is_cap, mis_low=cfg.mis_low, mis_high=cfg.mis_high,
                    kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, reward_coef=cfg.reward_coef,
                    distill_coef=cfg.distill_coef)


def lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    """table[name], or a ValueError naming the config key."""
    if name not in table:
        raise ValueError(f"losses: unknown trainer.{kind}={name!r}")
    return table[name]


def _count(x: torch.Tensor) -> torch.Tensor:
    return x.sum().to(torch.float64)


# --- ratio: r_t, the PPO ratio each token's surrogate sees ---------------------------------------------

def token_ratio(logp, base, mask, spec):
    """log r_t = logp − base on the loss tokens (where: -inf padding would give nan)."""
    return torch.where(mask > 0, logp - base, torch.zeros_like(logp)), {}


def sequence_ratio(logp, base, mask, spec):
    """GSPO: s_i = exp(mean_t log r_t); GSPO-token's form sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)) has s_i's value and
    gives token t the gradient s_i·∇log π_θ(y_t), so seq_mean's 1/|y_i| makes it GSPO's gradient exactly.
    Sums: seq_ratio_n, seq_ratio_sum, seq_ratio_sq_sum (s_i over the sequences with loss tokens) and
    seq_clip_seqs (sequences whose s_i left the clip range)."""
    on = mask > 0
    log_ratio = torch.where(on, logp - base, torch.zeros_like(logp))
    seq_log = (log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).detach()
    seq_ratio = torch.exp(seq_log.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    with torch.no_grad():
        has = on.any(dim=1)
        s_r = seq_ratio[has].to(torch.float64)
        sums = {"seq_ratio_n": _count(has), "seq_ratio_sum": s_r.sum(), "seq_ratio_sq_sum": (s_r * s_r).sum(),
                "seq_clip_seqs": _count((s_r < 1 - spec.eps_low) | (s_r > 1 + spec.eps_high))}
    return seq_log[:, None] + logp - logp.detach(), sums


RATIOS = {"token": token_ratio, "sequence": sequence_ratio}


# --- surrogate: s_t from r_t and A ----------------------------------------------------------------------

def _clip_sums(low, high, dual, on):
    return {"clip_tokens": _count(low | high), "clip_low_tokens": _count(low), "clip_high_tokens": _count(high),
            "dual_clip_tokens": _count(dual & on)}


def ppo_clip(ratio, adv, logp, on, spec):
    """min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), then the dual clip max(s, c·A) for A < 0 (c > 0).
    The clip counts where the clipped branch is active: A > 0 above 1 + ε_high, A < 0 below 1 − ε_low."""
    lo, hi = 1 - spec.eps_low, 1 + spec.eps_high
    clipped = ratio.clamp(lo, hi)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    dual = torch.zeros_like(on)
    if spec.dual_clip > 0:
        # For A < 0 the clipped surrogate is A·max(r, 1−ε), unbounded below as r grows, so one
        # token with a huge r would dominate the batch. At the bound the token has no gradient;
        # a tie (s = c·A) keeps the surrogate's gradient.
        bound = spec.dual_clip * adv
        dual = (adv < 0) & (surrogate < bound)
        surrogate = torch.where(dual, bound, surrogate)
    with torch.no_grad():
        r = ratio.detach()
        sums = _clip_sums((adv < 0) & (r < lo) & on, (adv > 0) & (r > hi) & on, dual, on)
    return surrogate, sums


def cispo(ratio, adv, logp, on, spec):
    """CISPO: sg(clip(r, 1 − ε_low, 1 + ε_high))·A·logp, a detached weight on a REINFORCE term, so every
    token keeps a gradient (no dual clip). The clip counts where the weight is clipped, whatever A's sign."""
    lo, hi = 1 - spec.eps_low, 1 + spec.eps_high
    surrogate = ratio.clamp(lo, hi).detach() * adv * logp
    with torch.no_grad():
        r = ratio.detach()
        sums = _clip_sums((r < lo) & on, (r > hi) & on, torch.zeros_like(on), on)
    return surrogate, sums


SURROGATES = {"ppo": ppo_clip, "cispo": cispo}


# --- correction: the importance weight w_t (detached) and the loss tokens it truncated or dropped ---------

def _rho(diff):
    return torch.exp(diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def no_weight(diff, mask, old, spec, log_mix):
    """none, ppo_is: w = 1."""
    return torch.ones_like(diff), torch.zeros_like(mask > 0)


def tis_weight(diff, mask, old, spec, log_mix):
    """w = min(ρ, C)."""
    rho = _rho(diff)
    return rho.clamp(max=spec.is_cap), (rho > spec.is_cap) & (mask > 0)


def vanilla_weight(diff, mask, old, spec, log_mix):
    """w = ρ."""
    return _rho(diff), torch.zeros_like(mask > 0)


def mis_weight(diff, mask, old, spec, log_mix):
    """w = ρ · 1[lo ≤ ρ ≤ hi] (icepop: the same, its window [0.5, 5] by default)."""
    rho = _rho(diff)
    keep = (rho >= spec.mis_low) & (rho <= spec.mis_high)
    return torch.where(keep, rho, torch.zeros_like(rho)), ~keep & (mask > 0)


def _per_sequence(log_w, mask, spec):
    """min(exp(clamp(log_w, ±20)), C) per sequence, spread over its tokens."""
    seq = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return seq.clamp(max=spec.is_cap)[:, None].expand_as(mask), (seq > spec.is_cap)[:, None] & (mask > 0)


def seq_weight(diff, mask, old, spec, log_mix):
    """w = min(exp(clamp(Σ_t mask·(old − mu), ±20)), C): the sum is clamped, not each token (a sequence
    whose token log-ratios cancel is not a wild sequence)."""
    return _per_sequence(diff.sum(dim=1), mask, spec)


def geo_weight(diff, mask, old, spec, log_mix):
    """w = min(exp(clamp(Σ_t mask·(old − mu) / |y|, ±20)), C): the geometric mean of the token ratios."""
    return _per_sequence(diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0), mask, spec)


def geo_mask_weight(diff, mask, old, spec, log_mix):
    """geo_mask: w = 1[lo ≤ g ≤ hi] per sequence, g = exp(Σ_t mask·(old − mu) / |y|) the geometric mean of
    its token ratios, [lo, hi] = [mis_low, mis_high]: a sequence is kept whole at weight 1 or dropped whole
    (geometric rejection sampling), so no token of a kept sequence is reweighted."""
    g = torch.exp((diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    keep = ((g >= spec.mis_low) & (g <= spec.mis_high))[:, None].expand_as(mask)
    return keep.to(diff.dtype), ~keep & (mask > 0)


def balance_weight(diff, mask, old, spec, log_mix):
    """mis_balance: w = min(exp(clamp(Σ_t mask·old − log Σ_j α_j q_j(y), ±20)), C) per sequence."""
    if log_mix is None:
        raise ValueError("losses: trainer.correction='mis_balance' needs log_mix (balance_log_mixture)")
    lw = torch.where(mask > 0, old.detach(), torch.zeros_like(old)).sum(dim=1) - log_mix.to(old.dtype)
    return _per_sequence(lw, mask, spec)


CORRECTIONS = {"none": no_weight, "tis": tis_weight, "seq_is": seq_weight, "geo_is": geo_weight,
               "mis": mis_weight, "icepop": mis_weight, "mis_balance": balance_weight, "ppo_is": no_weight,
               "vanilla_is": vanilla_weight, "geo_mask": geo_mask_weight}


# --- aggregation: the loss from ℓ_t, with global denominators so shard losses sum to the global loss -----

def token_mean(per_token, mask, n_tok, n_seq, max_len):
    """Σ ℓ·mask / the batch's token count."""
    return (per_token * mask).sum() / max(n_tok, 1.0)


def seq_mean(per_token, mask, n_tok, n_seq, max_len):
    """The mean over sequences of each one's token mean."""
    per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_seq.sum() / max(n_seq, 1.0)


def constant(per_token, mask, n_tok, n_seq, max_len):
    """Σ ℓ·mask / (n_seq · max_len), Dr. GRPO's constant normaliser (max_len > 0 required)."""
    if max_len <= 0:
        raise ValueError("losses: aggregation='constant' needs max_len > 0 (generator.max_new_tokens)")
    return (per_token * mask).sum() / (max(n_seq, 1.0) * max_len)


AGGREGATIONS = {"token_mean": token_mean, "seq_mean": seq_mean, "constant": constant}


# --- per-batch metrics of a part, from its steps' reduced sums -------------------------------------------

def _mean(steps, f) -> float:
    return sum(f(s) for s in steps) / len(steps)


def cispo_metrics(steps: list[dict]) -> dict[str, float]:
    """cispo_clip_frac: the share of loss tokens whose weight was clipped."""
    return {"cispo_clip_frac": _mean(steps, lambda s: s["clip_tokens"] / max(s["tokens"], 1.0))}


def sequence_metrics(steps: list[dict]) -> dict[str, float]:
    """seq_ratio_mean, seq_ratio_std (the spread of s_i over the batch) and seq_clip_frac."""
    def stats(s: dict) -> tuple[float, float, float]:
        n = max(s["seq_ratio_n"], 1.0)
        m = s["seq_ratio_sum"] / n
        return m, math.sqrt(max(s["seq_ratio_sq_sum"] / n - m * m, 0.0)), s["seq_clip_seqs"] / n
    return {"seq_ratio_mean": _mean(steps, lambda s: stats(s)[0]), "seq_ratio_std": _mean(steps, lambda s: stats(s)[1]),
            "seq_clip_frac": _mean(steps, lambda s: stats(s)[2])}


STEP_METRICS = {("surrogate", "cispo"): cispo_metrics, ("ratio", "sequence"): sequence_metrics}
"""(kind, name) -> the part's per-batch metrics from the batch's optimizer steps' sums; a part without
metrics of its own has no entry."""


def step_metrics(spec: LossSpec, steps: list[dict]) -> dict[str, float]:
    """The metrics of the spec's parts that have STEP_METRICS, over a batch's optimizer steps."""
    out: dict[str, float] = {}
    for kind in ("ratio", "surrogate", "correction", "aggregation"):
        f = STEP_METRICS.get((kind, getattr(spec, kind)))
        if f is not None:
            out.update(f(steps))
    return out


_TABLES = {"ratio_level": RATIOS, "weight_form": SURROGATES, "correction": CORRECTIONS, "aggregation": AGGREGATIONS}
for _key, _table in _TABLES.items():  # the config accepts exactly the parts there are
    if tuple(_table) != LOSS_PARTS[_key]:
        raise ImportError(f"loss_parts: {_key} table {tuple(_table)} differs from the config's LOSS_PARTS "
                          f"{LOSS_PARTS[_key]} (pipeline/config/recipes.py)")
