"""TrainCore in-process on the tiny torchtitan model (one rank, no Monarch): input refusal,
non-finite steps, learning direction, on-policy equivalence of corrections, checkpoint resume."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import Config, ModelConfig, TrainerConfig
from pipeline.model import token_logprobs
from pipeline.train_checks import BadBatchError
from pipeline.train_core import NonFiniteLossError, TrainCore
from pipeline.types import Batch


def make_batch(model, n=6, t=20, prompt_len=6, seed=0, adv=None, mu_noise=0.0) -> Batch:
    """Random tokens; behaviour logprobs = the learner's own (+ noise), in the Batch token layout."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 60, (n, t), generator=g)
    mask = torch.zeros(n, t)
    mask[:, prompt_len:] = 1
    mask[0, t - 3:] = 0  # a shorter response, right-padded
    ids[0, t - 3:] = 0
    with torch.no_grad():
        lp = token_logprobs(model, ids)
    lp = (lp + mu_noise * torch.randn(lp.shape, generator=g)).clamp(max=0)
    beh = torch.zeros(n, t)
    beh[:, 1:] = lp * mask[:, 1:]
    adv = torch.randn(n, generator=g) if adv is None else adv
    return Batch(ids, mask, beh, torch.where(mask > 0, 0, -1).long(), adv, adv.clone(), tuple(range(n)), 0)


def weights(core: TrainCore) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in core.model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def cfg() -> Config:
    return Config(model=ModelConfig(), trainer=TrainerConfig(lr=1e-3))


@pytest.fixture()
def core(cfg) -> TrainCore:
    return TrainCore(cfg)


def replace(batch: Batch, **kw) -> Batch:
    d = {f: getattr(batch, f) for f in batch.__dataclass_fields__}
    d.update(kw)
    return Batch(**d)


def test_bad_batches_are_refused_before_touching_weights(core):
    b = make_batch(core.model)
    before = weights(core)
    nan_lp = b.behaviour_logprobs.clone()
    nan_lp[2, 9] = float("nan")
    inf_adv = b.advantages.clone()
    inf_adv[1] = float("inf")
    bad_ids = b.input_ids.clone()
    bad_ids[3, 4] = 10_000
    cases = {
        "behaviour_logprobs has 1 non-finite": replace(b, behaviour_logprobs=nan_lp),
        "advantages has 1 non-finite": replace(b, advantages=inf_adv),
        "no loss tokens": replace(b, loss_mask=torch.zeros_like(b.loss_mask)),
        "outside the vocabulary": replace(b, input_ids=bad_ids),
    }
    for msg, bad in cases.items():
        with pytest.raises(BadBatchError, match=msg):
            core.train_step(bad)
    with pytest.raises(ValueError, match="non-empty"):  # an empty batch cannot even be built
        replace(b, input_ids=torch.zeros(0, 20, dtype=torch.long))
    with pytest.raises(ValueError, match="loss_mask has shape"):
        replace(b, loss_mask=b.loss_mask[:, :-1])
    assert same(before, weights(core)) and core.version == 0
    assert all(p.grad is None for p in core.model.parameters())


def test_nonfinite_loss_stops_the_step_without_updating(core):
    b = make_batch(core.model, adv=torch.full((6,), 3e38))  # finite inputs, loss overflows to inf
    before = weights(core)
    with pytest.raises(NonFiniteLossError, match="weights not updated"):
        core.train_step(b)
    assert same(before, weights(core)) and core.version == 0
    assert all(p.grad is None for p in core.model.parameters())
    m = core.train_step(make_batch(core.model))  # the trainer is still usable
    assert m["version"] == 1 and math.isfinite(m["loss"])


def test_positive_advantage_raises_that_answers_logprob(cfg):
    core = TrainCore(cfg)
    prompt = [5, 6, 7, 8]
    good, bad = [20, 21, 22, 23, 2], [30, 31, 32, 33, 2]
    ids = torch.tensor([prompt + good, prompt + bad] * 2)
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, len(prompt):] = 1

    def answer_logprob():
        with torch.no_grad():
            return float((token_logprobs(core.model, ids[:1]) * mask[:1, 1:]).sum())

    start = answer_logprob()
    for _ in range(5):
        with torch.no_grad():
            lp = token_logprobs(core.model, ids)
        beh = torch.zeros_like(mask)
        beh[:, 1:] = lp * mask[:, 1:]
        adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
        core.train_step(Batch(ids, mask, beh, torch.zeros_like(ids), adv, adv, (0, 0, 0, 0), core.version))
    assert answer_logprob() > start + 0.5, (start, answer_logprob())


