"""Loss math vs a direct float64 reference (plain Python loops), per correction mode and edge case."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import TrainerConfig
from pipeline.losses import finalize_mismatch, is_weights, mismatch_sums, policy_loss

MODES = ("none", "tis", "seq_is", "mis", "ppo_is", "vanilla_is")


def reference(logp, old, mu, mask, adv, cfg: TrainerConfig, ref=None):
    """Loss value and d loss / d logp written out element by element, in float64."""
    n, t = len(logp), len(logp[0])
    eps, cap = cfg.clip_eps, cfg.is_cap
    seq_w = []
    for i in range(n):
        s = sum(old[i][j] - mu[i][j] for j in range(t) if mask[i][j])
        seq_w.append(min(math.exp(s), cap))
    per_tok, grad = [[0.0] * t for _ in range(n)], [[0.0] * t for _ in range(n)]
    for i in range(n):
        for j in range(t):
            if not mask[i][j]:
                continue
            rho = math.exp(old[i][j] - mu[i][j])
            w = {"none": 1.0, "ppo_is": 1.0, "tis": min(rho, cap), "vanilla_is": rho, "seq_is": seq_w[i],
                 "mis": rho if cfg.mis_low <= rho <= cfg.mis_high else 0.0}[cfg.correction]
            base = mu[i][j] if cfg.correction == "ppo_is" else old[i][j]
            r = math.exp(logp[i][j] - base)
            a = adv[i]
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            per_tok[i][j] = -w * min(unclipped, clipped)
            # d/dlogp: the unclipped branch is active when it is the min (ties included: both agree).
            grad[i][j] = -w * a * r if unclipped <= clipped else 0.0
            if ref is not None and cfg.kl_coef > 0:
                d = ref[i][j] - logp[i][j]
                if cfg.kl_estimator == "k1":
                    per_tok[i][j] += cfg.kl_coef * (logp[i][j] - ref[i][j])
                    grad[i][j] += cfg.kl_coef
                else:
                    per_tok[i][j] += cfg.kl_coef * (math.exp(d) - d - 1)
                    grad[i][j] += cfg.kl_coef * (1 - math.exp(d))
    if cfg.aggregation == "token_mean":
        den = sum(mask[i][j] for i in range(n) for j in range(t))
        loss = sum(map(sum, per_tok)) / den
        g = [[x / den for x in row] for row in grad]
    else:
        cnt = [sum(mask[i]) for i in range(n)]
        nseq = sum(1 for c in cnt if c > 0)
        loss = sum(sum(per_tok[i]) / cnt[i] for i in range(n) if cnt[i]) / nseq
        g = [[grad[i][j] / (cnt[i] * nseq) if cnt[i] else 0.0 for j in range(t)] for i in range(n)]
    return loss, g


def random_inputs(seed: int, n: int = 5, t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    mu = old + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    logp = old + 0.25 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=gen) > 0.3).double()
    mask[0, :] = 0  # a sequence with no loss tokens at all
    mask[1, 0] = 0  # a masked token inside a live sequence
    mask[2, :] = 1
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    return logp, old, mu, mask, adv, ref


def check(cfg, logp, old, mu, mask, adv, ref=None):
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, old, mu, mask, adv, cfg, ref=ref)
    loss.backward()
    want, want_grad = reference(logp.tolist(), old.tolist(), mu.tolist(), mask.tolist(), adv.tolist(), cfg,
                                ref.tolist() if ref is not None else None)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert torch.all(x.grad[mask == 0] == 0), "a masked token received gradient"
    return loss, stats


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_grad_match_float64_reference(mode, aggregation):
    for seed in range(3):
        cfg = TrainerConfig(correction=mode, aggregation=aggregation, is_cap=1.5, mis_low=0.8, mis_high=1.25)
        check(cfg, *random_inputs(seed)[:5])


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("mode", ["none", "tis"])
def test_kl_penalty_matches_reference(mode, estimator):
    cfg = TrainerConfig(correction=mode, kl_coef=0.1, kl_estimator=estimator)
    check(cfg, *random_inputs(7))


@pytest.mark.parametrize("mode", MODES)
def test_ratio_exactly_at_clip_bound(mode):
    """r = 1+ε with A > 0 and r = 1−ε with A < 0: the branches tie, value and gradient still agree."""
    cfg = TrainerConfig(correction=mode, clip_eps=0.25)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    mu = old.clone()  # no mismatch, so ppo_is clips on the same ratio
    logp = old + torch.tensor([[math.log(1.25)] * 3, [math.log(0.75)] * 3], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    _, stats = check(cfg, logp, old, mu, mask, adv)
    assert stats["clip_tokens"].item() == 0  # a tie is not a clip


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_advantages_give_zero_loss_and_grad(mode):
    logp, old, mu, mask, _, _ = random_inputs(3)
    cfg = TrainerConfig(correction=mode)
    x = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, mu, mask, torch.zeros(len(logp), dtype=torch.float64), cfg)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(x.grad) == 0
    check(cfg, logp, old, mu, mask, torch.zeros(len(logp), dtype=torch.float64))


def test_is_weights_follow_their_definitions():
    old = torch.zeros(1, 4, dtype=torch.float64)
    mu = -torch.log(torch.tensor([[0.5, 1.0, 3.0, 10.0]], dtype=torch.float64))  # rho = 0.5, 1, 3, 10
    mask = torch.ones(1, 4, dtype=torch.float64)
    w, hit = is_weights(old, mu, mask, TrainerConfig(correction="tis", is_cap=2.0))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0, 2.0]], dtype=torch.float64))
    assert hit.tolist() == [[False, False, True, True]]
    w, hit = is_weights(old, mu, mask, TrainerConfig(correction="mis", mis_low=0.6, mis_high=3.5))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 3.0, 0.0]], dtype=torch.float64))
    assert hit.tolist() == [[True, False, False, True]]
    w, _ = is_weights(old, mu, mask, TrainerConfig(correction="seq_is", is_cap=100.0))
    torch.testing.assert_close(w, torch.full((1, 4), 15.0, dtype=torch.float64))
    w, _ = is_weights(old, mu, mask, TrainerConfig(correction="vanilla_is"))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 3.0, 10.0]], dtype=torch.float64))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_on_policy_every_mode_has_the_plain_ppo_gradient(aggregation):
    """μ = π_old = π_θ (one epoch, no mismatch): every weight is 1, so every gradient equals PPO's."""
    logp, _, _, mask, adv, _ = random_inputs(11)
    grads = {}
    for mode in MODES:
        x = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, x.detach(), logp.clone(), mask, adv, TrainerConfig(correction=mode,
                              aggregation=aggregation))
        loss.backward()
        grads[mode] = x.grad
    assert grads["none"].abs().sum() > 0
    for mode in MODES:
        torch.testing.assert_close(grads[mode], grads["none"], rtol=0, atol=1e-15)


