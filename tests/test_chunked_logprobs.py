"""The chunked loss head (pipeline/trainer/chunked.py, trainer.logprob_chunk_tokens) against the
unchunked one on the tiny model, in float32: log-probs, entropy and the gradients wrt every
parameter through the whole loss, for every loss and off-policy correction (PPO-clip token_mean /
seq_mean, the dual clip, none / tis / seq_is / mis / mis_balance / ppo_is / vanilla_is, the entropy
bonus, the k1 / k3 KL to a reference), a tied and an untied head, chunk sizes that do and do not
divide the token count; then TrainCore's step (π_old, the entropy metric, the KL reference, LoRA)
and two FSDP2 ranks on gloo. "Equal" is torch.testing.assert_close(rtol=1e-6, atol=1e-6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.config import Config, GeneratorConfig, LoraConfig, ModelConfig, TrainerConfig
from pipeline.config.errors import ConfigError
from pipeline.losses import balance_log_mixture, policy_loss, token_entropy
from pipeline.models.hf import build_model, model_dir, token_logprobs
from pipeline.trainer.chunked import chunkable, logprobs
from pipeline.trainer.step import TrainCore
from tests.test_trainer_core import make_batch

TOL = dict(rtol=1e-6, atol=1e-6)
N, T = 3, 21  # 60 predicted tokens: chunks of 7 leave a remainder of 4, 5 divides, 1024 is one chunk
CHUNKS = (7, 5, 1024)
CASES = [dict(correction=c, aggregation=a) for c in ("none", "tis", "seq_is", "mis", "mis_balance", "ppo_is",
                                                     "vanilla_is") for a in ("token_mean", "seq_mean")]
CASES += [dict(correction="tis", dual_clip=0.0), dict(correction="tis", kl_coef=0.1, kl_estimator="k1"),
          dict(correction="tis", kl_coef=0.1, kl_estimator="k3", aggregation="seq_mean")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and OpenMP threads spinning on a shared machine cost
    seconds per forward."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tiny_dir):
    torch.manual_seed(0)
    model, _ = build_model(model_dir(ModelConfig()))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 60, (N, T), generator=g)
    mask = torch.ones(N, T - 1)
    mask[0, :4] = 0
    mask[1, -5:] = 0
    with torch.no_grad():
        lp = token_logprobs(model, ids) / 0.7
    # off-policy inputs far enough from π_θ that the clips, the dual clip and the IS windows all bite
    side = {k: (lp + s * torch.randn(lp.shape, generator=g)).clamp(max=-1e-3) for k, s in
            (("old", 0.4), ("mu", 0.4), ("ref", 0.3))}
    adv = torch.tensor([1.3, -0.9, -1.7])
    log_mix = balance_log_mixture(torch.randn(N, 2, generator=g, dtype=torch.float64) - 20, torch.tensor([2.0, 1.0]))
    return model, ids, mask, side, adv, log_mix


def _loss_grads(model, ids, mask, side, adv, log_mix, cfg: TrainerConfig, chunk: int, coef: float):
    model.zero_grad(set_to_none=True)
    logp, ent = logprobs(model, ids, 0.7, chunk, "grad")
    loss, stats = policy_loss(logp, side["old"], side["mu"], mask, adv, cfg, ref=side["ref"], entropy=ent,
                              entropy_coef=coef, log_mix=log_mix)
    loss.backward()
    return logp.detach(), ent.detach(), loss.detach(), stats, \
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b, what: str) -> None:
    la, ea, lossa, _, ga = a
    lb, eb, lossb, _, gb = b
    torch.testing.assert_close(la, lb, **TOL, msg=f"{what}: logp")
    torch.testing.assert_close(ea, eb, **TOL, msg=f"{what}: entropy")
    torch.testing.assert_close(lossa, lossb, **TOL, msg=f"{what}: loss")
    assert ga.keys() == gb.keys() and ga, what
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], **TOL, msg=f"{what}: grad {n}")


def test_logprobs_and_entropy_equal_the_full_logits(setup):
    model, ids, *_ = setup
    with torch.no_grad():
        logits = model(ids)[:, :-1].float() / 0.7
        want_lp = torch.gather(torch.log_softmax(logits, -1), 2, ids[:, 1:, None]).squeeze(-1)
        want_ent = token_entropy(logits)
        for chunk in CHUNKS:
            lp, ent = logprobs(model, ids, 0.7, chunk, "value")
            torch.testing.assert_close(lp, want_lp, **TOL)
            torch.testing.assert_close(ent, want_ent, **TOL)
    assert "forward" not in model.lm_head.__dict__  # the head is given back


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_loss_and_correction_has_the_unchunked_gradients(setup, case):
    model, ids, mask, side, adv, log_mix = setup
    cfg = TrainerConfig(**{"is_cap": 1.5, "mis_low": 0.7, "mis_high": 1.4, "entropy_coef": 0.01, **case})
    full = _loss_grads(model, ids, mask, side, adv, log_mix, cfg, 0, 0.01)
    stats = full[3]
    assert stats["clip_tokens"] > 0
    if cfg.dual_clip:
        assert stats["dual_clip_tokens"] > 0
    if cfg.correction in ("tis", "mis"):
        assert stats["is_clip_tokens"] > 0
    chunks = CHUNKS if case == CASES[0] else CHUNKS[:1]  # every size once; the rest with the remainder chunk
    for chunk in chunks:
        _same(_loss_grads(model, ids, mask, side, adv, log_mix, cfg, chunk, 0.01), full, f"{case} chunk={chunk}")


def test_untied_head_and_no_entropy_bonus(setup):
    model, ids, mask, side, adv, log_mix = setup
    untied, _ = build_model(model_dir(ModelConfig()))
    untied.load_state_dict(model.state_dict())
    untied.lm_head.weight = torch.nn.Parameter(model.tok_embeddings.weight.detach() * 1.5)
    assert untied.lm_head.weight is not untied.tok_embeddings.weight and chunkable(untied)
    cfg = TrainerConfig(correction="tis", kl_coef=0.05)
    full = _loss_grads(untied, ids, mask, side, adv, log_mix, cfg, 0, 0.0)
    assert "lm_head.weight" in full[4]
    _same(_loss_grads(untied, ids, mask, side, adv, log_mix, cfg, 7, 0.0), full, "untied")


@pytest.mark.parametrize("case", [CASES[1], CASES[-1]], ids=["tis,token_mean", "kl_k3,seq_mean"])
def test_the_head_on_the_loss_tokens_only_gives_their_values_and_the_full_gradients(setup, case):
    """`positions` (what the trainer passes: its loss mask): the head runs on those tokens alone;
    there the values equal the full ones, elsewhere they are 0, and the loss's gradient wrt every
    parameter is the full one (the loss reads masked tokens only)."""
    model, ids, mask, side, adv, log_mix = setup
    cfg = TrainerConfig(**{"is_cap": 1.5, "entropy_coef": 0.01, **case})
    full = _loss_grads(model, ids, mask, side, adv, log_mix, cfg, 0, 0.01)
    sel = mask > 0
    assert not sel.all()  # the setup masks a prompt and a padded tail
    for chunk in (7, 1024):
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs(model, ids, 0.7, chunk, "grad", positions=sel)
        torch.testing.assert_close(logp[sel], full[0][sel], **TOL)
        torch.testing.assert_close(ent[sel], full[1][sel], **TOL)
        assert not logp[~sel].any() and not ent[~sel].any()
        loss, _ = policy_loss(logp, side["old"], side["mu"], mask, adv, cfg, ref=side["ref"], entropy=ent,
                              entropy_coef=0.01, log_mix=log_mix)
        loss.backward()
        torch.testing.assert_close(loss.detach(), full[2], **TOL)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == full[4].keys()
        for n in grads:
            torch.testing.assert_close(grads[n], full[4][n], **TOL, msg=f"chunk={chunk}: grad {n}")


def _core(chunk: int, **trainer) -> TrainCore:
    gen = GeneratorConfig(on_update="abort" if "lora" in trainer else "keep")  # LoRA switches between requests
    return TrainCore.from_config(Config(model=ModelConfig(), generator=gen, trainer=TrainerConfig(
        lr=1e-3, logprob_chunk_tokens=chunk, grad_clip=1e9, **trainer)))


def _first_step(core: TrainCore, batch) -> tuple[dict, dict]:
    """Metrics of one train_step and the gradients of its first optimizer step (before it)."""
    grads: list[dict] = []

    def spy(*_):
        if not grads:
            grads.append({n: p.grad.clone() for n, p in core.model.named_parameters() if p.grad is not None})

    core.optimizer.register_step_pre_hook(spy)
    return core.train_step(batch), grads[0]


@pytest.mark.parametrize("trainer", [dict(entropy_coef=0.02, kl_coef=0.1, minibatches=2),
                                     dict(lora=LoraConfig(rank=8, alpha=16), entropy_coef=0.02)],
                         ids=["entropy+kl+minibatches", "lora"])
def test_train_step_chunked_equals_unchunked(tiny_dir, trainer):
    full, chunked = _core(0, **trainer), _core(7, **trainer)
    assert chunked.chunk == 7 and full.chunk == 0
    batch = make_batch(full.model, n=4, t=19, mu_noise=0.3, seed=2)
    (mf, gf), (mc, gc) = _first_step(full, batch), _first_step(chunked, batch)
    assert gf.keys() == gc.keys() and gf
    for n in gf:
        torch.testing.assert_close(gc[n], gf[n], **TOL, msg=n)
    for k in ("entropy", "kl_ref", "kl_sampler_learner", "mismatch_resp_mean"):
        assert mc[k] == pytest.approx(mf[k], rel=1e-6, abs=1e-6), k
    assert mc["loss"] == pytest.approx(mf["loss"], rel=1e-4, abs=1e-5)  # later minibatches: after AdamW steps


def test_the_key_is_checked():
    assert TrainerConfig().logprob_chunk_tokens == 1024
    with pytest.raises(ConfigError, match="trainer.logprob_chunk_tokens"):
        TrainerConfig(logprob_chunk_tokens=-1)


class _Stop(Exception):
    pass


def _fsdp_rank(rank: int, init: str, out: str, batch) -> None:
    """One of two FSDP2 gloo ranks: the first optimizer step's local gradient shards, unchunked then
    chunked, on one TrainCore (each step stopped at the optimizer, so the weights stay)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        core = TrainCore.from_config(Config(model=ModelConfig(), trainer=TrainerConfig(
            num_ranks=2, lr=1e-3, grad_clip=1e9, entropy_coef=0.02, logprob_chunk_tokens=7)), rank, 2)
        assert core.chunk == 7
        grads: list = []

        def stop(*_):
            grads.append({n: p.grad.to_local().clone() for n, p in core.model.named_parameters()})
            raise _Stop

        core.optimizer.register_step_pre_hook(stop)
        for chunk in (0, 7):
            core.chunk = chunk
            with pytest.raises(_Stop):
                core.train_step(batch)
            core.optimizer.zero_grad(set_to_none=True)
        torch.save(grads, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_fsdp_ranks_chunked_equals_unchunked(setup, tmp_path):
    out = str(tmp_path / "g")
    batch = make_batch(setup[0], n=4, t=19, mu_noise=0.3, seed=2)
    mp.spawn(_fsdp_rank, args=(f"file://{tmp_path / 'rdzv'}", out, batch), nprocs=2, join=True)
    for rank in (0, 1):
        full, chunked = torch.load(f"{out}.{rank}")
        assert full.keys() == chunked.keys() and full
        for n in full:
            torch.testing.assert_close(chunked[n], full[n], **TOL, msg=f"rank {rank} {n}")
