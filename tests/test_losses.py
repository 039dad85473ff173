"""Loss math vs a direct float64 reference (plain Python loops), per correction mode and edge case:
PPO clip, dual clip, IS weights (sequence IS clamps only the summed log-ratio), KL, aggregation,
sampler/learner mismatch metrics (over all tokens and split into current and stale ones, reduced over two
gloo ranks) and the effective sample size of raw and applied weights.

    .venv/bin/python -m pytest -q tests/test_losses.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.config import TrainerConfig
from pipeline.losses import MAX_KEYS, finalize_mismatch, is_weights, kl_penalty, mismatch_sums, policy_loss
from pipeline.trainer.parallel import Parallel

MODES = ("none", "tis", "seq_is", "geo_is", "mis", "ppo_is", "vanilla_is", "geo_mask")


def clamp20(x: float) -> float:
    return min(max(x, -20.0), 20.0)


def ref_weights(old, mu, mask, cfg: TrainerConfig):
    """(ρ, w) per token by definition; masked tokens get 0 in both."""
    n, t = len(old), len(old[0])
    seq_w, geo_w, geo_keep = [], [], []
    for i in range(n):
        s = sum(old[i][j] - mu[i][j] for j in range(t) if mask[i][j])
        seq_w.append(min(math.exp(clamp20(s)), cfg.is_cap))  # only the sum is clamped
        k = sum(1 for j in range(t) if mask[i][j])
        geo_w.append(min(math.exp(clamp20(s / max(k, 1))), cfg.is_cap))  # the geometric mean of the ratios
        geo_keep.append(1.0 if cfg.mis_low <= math.exp(clamp20(s / max(k, 1))) <= cfg.mis_high else 0.0)
    rho, w = [[0.0] * t for _ in range(n)], [[0.0] * t for _ in range(n)]
    for i in range(n):
        for j in range(t):
            if not mask[i][j]:
                continue
            p = math.exp(clamp20(old[i][j] - mu[i][j]))
            rho[i][j] = p
            w[i][j] = {"none": 1.0, "ppo_is": 1.0, "tis": min(p, cfg.is_cap), "vanilla_is": p, "seq_is": seq_w[i],
                       "geo_is": geo_w[i], "geo_mask": geo_keep[i],
                       "mis": p if cfg.mis_low <= p <= cfg.mis_high else 0.0}[cfg.correction]
    return rho, w


def reference(logp, old, mu, mask, adv, cfg: TrainerConfig, ref=None):
    """Loss value, d loss / d logp and the dual-clip token count, element by element, in float64."""
    n, t = len(logp), len(logp[0])
    eps, c = cfg.clip_eps, cfg.dual_clip
    _, weights = ref_weights(old, mu, mask, cfg)
    per_tok, grad = [[0.0] * t for _ in range(n)], [[0.0] * t for _ in range(n)]
    dual_tokens = 0
    for i in range(n):
        for j in range(t):
            if not mask[i][j]:
                continue
            w = weights[i][j]
            base = mu[i][j] if cfg.correction == "ppo_is" else old[i][j]
            r = math.exp(logp[i][j] - base)
            a = adv[i]
            unclipped, clipped = r * a, min(max(r, 1 - eps), 1 + eps) * a
            surrogate = min(unclipped, clipped)
            # d/dlogp: the unclipped branch is active when it is the min (ties included: both agree).
            grad[i][j] = -w * a * r if unclipped <= clipped else 0.0
            if c > 0 and a < 0 and c * a > surrogate:  # dual clip: held at c·A, no gradient
                surrogate, grad[i][j] = c * a, 0.0
                dual_tokens += 1
            per_tok[i][j] = -w * surrogate
            if ref is not None and cfg.kl_coef > 0:
                d = ref[i][j] - logp[i][j]
                if cfg.kl_estimator == "k1":  # value x, gradient x·∇logp (score function)
                    per_tok[i][j] += cfg.kl_coef * (logp[i][j] - ref[i][j])
                    grad[i][j] += cfg.kl_coef * (logp[i][j] - ref[i][j])
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
    return loss, g, dual_tokens


def random_inputs(seed: int, n: int = 5, t: int = 7, spread: float = 0.25):
    """`spread`: std of log π_θ − log π_old; 1.5 puts many ratios past the dual-clip bound 3."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    mu = old + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    logp = old + spread * torch.randn(n, t, generator=gen, dtype=torch.float64)
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
    want, want_grad, dual_tokens = reference(logp.tolist(), old.tolist(), mu.tolist(), mask.tolist(), adv.tolist(),
                                             cfg, ref.tolist() if ref is not None else None)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert stats["dual_clip_tokens"].item() == dual_tokens
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert torch.all(x.grad[mask == 0] == 0), "a masked token received gradient"
    return loss, stats


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_grad_match_float64_reference(mode, aggregation):
    for seed in range(3):
        cfg = TrainerConfig(correction=mode, aggregation=aggregation, is_cap=1.5, mis_low=0.8, mis_high=1.25)
        check(cfg, *random_inputs(seed)[:5])


