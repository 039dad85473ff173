"""The loss recipes (trainer.recipe: grpo, dapo, dr_grpo, gspo, cispo) against their papers' objectives,
each transcribed here directly from the paper in float64, independently of pipeline/losses.py: the loss
value and its gradient wrt the log-probs on small random batches with masks; micro-batches and two gloo
ranks giving the one-batch result (global denominators); how the off-policy corrections compose; the
presets, an explicit key over a preset, refused combinations, and the CLI's exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.advantages import overlong_penalty
from pipeline.config import ConfigError, TrainerConfig, load_config
from pipeline.losses import is_weights, local_denominators, policy_loss

from .conftest import REPO

N, T, MAX_LEN = 6, 7, 9  # T: the shifted [N, T-1]-layout width; MAX_LEN: generator.max_new_tokens


def batch(seed: int = 0, spread: float = 0.15):
    """logp (leaf, float64), old, mu, mask (every row has a loss token, some rows short), advantages."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logp + spread * torch.randn(N, T, generator=g, dtype=torch.float64)
    mu = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(N, T, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    mask[1, 3:] = 0.0  # a short response
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logp.requires_grad_(True), old, mu, mask, adv


def cfg(recipe: str, **kw) -> TrainerConfig:
    return TrainerConfig(recipe=recipe, correction=kw.pop("correction", "none"), kl_coef=0.0, **kw)


# --------------------------------------------------------------- the papers, transcribed (J: maximised)

def clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def grpo_J(logp, old, mask, adv, eps=0.2):
    """GRPO (Shao et al. 2024, eq. 3 without the KL term): 1/G Σ_i 1/|o_i| Σ_t min(r A, clip(r, 1±ε) A)."""
    J = 0.0
    for i in range(N):
        terms = []
        for t in range(T):
            if mask[i, t]:
                r = torch.exp(logp[i, t] - old[i, t])
                terms.append(torch.minimum(r * adv[i], clip(r, 1 - eps, 1 + eps) * adv[i]))
        J = J + sum(terms) / len(terms)
    return J / N


def dapo_J(logp, old, mask, adv, lo=0.2, hi=0.28):
    """DAPO (Yu et al. 2025, eq. 8): 1/Σ_i|o_i| Σ_i Σ_t min(r A, clip(r, 1 − ε_low, 1 + ε_high) A)."""
    J, n = 0.0, 0
    for i in range(N):
        for t in range(T):
            if mask[i, t]:
                r = torch.exp(logp[i, t] - old[i, t])
                J = J + torch.minimum(r * adv[i], clip(r, 1 - lo, 1 + hi) * adv[i])
                n += 1
    return J / n


def dr_grpo_J(logp, old, mask, adv, eps=0.2, max_len=MAX_LEN):
    """Dr. GRPO (Liu et al. 2025, eq. in §3.2): GRPO without 1/|o_i| (the implementation's constant
    normaliser: the generation budget) and without the std (that part lives in the advantages)."""
    J = 0.0
    for i in range(N):
        for t in range(T):
            if mask[i, t]:
                r = torch.exp(logp[i, t] - old[i, t])
                J = J + torch.minimum(r * adv[i], clip(r, 1 - eps, 1 + eps) * adv[i])
    return J / (N * max_len)


def gspo_J(logp, old, mask, adv, lo=3e-4, hi=4e-4, seq_w=None):
    """GSPO (Zheng et al. 2025, eqs. 5-7): s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|);
    J = 1/G Σ_i min(s_i A_i, clip(s_i, 1 − ε_l, 1 + ε_r) A_i). Differentiated through s_i itself."""
    J = 0.0
    for i in range(N):
        idx = mask[i] > 0
        s = torch.exp((logp[i][idx].sum() - old[i][idx].sum()) / idx.sum())
        term = torch.minimum(s * adv[i], clip(s, 1 - lo, 1 + hi) * adv[i])
        J = J + (term if seq_w is None else seq_w[i] * term)
    return J / N


def cispo_J(logp, old, mask, adv, lo=1.0, hi=0.28):
    """CISPO (MiniMax-M1 2025, eqs. 4-5): 1/Σ_i|o_i| Σ_i Σ_t sg(clip(r, 1 − ε_low, 1 + ε_high)) A log π_θ."""
    J, n = 0.0, 0
    for i in range(N):
        for t in range(T):
            if mask[i, t]:
                r = torch.exp(logp[i, t] - old[i, t]).detach()
                J = J + clip(r, 1 - lo, 1 + hi) * adv[i] * logp[i, t]
                n += 1
    return J / n


PAPERS = {
    "grpo": lambda lp, o, m, a: grpo_J(lp, o, m, a),
    "dapo": lambda lp, o, m, a: dapo_J(lp, o, m, a),
    "dr_grpo": lambda lp, o, m, a: dr_grpo_J(lp, o, m, a),
    "gspo": lambda lp, o, m, a: gspo_J(lp, o, m, a),
    "cispo": lambda lp, o, m, a: cispo_J(lp, o, m, a),
}


def ours(c: TrainerConfig, logp, old, mu, mask, adv, rows=None, log_mix=None):
    rows = slice(None) if rows is None else rows
    return policy_loss(logp[rows], old[rows], mu[rows], mask[rows], adv[rows], c,
                       denominators=local_denominators(mask), max_len=MAX_LEN, log_mix=log_mix)


def value_and_grad(f, logp):
    logp.grad = None
    v = f()
    v.backward()
    g, logp.grad = logp.grad.clone(), None
    return v.detach(), g


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("recipe", list(PAPERS))
def test_recipe_matches_its_paper_in_float64(recipe, seed):
    logp, old, mu, mask, adv = batch(seed)
    want_v, want_g = value_and_grad(lambda: -PAPERS[recipe](logp, old, mask, adv), logp)
    got_v, got_g = value_and_grad(lambda: ours(cfg(recipe), logp, old, mu, mask, adv)[0], logp)
    assert got_v.item() == pytest.approx(want_v.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-13)
    assert want_g.abs().sum() > 0


@pytest.mark.parametrize("lo,hi", [(0.01, 0.015), (0.05, 0.1)])
def test_gspo_with_a_wider_clip_range_matches_the_paper(lo, hi):
    """The preset's 3e-4 / 4e-4 clips nearly every sequence of a random batch; wider ranges leave some
    inside, where the gradient is GSPO's s_i/|y_i| · A_i per token (the token form's job)."""
    logp, old, mu, mask, adv = batch(3, spread=0.05)
    c = cfg("gspo", clip_eps_low=lo, clip_eps_high=hi)
    want_v, want_g = value_and_grad(lambda: -gspo_J(logp, old, mask, adv, lo, hi), logp)
    got_v, got_g = value_and_grad(lambda: ours(c, logp, old, mu, mask, adv)[0], logp)
    stats = ours(c, logp, old, mu, mask, adv)[1]
    assert stats["seq_clip_seqs"] < N and (lo > 0.01 or stats["seq_clip_seqs"] > 0)  # both branches exercised
    assert got_v.item() == pytest.approx(want_v.item(), rel=1e-12)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("recipe", list(PAPERS))
def test_micro_batches_give_the_one_batch_loss_and_gradient(recipe):
    logp, old, mu, mask, adv = batch(5)
    c = cfg(recipe, clip_eps_low=0.05, clip_eps_high=0.1) if recipe == "gspo" else cfg(recipe)
    one_v, one_g = value_and_grad(lambda: ours(c, logp, old, mu, mask, adv)[0], logp)
    parts = [slice(0, 1), slice(1, 4), slice(4, N)]
    many_v, many_g = value_and_grad(lambda: sum(ours(c, logp, old, mu, mask, adv, rows=r)[0] for r in parts), logp)
    assert many_v.item() == pytest.approx(one_v.item(), rel=1e-12)
    torch.testing.assert_close(many_g, one_g, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------- off-policy corrections with each recipe

TOKEN_CORRECTIONS = ("tis", "vanilla_is", "mis", "icepop", "ppo_is")


@pytest.mark.parametrize("correction", TOKEN_CORRECTIONS)
@pytest.mark.parametrize("recipe", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_token_level_recipes_compose_with_every_correction(recipe, correction):
    """The correction's weight w_t multiplies each token's term; ppo_is anchors the ratio at μ instead."""
    logp, old, mu, mask, adv = batch(7)
    c = cfg(recipe, correction=correction)
    rho = torch.exp(old - mu)
    w = {"tis": rho.clamp(max=c.is_cap), "vanilla_is": rho, "ppo_is": torch.ones_like(rho),
         "mis": rho * ((rho >= 0.5) & (rho <= 2.0)), "icepop": rho * ((rho >= 0.5) & (rho <= 5.0))}[correction]
    base = mu if correction == "ppo_is" else old
    lo, hi = c.clip_eps_low, c.clip_eps_high
    norm = {"grpo": None, "dapo": mask.sum(), "dr_grpo": N * MAX_LEN, "cispo": mask.sum()}[recipe]
    want_v, want_g = value_and_grad(lambda: _rebuild(logp, base, adv, w, mask, recipe, lo, hi, norm), logp)
    got_v, got_g = value_and_grad(lambda: ours(c, logp, old, mu, mask, adv)[0], logp)
    assert got_v.item() == pytest.approx(want_v.item(), rel=1e-12)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_at_one_minibatch_cispo_is_ppo_and_gspo_is_grpo(correction):
    """With one minibatch and one epoch π_θ = π_old when the loss is taken (ratio 1; the real-model recipe
    trains so): CISPO's gradient is the default PPO loss's (both token_mean, A·∇log π per token), and
    GSPO's is GRPO's (both seq_mean, s_i = 1). Their clip parts act only from a second minibatch on: what
    docs/training.md's comparison on the real model says of them."""
    logp, old, mu, mask, adv = batch(3)
    at_old = logp.detach().clone().requires_grad_(True)
    # a per-token weight (tis) is refused on a sequence ratio: GSPO then runs at the token level
    gspo = cfg("gspo", correction=correction, **({"ratio_level": "token"} if correction == "tis" else {}))
    pairs = [(cfg("none", correction=correction), cfg("cispo", correction=correction)),
             (cfg("grpo", correction=correction), gspo)]
    for a, b in pairs:
        _, ga = value_and_grad(lambda: ours(a, at_old, logp.detach(), mu, mask, adv)[0], at_old)
        _, gb = value_and_grad(lambda: ours(b, at_old, logp.detach(), mu, mask, adv)[0], at_old)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-15)
        assert ga.abs().max() > 1e-3
    # from a second minibatch on (π_θ moved away from π_old) they differ
    _, ga = value_and_grad(lambda: ours(pairs[0][0], logp, old, mu, mask, adv)[0], logp)
    _, gb = value_and_grad(lambda: ours(pairs[0][1], logp, old, mu, mask, adv)[0], logp)
    assert (ga - gb).abs().max() > 1e-4


def _rebuild(logp, base, adv, w, mask, recipe, lo, hi, norm):
    """The composed reference, rebuilt from logp so autograd sees a fresh graph each call."""
    r = torch.exp(logp - base)
    if recipe == "cispo":
        term = clip(r, 1 - lo, 1 + hi).detach() * adv[:, None] * logp
    else:
        term = torch.minimum(r * adv[:, None], clip(r, 1 - lo, 1 + hi) * adv[:, None])
    term = w * term * mask
    if norm is None:
        return -(term.sum(dim=1) / mask.sum(dim=1)).mean()
    return -term.sum() / norm


def test_gspo_composes_with_geometric_is_and_ppo_is():
    """geo_is: one truncated weight per sequence on GSPO's term, the length-normalised sampler ratio
    (π_old(y)/μ(y))^(1/|y|) that matches s_i's; ppo_is: s_i anchored at the sampler."""
    logp, old, mu, mask, adv = batch(8, spread=0.05)
    kw = {"clip_eps_low": 0.05, "clip_eps_high": 0.1}
    c = cfg("gspo", correction="geo_is", **kw)
    seq_w = torch.exp(((old - mu) * mask).sum(dim=1) / mask.sum(dim=1)).clamp(max=c.is_cap)
    want = value_and_grad(lambda: -gspo_J(logp, old, mask, adv, 0.05, 0.1, seq_w=seq_w), logp)
    got = value_and_grad(lambda: ours(c, logp, old, mu, mask, adv)[0], logp)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-13)
    c = cfg("gspo", correction="ppo_is", **kw)
    want = value_and_grad(lambda: -gspo_J(logp, mu, mask, adv, 0.05, 0.1), logp)
    got = value_and_grad(lambda: ours(c, logp, old, mu, mask, adv)[0], logp)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("correction", ["tis", "vanilla_is", "mis", "icepop"])
def test_sequence_ratio_refuses_token_level_corrections(correction):
    with pytest.raises(ConfigError, match="trainer.correction.*trainer.ratio_level"):
        cfg("gspo", correction=correction)
    with pytest.raises(ConfigError, match="trainer.correction.*trainer.ratio_level"):
        cfg("dapo", ratio_level="sequence", correction=correction)


@pytest.mark.parametrize("correction", ["seq_is", "mis_balance"])
def test_sequence_ratio_refuses_the_unnormalised_sequence_weights(correction):
    """seq_is and mis_balance weigh a sequence by its whole likelihood ratio, a product over its tokens whose
    truncated weight falls with length; GSPO's ratio is length-normalised (geo_is is its correction)."""
    with pytest.raises(ConfigError, match="trainer.correction.*trainer.ratio_level.*geo_is"):
        cfg("gspo", correction=correction)
    assert cfg("gspo", correction="geo_is").correction == "geo_is"


def test_icepop_is_masked_is_with_the_window_half_to_five():
    """IcePop (verl, NeMo-RL): tokens whose π_train/π_infer leaves [0.5, 5] are masked, the rest keep
    the ratio as their weight: today's `mis` exactly, with its window at [0.5, 5]."""
    _, old, mu, mask, _ = batch(9)
    mu = old + torch.linspace(-2.5, 2.5, N * T, dtype=torch.float64).reshape(N, T)
    ice = cfg("none", correction="icepop")
    assert (ice.mis_low, ice.mis_high) == (0.5, 5.0)
    w_ice, drop_ice = is_weights(old, mu, mask, ice)
    w_mis, drop_mis = is_weights(old, mu, mask, cfg("none", correction="mis", mis_low=0.5, mis_high=5.0))
    torch.testing.assert_close(w_ice, w_mis, rtol=0, atol=0)
    assert torch.equal(drop_ice, drop_mis) and drop_ice.any()
    rho = torch.exp(old - mu)
    on = mask > 0
    torch.testing.assert_close(w_ice[on], (rho * ((rho >= 0.5) & (rho <= 5)))[on], rtol=1e-15, atol=0)


# --------------------------------------------------------------- metrics and overlong shaping

def test_clip_fractions_per_side():
    logp, old, mu, mask, adv = batch(10, spread=0.4)
    c = cfg("dapo")
    r = torch.exp(logp - old).detach()
    on = mask > 0
    low = ((adv[:, None] < 0) & (r < 0.8) & on).sum().item()
    high = ((adv[:, None] > 0) & (r > 1.28) & on).sum().item()
    s = ours(c, logp, old, mu, mask, adv)[1]
    assert (s["clip_low_tokens"].item(), s["clip_high_tokens"].item()) == (low, high)
    assert low > 0 and high > 0 and s["clip_tokens"].item() == low + high
    s = ours(cfg("cispo", clip_eps_low=0.2), logp, old, mu, mask, adv)[1]  # any sign: the weight is clipped
    assert s["clip_low_tokens"].item() == ((r < 0.8) & on).sum().item()
    assert s["clip_high_tokens"].item() == ((r > 1.28) & on).sum().item()


def test_dapo_overlong_penalty_is_the_papers_formula():
    """DAPO eq. 13: 0 up to L_max − L_cache, (L_max − L_cache − |y|) / L_cache until L_max, −1 beyond."""
    L, C = 20, 4
    for n in range(0, 25):
        want = 0.0 if n <= L - C else ((L - C) - n) / C if n <= L else -1.0
        assert overlong_penalty(n, L, C, 1.0) == pytest.approx(want)
        assert overlong_penalty(n, L, C, 0.5) == pytest.approx(0.5 * want)
    assert overlong_penalty(25, L, 0, 1.0) == 0.0


# --------------------------------------------------------------- two gloo ranks

def _two_ranks(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        got = {}
        for recipe in ("dapo", "dr_grpo", "gspo", "cispo", "grpo"):
            logp, old, mu, mask, adv = batch(11)
            c = cfg(recipe, clip_eps_low=0.05, clip_eps_high=0.1) if recipe == "gspo" else cfg(recipe)
            rows = slice(0, 2) if rank == 0 else slice(2, N)  # uneven shards
            loss = ours(c, logp, old, mu, mask, adv, rows=rows)[0]
            loss.backward()
            both = torch.cat([loss.detach().reshape(1), logp.grad.reshape(-1)])
            dist.all_reduce(both)
            got[recipe] = both
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_to_one_rank(tmp_path):
    out = str(tmp_path / "g.pt")
    mp.spawn(_two_ranks, args=(f"file://{tmp_path / 'rdzv'}", out), nprocs=2, join=True)
    got = torch.load(out)
    for recipe, both in got.items():
        logp, old, mu, mask, adv = batch(11)
        c = cfg(recipe, clip_eps_low=0.05, clip_eps_high=0.1) if recipe == "gspo" else cfg(recipe)
        v, g = value_and_grad(lambda: ours(c, logp, old, mu, mask, adv)[0], logp)
        assert both[0].item() == pytest.approx(v.item(), rel=1e-12), recipe
        torch.testing.assert_close(both[1:].reshape(N, T), g, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------- config

def test_each_preset_by_name_sets_its_parts():
    want = {
        "grpo": (0.2, 0.2, "token", "ppo", "seq_mean", True, 0, False),
        "dapo": (0.2, 0.28, "token", "ppo", "token_mean", True, 1, True),  # buffer: 8 // 5 of tiny's budget
        "dr_grpo": (0.2, 0.2, "token", "ppo", "constant", False, 0, False),
        "gspo": (3e-4, 4e-4, "sequence", "ppo", "seq_mean", True, 0, False),
        "cispo": (1.0, 0.28, "token", "cispo", "token_mean", True, 0, False),
        "none": (0.2, 0.2, "token", "ppo", "token_mean", True, 0, False),
    }
    for recipe, parts in want.items():
        c = load_config("configs/tiny.yaml", [f"trainer.recipe={recipe}", "trainer.correction=none"])
        t = c.trainer
        assert (t.clip_eps_low, t.clip_eps_high, t.ratio_level, t.weight_form, t.aggregation,
                c.buffer.normalize_std, t.overlong_buffer, t.overlong_filter) == parts, recipe
    assert load_config("configs/tiny.yaml").trainer.dual_clip == 3.0  # no preset: today's loss
    assert load_config("configs/tiny.yaml", ["trainer.recipe=dapo"]).trainer.dual_clip == 0.0


def test_an_explicit_key_wins_over_the_preset():
    c = load_config("configs/tiny.yaml", ["trainer.recipe=dr_grpo", "buffer.normalize_std=true",
                                          "trainer.aggregation=token_mean"])
    assert (c.buffer.normalize_std, c.trainer.aggregation) == (True, "token_mean")
    c = load_config("configs/tiny.yaml", ["trainer.recipe=dapo", "trainer.clip_eps_high=0.3",
                                          "trainer.overlong_filter=false", "trainer.overlong_buffer=3"])
    t = c.trainer
    assert (t.clip_eps_low, t.clip_eps_high, t.overlong_filter, t.overlong_buffer) == (0.2, 0.3, False, 3)
    # an explicit symmetric clip_eps beats the preset's two sides; an explicit side beats clip_eps
    t = load_config("configs/tiny.yaml", ["trainer.recipe=dapo", "trainer.clip_eps=0.1"]).trainer
    assert (t.clip_eps_low, t.clip_eps_high) == (0.1, 0.1)
    t = TrainerConfig(recipe="dapo", clip_eps=0.1, clip_eps_high=0.3)
    assert (t.clip_eps_low, t.clip_eps_high) == (0.1, 0.3)


def test_dapo_preset_turns_dynamic_sampling_on():
    """DAPO samples until its batch holds groups with an accuracy spread: the preset sets
    buffer.zero_signal=drop (group_size > 1); a buffer.zero_signal the config names wins, and the other
    recipes keep the default auto."""
    assert load_config("configs/tiny.yaml", ["trainer.recipe=dapo"]).buffer.zero_signal == "drop"
    for v in ("keep", "auto"):
        assert load_config("configs/tiny.yaml", ["trainer.recipe=dapo", f"buffer.zero_signal={v}"]).buffer.zero_signal == v
    assert load_config("configs/tiny.yaml", ["trainer.recipe=dapo", "buffer.group_size=1"]).buffer.zero_signal == "auto"
    for recipe in ("none", "grpo", "dr_grpo", "cispo"):
        assert load_config("configs/tiny.yaml", [f"trainer.recipe={recipe}"]).buffer.zero_signal == "auto", recipe


@pytest.mark.parametrize("overrides,keys", [
    (["trainer.recipe=gspo"], ("trainer.correction", "trainer.ratio_level")),  # tiny.yaml: correction=tis
    (["trainer.recipe=gspo", "trainer.correction=seq_is"], ("trainer.correction", "trainer.ratio_level", "geo_is")),
    (["trainer.recipe=cispo", "trainer.ratio_level=sequence", "trainer.correction=none"],
     ("trainer.weight_form", "trainer.ratio_level")),
    (["trainer.recipe=dapo", "trainer.overlong_buffer=8"], ("trainer.overlong_buffer", "generator.max_new_tokens")),
    (["trainer.recipe=paper"], ("trainer.recipe",)),
])
def test_invalid_combination_names_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    for k in keys:
        assert k in str(e.value)


def test_cli_exits_2_on_an_invalid_recipe_combination():
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "trainer.recipe=gspo"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "trainer.correction" in p.stderr and "trainer.ratio_level" in p.stderr