def test_on_policy_every_correction_gives_the_ppo_update(cfg):
    """μ = π_learner, one epoch: all IS weights are 1, so every mode takes the same step as 'none'."""
    results = {}
    for mode in ("none", "tis", "seq_is", "mis", "ppo_is", "vanilla_is"):
        c = Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, correction=mode))
        core = TrainCore(c)
        m = core.train_step(make_batch(core.model))
        assert m["is_ess"] == pytest.approx(1.0) and m["mismatch_max"] == 0.0
        results[mode] = (m["loss"], weights(core))
    loss0, w0 = results["none"]
    for mode, (loss, w) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-6), mode
        for k in w0:
            torch.testing.assert_close(w[k], w0[k], rtol=0, atol=1e-7, msg=f"{mode}: {k}")


def test_mismatch_metrics_see_sampler_noise(core):
    m = core.train_step(make_batch(core.model, mu_noise=0.3))
    assert m["mismatch_max"] > 0.01 and m["mismatch_resp_mean"] > 0 and m["is_ess"] < 1.0
    assert 0 < m["entropy"] <= math.log(core.vocab_size) + 1e-4


def test_save_load_is_bit_identical_and_resumes_exactly(cfg, tmp_path):
    a = TrainCore(cfg)
    b1, b2 = make_batch(a.model, seed=1), make_batch(a.model, seed=2)
    a.train_step(b1)
    a.save(tmp_path / "ckpt", data_state={"prompt_pos": 17})
    saved_w, saved_opt = weights(a), {k: v.clone() for k, v in a.optimizer.state_dict()["state"][0].items()}
    want = a.train_step(b2)

    b = TrainCore(cfg)
    assert b.load(tmp_path / "ckpt") == {"prompt_pos": 17}
    assert b.version == 1 and same(saved_w, weights(b))
    got_opt = b.optimizer.state_dict()["state"][0]
    assert all(torch.equal(saved_opt[k], got_opt[k]) for k in saved_opt)
    got = b.train_step(b2)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert same(weights(a), weights(b))


def test_sft_step_lowers_demo_loss_without_advancing_version(core):
    b = make_batch(core.model)
    first = core.sft_step(b.input_ids, b.loss_mask)
    for _ in range(3):
        last = core.sft_step(b.input_ids, b.loss_mask)
    assert last["loss"] < first["loss"] and core.version == 0


def test_kl_penalty_to_initial_policy_is_reported(cfg):
    core = TrainCore(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-2, kl_coef=0.1)))
    b = make_batch(core.model)
    assert core.train_step(b)["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # still the initial policy
    assert core.train_step(b)["kl_ref"] > 0  # k3 >= 0 and the policy has moved


def test_micro_batches_accumulate_to_the_full_batch_step(cfg):
    full = TrainCore(cfg)
    micro = TrainCore(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, micro_batch_size=4)))
    b = make_batch(full.model, n=7, mu_noise=0.2)
    mf, mm = full.train_step(b), micro.train_step(b)
    for k in ("loss", "grad_norm", "tokens", "mismatch_resp_max", "is_ess", "entropy"):
        assert mm[k] == pytest.approx(mf[k], rel=1e-5, abs=1e-7), k
    wf, wm = weights(full), weights(micro)
    for k in wf:
        torch.testing.assert_close(wm[k], wf[k], rtol=0, atol=1e-5, msg=k)


def test_learner_scores_the_temperature_scaled_distribution_the_sampler_used():
    """At generator.temperature=T the sampler reports logprobs of softmax(logits/T); the learner must
    score the same distribution, so on-policy data shows no mismatch (IS ESS 1, zero k1 KL)."""
    from pipeline.config import GeneratorConfig

    cfg = Config(model=ModelConfig(), trainer=TrainerConfig(lr=1e-3), generator=GeneratorConfig(temperature=0.5))
    core = TrainCore(cfg)
    b = make_batch(core.model)
    with torch.no_grad():
        lp = torch.log_softmax(core.model(b.input_ids)[:, :-1].float() / 0.5, -1)
        lp = lp.gather(2, b.input_ids[:, 1:, None]).squeeze(-1)
    beh = torch.zeros_like(b.behaviour_logprobs)
    beh[:, 1:] = lp * b.loss_mask[:, 1:]
    m = core.train_step(replace(b, behaviour_logprobs=beh))
    assert m["is_ess"] == pytest.approx(1.0, abs=1e-5)
    assert abs(m["kl_sampler_learner"]) < 1e-5 and m["mismatch_resp_max"] < 1e-5