@pytest.mark.parametrize("mode", MODES)
def test_dual_clip_bounds_negative_advantage_tokens_in_every_mode(mode):
    """Far-off-policy ratios (minibatch / epoch steps): for A < 0 the objective stops at c·A."""
    logp, old, mu, mask, adv, _ = random_inputs(4, n=8, t=9, spread=1.5)
    adv[:4] = -adv[:4].abs()  # both signs present
    on = check(TrainerConfig(correction=mode, dual_clip=3.0), logp, old, mu, mask, adv)
    off = check(TrainerConfig(correction=mode, dual_clip=0.0), logp, old, mu, mask, adv)
    assert on[1]["dual_clip_tokens"].item() > 0 and off[1]["dual_clip_tokens"].item() == 0
    assert on[0].item() < off[0].item()  # bounding a negative objective lowers the loss


def test_dual_clip_tie_and_positive_advantage():
    """r = c exactly with A < 0 is not dual-clipped; A > 0 is never bounded, however large r is."""
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.log(torch.tensor([[3.0, 5.0], [5.0, 50.0]], dtype=torch.float64))
    cfg = TrainerConfig(correction="none", dual_clip=float(logp[0, 0].exp()))  # r == c to the last bit
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    _, stats = check(cfg, logp, old, old.clone(), torch.ones(2, 2, dtype=torch.float64), adv)
    assert stats["dual_clip_tokens"].item() == 1  # only r = 5 with A = −1


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("mode", ["none", "tis"])
def test_kl_penalty_matches_reference(mode, estimator):
    cfg = TrainerConfig(correction=mode, kl_coef=0.1, kl_estimator=estimator)
    check(cfg, *random_inputs(7))



def kl_gradients(estimator: str, seed: int, n: int = 3, v: int = 7) -> dict[str, torch.Tensor]:
    """On n softmaxes over v tokens, in float64: E_{y~π_θ}[∇_θ kl_penalty] exactly (every token enumerated and
    weighted by π_θ(y), detached: no Monte-Carlo), E[value], and the exact KLs both ways with their gradients."""
    gen = torch.Generator().manual_seed(seed)
    theta = (1.5 * torch.randn(n, v, generator=gen, dtype=torch.float64)).requires_grad_(True)
    ref = torch.log_softmax(1.5 * torch.randn(n, v, generator=gen, dtype=torch.float64), dim=-1)
    logp = torch.log_softmax(theta, dim=-1)
    kl = {"KL(π_θ ‖ π_ref)": (logp.exp() * (logp - ref)).sum(), "KL(π_ref ‖ π_θ)": (ref.exp() * (ref - logp)).sum()}
    expected = (logp.exp().detach() * kl_penalty(logp, ref, estimator)).sum()
    out = {name: torch.autograd.grad(value, theta, retain_graph=True)[0] for name, value in kl.items()}
    return {**out, "estimate": torch.autograd.grad(expected, theta)[0], "value": expected.detach(),
            "kl": kl["KL(π_θ ‖ π_ref)"].detach()}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("estimator, named, other", [("k1", "KL(π_θ ‖ π_ref)", "KL(π_ref ‖ π_θ)"),
                                                      ("k3", "KL(π_ref ‖ π_θ)", "KL(π_θ ‖ π_ref)")])