def test_sharded_denominators_sum_to_the_full_loss():
    logp, old, mu, mask, adv, _ = random_inputs(5, n=6)
    for agg in ("token_mean", "seq_mean"):
        cfg = TrainerConfig(correction="tis", aggregation=agg)
        full, _ = policy_loss(logp, old, mu, mask, adv, cfg)
        den = (mask.sum().item(), (mask.sum(1) > 0).sum().item())
        parts = [policy_loss(logp[s], old[s], mu[s], mask[s], adv[s], cfg, denominators=den)[0]
                 for s in (slice(0, 3), slice(3, 6))]
        assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)


def test_mismatch_metrics_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.4, 0.4, 0.4]], dtype=torch.float64))
    mu = torch.log(torch.tensor([[0.25, 0.9, 0.9], [0.4, 0.4, 0.4]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    m = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, mu, mask).items()})
    assert m["mismatch_max"] == pytest.approx(0.25)  # the masked token's 0.7 gap is ignored
    assert m["mismatch_resp_max"] == pytest.approx((0.25 + 0.0) / 2)
    assert m["mismatch_resp_mean"] == pytest.approx((0.125 + 0.0) / 2)
    assert m["kl_sampler_learner"] == pytest.approx(math.log(0.5) / 5)
    rho = [2.0, 1.0, 1.0, 1.0, 1.0]
    assert m["is_ess"] == pytest.approx(sum(rho) ** 2 / (5 * sum(x * x for x in rho)))
    same = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, old, mask).items()})
    assert same["is_ess"] == pytest.approx(1.0) and same["mismatch_max"] == 0.0