def test_kl_estimator_expected_gradient_is_the_kl_its_docstring_names(estimator, named, other, seed):
    """k1's expected gradient is ∇KL(π_θ ‖ π_ref) (not zero, as ∇(logp − ref) alone is); k3's is the reverse
    ∇KL(π_ref ‖ π_θ); both values are unbiased for KL(π_θ ‖ π_ref)."""
    assert f"{estimator}: ∇{named}" in kl_penalty.__doc__
    g = kl_gradients(estimator, seed)
    torch.testing.assert_close(g["estimate"], g[named], rtol=1e-10, atol=1e-12)
    assert (g["estimate"] - g[other]).abs().max() > 1e-2  # the two directions are told apart
    assert g["value"].item() == pytest.approx(g["kl"].item(), rel=1e-12)

@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_is_zero_with_zero_gradient_at_the_reference(estimator):
    ref = torch.log_softmax(torch.randn(2, 5, dtype=torch.float64), dim=-1)
    logp = ref.clone().requires_grad_(True)
    kl = kl_penalty(logp, ref, estimator)
    kl.sum().backward()
    assert torch.count_nonzero(kl) == 0 and torch.count_nonzero(logp.grad) == 0

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


def test_seq_is_clamps_only_the_summed_log_ratio():
    """Token log-ratios 15, 15, −25 sum to 5: the weight is e^5. Clamping each token to ±20 first
    would give e^10; a sum beyond 20 is clamped to e^20."""
    old = torch.tensor([[15.0, 15.0, -25.0], [15.0, 15.0, 0.0]], dtype=torch.float64)
    mu = torch.zeros_like(old)
    mask = torch.ones_like(old)
    w, hit = is_weights(old, mu, mask, TrainerConfig(correction="seq_is", is_cap=1e12))
    torch.testing.assert_close(w[:, 0], torch.tensor([math.exp(5.0), math.exp(20.0)], dtype=torch.float64))
    assert not hit.any()
    _, ref_w = ref_weights(old.tolist(), mu.tolist(), mask.tolist(), TrainerConfig(correction="seq_is", is_cap=1e12))
    torch.testing.assert_close(w, torch.tensor(ref_w, dtype=torch.float64))


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
    m = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, mu, mask, TrainerConfig()).items()})
    assert m["mismatch_max"] == pytest.approx(0.25)  # the masked token's 0.7 gap is ignored
    assert m["mismatch_resp_max"] == pytest.approx((0.25 + 0.0) / 2)
    assert m["mismatch_resp_mean"] == pytest.approx((0.125 + 0.0) / 2)
    assert m["kl_sampler_learner"] == pytest.approx(math.log(0.5) / 5)
    rho = [2.0, 1.0, 1.0, 1.0, 1.0]
    assert m["is_ess_raw"] == pytest.approx(sum(rho) ** 2 / (5 * sum(x * x for x in rho)))
    same = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, old, mask, TrainerConfig()).items()})
    assert same["is_ess"] == same["is_ess_raw"] == pytest.approx(1.0) and same["mismatch_max"] == 0.0


def ref_split(old, mu, mask, versions, current_version) -> dict[str, float]:
    """The split mismatch metrics by definition, in plain Python loops over a [N, T] batch."""
    out = {}
    for part, keep in (("cur", lambda v: v == current_version), ("stale", lambda v: v != current_version)):
        per_resp, kl, n_tok, top = [], 0.0, 0, 0.0
        for i in range(len(old)):
            gaps = [abs(math.exp(old[i][j]) - math.exp(mu[i][j])) for j in range(len(old[0]))
                    if mask[i][j] and keep(versions[i][j])]
            kl += sum(mu[i][j] - old[i][j] for j in range(len(old[0])) if mask[i][j] and keep(versions[i][j]))
            n_tok += len(gaps)
            if gaps:
                per_resp.append((max(gaps), sum(gaps) / len(gaps)))
                top = max(top, max(gaps))
        total = sum(1 for row in mask for m in row if m)
        out.update({f"mismatch_{part}_resp_max": sum(a for a, _ in per_resp) / max(len(per_resp), 1),
                    f"mismatch_{part}_resp_mean": sum(b for _, b in per_resp) / max(len(per_resp), 1),
                    f"mismatch_{part}_max": top, f"kl_sampler_learner_{part}": kl / max(n_tok, 1),
                    f"mismatch_{part}_frac": n_tok / total})
    return out


SPLIT_OLD = [[0.5, 0.9, 0.2, 0.6], [0.4, 0.4, 0.4, 0.3], [0.7, 0.1, 0.5, 0.5]]
SPLIT_MU = [[0.25, 0.9, 0.9, 0.5], [0.4, 0.2, 0.4, 0.3], [0.7, 0.3, 0.5, 0.5]]
SPLIT_MASK = [[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
SPLIT_VERSIONS = [[3, 3, 3, 2], [2, 2, 3, -1], [1, 1, -1, -1]]  # π_old is version 3


def split_batch():
    f = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    return f(SPLIT_OLD).log(), f(SPLIT_MU).log(), f(SPLIT_MASK), torch.tensor(SPLIT_VERSIONS)


def test_mismatch_split_into_current_and_stale_tokens_by_hand():
    """Tokens of π_old's own version (3) and stale ones (1, 2) get their own gap metrics; the
    whole-batch ones stay as they were."""
    old, mu, mask, ver = split_batch()
    sums = mismatch_sums(old, mu, mask, TrainerConfig(), current=ver == 3)
    m = finalize_mismatch({k: v.item() for k, v in sums.items()})
    whole = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, mu, mask, TrainerConfig()).items()})
    assert all(m[k] == whole[k] for k in whole)
    ref = ref_split(old.tolist(), mu.tolist(), SPLIT_MASK, SPLIT_VERSIONS, 3)
    assert set(ref) <= set(m)
    for k, v in ref.items():
        assert m[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # by hand: current tokens (0,0) gap .25, (0,1) 0, (1,2) 0 (row 1's masked-out (1,3) has version -1)
    assert m["mismatch_cur_max"] == pytest.approx(0.25) and m["mismatch_cur_frac"] == pytest.approx(3 / 8)
    assert m["mismatch_cur_resp_mean"] == pytest.approx((0.125 + 0.0) / 2)
    assert m["kl_sampler_learner_cur"] == pytest.approx(math.log(0.5) / 3)
    # stale: (0,3) .1, (1,0) 0, (1,1) .2, (2,0) 0, (2,1) .2; the masked (0,2) gap .7 is ignored
    assert m["mismatch_stale_max"] == pytest.approx(0.2) and m["mismatch_stale_frac"] == pytest.approx(5 / 8)
    assert m["mismatch_stale_resp_max"] == pytest.approx((0.1 + 0.2 + 0.2) / 3)
    assert m["mismatch_stale_resp_mean"] == pytest.approx((0.1 + 0.1 + 0.1) / 3)
    assert m["kl_sampler_learner_stale"] == pytest.approx((math.log(5 / 6) + math.log(0.5) + math.log(3)) / 5)


def test_mismatch_split_with_no_stale_tokens_reports_zero_share():
    old, mu, mask, _ = split_batch()
    m = finalize_mismatch({k: v.item() for k, v in mismatch_sums(
        old, mu, mask, TrainerConfig(), current=torch.ones_like(mask, dtype=torch.bool)).items()})
    assert m["mismatch_stale_frac"] == 0.0 and m["mismatch_stale_max"] == 0.0 and m["mismatch_cur_frac"] == 1.0
    assert m["mismatch_cur_resp_mean"] == pytest.approx(m["mismatch_resp_mean"], rel=1e-12)


def _split_on_two_ranks(rank: int, init: str, out: str) -> None:
    """One of two gloo ranks: this rank's rows of the split batch, reduced by Parallel.all_reduce."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        old, mu, mask, ver = split_batch()
        rows = slice(0, 1) if rank == 0 else slice(1, 3)  # uneven shards: 1 row and 2 rows
        sums = mismatch_sums(old[rows], mu[rows], mask[rows], TrainerConfig(), current=ver[rows] == 3)
        maxes = {k: sums.pop(k) for k in MAX_KEYS}
        red = Parallel(TrainerConfig(), rank, 2).all_reduce(sums, maxes)
        if rank == 0:
            torch.save(finalize_mismatch(red), out)
    finally:
        dist.destroy_process_group()


def test_mismatch_split_all_reduced_over_two_ranks_equals_one_rank(tmp_path):
    """SUM of the sums and MAX of the maxes over two gloo ranks give the metrics of the whole batch."""
    out = str(tmp_path / "m.pt")
    mp.spawn(_split_on_two_ranks, args=(f"file://{tmp_path / 'rdzv'}", out), nprocs=2, join=True)
    old, mu, mask, ver = split_batch()
    want = finalize_mismatch({k: v.item() for k, v in mismatch_sums(
        old, mu, mask, TrainerConfig(), current=ver == 3).items()})
    got = torch.load(out)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def ref_ess(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


@pytest.mark.parametrize("mode", MODES)
def test_is_ess_is_reported_on_raw_ratios_and_on_the_applied_weights(mode):
    _, old, mu, mask, _, _ = random_inputs(9, n=6, t=8)
    mu = old + 0.8 * (mu - old) / 0.3  # wide enough for truncation and masking to act
    cfg = TrainerConfig(correction=mode, is_cap=1.5, mis_low=0.7, mis_high=1.4)
    m = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, mu, mask, cfg).items()})
    rho, w = ref_weights(old.tolist(), mu.tolist(), mask.tolist(), cfg)
    on = [(i, j) for i in range(len(rho)) for j in range(len(rho[0])) if mask[i, j]]
    assert m["is_ess_raw"] == pytest.approx(ref_ess([rho[i][j] for i, j in on]), rel=1e-12)
    assert m["is_ess"] == pytest.approx(ref_ess([w[i][j] for i, j in on]), rel=1e-12)
    if mode in ("none", "ppo_is"):
        assert m["is_ess"] == 1.0
    elif mode in ("tis", "mis", "seq_is"):
        assert m["is_ess"] != pytest.approx(m["is_ess_raw"])  # truncation / masking shows


def test_is_ess_is_zero_when_masked_is_drops_every_token():
    old = torch.zeros(1, 3, dtype=torch.float64)
    m = finalize_mismatch({k: v.item() for k, v in mismatch_sums(
        old, old - 2.0, torch.ones(1, 3, dtype=torch.float64), TrainerConfig(correction="mis")).items()})
    assert m["is_ess"] == 0.0 and m["is_ess_raw"] == pytest.approx(1.0)


@pytest.mark.parametrize("versions", [2, 3])
def test_mis_balance_weights_match_a_float64_reference(versions):
    """Constructed batch: samples from J versions with counts n_j; each sample's weight is
    π_old(y) / Σ_j (n_j/n) q_j(y), computed here from per-token probabilities by definition."""
    from pipeline.losses import balance_log_mixture

    g = torch.Generator().manual_seed(versions)
    n, t = 7, 6
    counts = [4, 3] if versions == 2 else [3, 2, 2]
    own = [j for j, c in enumerate(counts) for _ in range(c)]
    mask = (torch.rand(n, t, generator=g) > 0.2).double()
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    tok_q = [-torch.rand(n, t, generator=g, dtype=torch.float64) * 2 for _ in counts]  # log q_j per token
    mu = torch.stack([tok_q[own[i]][i] for i in range(n)])  # the sampler's own version's logprobs
    cfg = TrainerConfig(correction="mis_balance", is_cap=50.0)
    logq = torch.stack([(q * mask).sum(1) for q in tok_q], dim=1)
    w, _ = is_weights(old, mu, mask, cfg, balance_log_mixture(logq, torch.tensor(counts)))
    for i in range(n):
        p = math.prod(math.exp(old[i, k].item()) for k in range(t) if mask[i, k])
        den = sum(counts[j] / n * math.prod(math.exp(tok_q[j][i, k].item()) for k in range(t) if mask[i, k])
                  for j in range(len(counts)))
        expect = min(p / den, cfg.is_cap)
        for k in range(t):
            assert w[i, k].item() == pytest.approx(expect if mask[i, k] else w[i, k].item(), rel=1e-9)
    # one version: the balance heuristic is sequence IS
    one = balance_log_mixture((mu * mask).sum(1, keepdim=True), torch.tensor([n]))
    seq = is_weights(old, mu, mask, TrainerConfig(correction="seq_is", is_cap=50.0))[0]
    assert torch.allclose(is_weights(old, mu, mask, cfg, one)[0], seq)
    with pytest.raises(ValueError, match="log_mix"):
        is_weights(old, mu, mask, cfg)


def test_geo_is_is_the_truncated_geometric_mean_of_a_sequences_ratios():
    """geo_is: (π_old(y)/μ(y))^(1/|y|), the length-normalised ratio GSPO's s_i is, truncated at C."""
    old = torch.zeros(2, 4, dtype=torch.float64)
    mu = -torch.log(torch.tensor([[0.5, 1.0, 3.0, 10.0], [4.0, 4.0, 4.0, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    w, hit = is_weights(old, mu, mask, TrainerConfig(correction="geo_is", is_cap=2.0))
    torch.testing.assert_close(w[:, 0], torch.tensor([15.0 ** 0.25, 2.0], dtype=torch.float64))  # 64^(1/3) = 4 -> 2
    assert hit.tolist() == [[False] * 4, [True, True, True, False]]


def test_geo_mask_keeps_or_drops_whole_sequences_by_their_geometric_mean_ratio():
    """geo_mask, a part added as one CORRECTIONS entry: w = 1 on every token of a sequence whose
    (π_old(y)/μ(y))^(1/|y|) lies in [mis_low, mis_high], 0 on all of one outside; dropped tokens counted."""
    old = torch.zeros(3, 4, dtype=torch.float64)
    ratios = torch.tensor([[0.5, 1.0, 3.0, 10.0], [4.0, 4.0, 4.0, 1.0], [0.5, 0.5, 1.0, 1.0]], dtype=torch.float64)
    mu = -torch.log(ratios)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    g = [15.0 ** 0.25, 4.0, 0.5]  # the geometric means over each sequence's loss tokens
    cfg = TrainerConfig(correction="geo_mask", mis_low=0.6, mis_high=3.0)
    w, hit = is_weights(old, mu, mask, cfg)
    keep = [1.0 if cfg.mis_low <= x <= cfg.mis_high else 0.0 for x in g]
    assert keep == [1.0, 0.0, 0.0]
    torch.testing.assert_close(w, torch.tensor(keep, dtype=torch.float64)[:, None].expand(3, 4))
    assert hit.tolist() == [[False] * 4, [True, True, True, False], [True, True, False, False]]


def test_geo_is_weights_do_not_shrink_with_length_where_seq_is_does():
    """Tokens from μ with a per-token log-ratio spread of 0.05 (E_μ[π_old/μ] = 1 per token): seq_is's
    truncated product falls with length (0.95 / 0.60 / 0.16 at 100 / 1,000 / 4,000 tokens, cap 2); the
    geometric mean stays at 1."""
    g = torch.Generator().manual_seed(0)
    means = {}
    for n in (100, 1000, 4000):
        x = 0.05 * torch.randn(400, n, generator=g, dtype=torch.float64) - 0.05 ** 2 / 2  # log π_old − log μ
        mask = torch.ones_like(x)
        means[n] = [is_weights(x, torch.zeros_like(x), mask, TrainerConfig(correction=c, is_cap=2.0))[0][:, 0].mean().item()
                    for c in ("seq_is", "geo_is")]
    assert [means[n][0] for n in (100, 1000, 4000)] == pytest.approx([0.95, 0.60, 0.16], abs=0.02)
    assert all(means[n][1] == pytest.approx(1.0, abs=2e-3) for n in means)


def test_is_ess_by_response_length_by_hand():
    """is_ess_len{lo}_{hi}: the ESS of the applied weights over the tokens of responses whose loss-token
    count falls in [lo, hi] (buckets 0-127, 128-511, 512-2047, 2048 on); absent for a bucket without any."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 130, 140, 600]
    t = max(lengths)
    old = -torch.rand(len(lengths), t, generator=g, dtype=torch.float64)
    mu = old + 0.3 * torch.randn(len(lengths), t, generator=g, dtype=torch.float64)
    mask = torch.zeros_like(old)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    cfg = TrainerConfig(correction="tis", is_cap=1.5)
    m = finalize_mismatch({k: v.item() for k, v in mismatch_sums(old, mu, mask, cfg).items()})
    _, w = ref_weights(old.tolist(), mu.tolist(), mask.tolist(), cfg)
    rows = {"0_127": [0], "128_511": [1, 2], "512_2047": [3]}
    for name, idx in rows.items():
        want = ref_ess([w[i][j] for i in idx for j in range(lengths[i])])
        assert m[f"is_ess_len{name}"] == pytest.approx(want, rel=1e-12), name
    assert "is_ess_len2048_" not in m


def test_the_parts_own_batch_metrics_are_logged_for_the_parts_in_use():
    """cispo_clip_frac with weight_form=cispo, seq_ratio_* with ratio_level=sequence (STEP_METRICS), the
    mean over the batch's optimizer steps of each step's value; none for a part without metrics."""
    from pipeline.loss_parts import loss_spec, step_metrics
    steps = [{"clip_tokens": 3.0, "tokens": 10.0, "seq_ratio_n": 2.0, "seq_ratio_sum": 2.2, "seq_ratio_sq_sum": 2.5,
              "seq_clip_seqs": 1.0},
             {"clip_tokens": 1.0, "tokens": 4.0, "seq_ratio_n": 1.0, "seq_ratio_sum": 0.9, "seq_ratio_sq_sum": 0.81,
              "seq_clip_seqs": 0.0}]
    assert step_metrics(loss_spec(TrainerConfig()), steps) == {}
    assert step_metrics(loss_spec(TrainerConfig(recipe="cispo")), steps) == {"cispo_clip_frac": (0.3 + 0.25) / 2}
    m = step_metrics(loss_spec(TrainerConfig(recipe="gspo", correction="geo_is")), steps)
    assert m["seq_ratio_mean"] == pytest.approx((1.1 + 0.9) / 2)
    assert m["seq_ratio_std"] == pytest.approx((math.sqrt(1.25 - 1.21) + 0.0) / 2)
    assert m["seq_clip_frac"] == pytest.approx(0.25)
