"""TrainCore in-process on the tiny torchtitan model (one rank, no Monarch): input refusal,
non-finite steps, learning direction, on-policy equivalence of corrections, checkpoint resume,
PPO minibatches / epochs against a fixed π_old."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pipeline.config import Config, ModelConfig, TrainerConfig
from pipeline.losses import policy_loss
from pipeline.models.hf import token_logprobs
from pipeline.trainer.errors import BadBatchError, NonFiniteLossError
from pipeline.trainer.snapshots import Proximal
from pipeline.trainer.batches import minibatch_plan, minibatch_rows, spans
from pipeline.trainer.step import TrainCore
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
    return TrainCore.from_config(cfg)


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
    core = TrainCore.from_config(cfg)
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
        core = TrainCore.from_config(c)
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


def test_mismatch_is_split_by_the_version_that_made_each_token(core):
    """π_old's own version's tokens carry the learner's exact logprobs, the stale ones noisy ones:
    the noise shows in the stale metrics only, the whole-batch ones mix both."""
    core.train_step(make_batch(core.model, seed=1))  # version 1
    exact, noisy = make_batch(core.model, seed=2), make_batch(core.model, seed=2, mu_noise=0.3)
    stale = torch.arange(6) >= 3
    beh = torch.where(stale[:, None], noisy.behaviour_logprobs, exact.behaviour_logprobs)
    ver = torch.where(exact.loss_mask > 0, torch.where(stale[:, None], 0, 1), -1).long()
    m = core.train_step(replace(exact, behaviour_logprobs=beh, versions=ver, trainer_version=1))
    assert m["mismatch_cur_max"] < 1e-5 and m["kl_sampler_learner_cur"] == pytest.approx(0, abs=1e-6)
    assert m["mismatch_stale_max"] > 0.01 and m["mismatch_max"] == m["mismatch_stale_max"]
    tok = exact.loss_mask[:, 1:]
    assert m["mismatch_stale_frac"] == pytest.approx(float(tok[3:].sum() / tok.sum()))
    assert m["mismatch_cur_frac"] + m["mismatch_stale_frac"] == pytest.approx(1.0)


def test_save_load_is_bit_identical_and_resumes_exactly(cfg, tmp_path):
    a = TrainCore.from_config(cfg)
    b1, b2 = make_batch(a.model, seed=1), make_batch(a.model, seed=2)
    a.train_step(b1)
    a.save(tmp_path / "ckpt", data_state={"prompt_pos": 17})
    saved_w, saved_opt = weights(a), {k: v.clone() for k, v in a.optimizer.state_dict()["state"][0].items()}
    want = a.train_step(b2)

    b = TrainCore.from_config(cfg)
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
    core = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-2, kl_coef=0.1)))
    b = make_batch(core.model)
    assert core.train_step(b)["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # still the initial policy
    m = core.train_step(b)
    assert m["kl_ref"] > 0  # k3 >= 0 and the policy has moved
    # the step's phases: the reference's forwards are timed apart from the policy's step
    assert m["time/ref_s"] > 0 and m["time/policy_s"] > 0 and m["time/pi_old_s"] >= 0


def test_pi_old_pass_is_timed_apart_when_there_are_later_minibatches(cfg):
    core = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, minibatches=2, kl_coef=0.0)))
    m = core.train_step(make_batch(core.model))
    assert m["time/pi_old_s"] > 0 and m["time/ref_s"] == 0.0 and m["time/policy_s"] > 0


def test_sft_step_at_its_own_lr_leaves_the_rl_lr_alone(cfg):
    a, b = TrainCore.from_config(cfg), TrainCore.from_config(cfg)
    batch = make_batch(a.model)
    w0 = weights(a)
    a.sft_step(batch.input_ids, batch.loss_mask, lr=1e-2)
    b.sft_step(batch.input_ids, batch.loss_mask)
    moved = lambda c: sum(float((weights(c)[k] - w0[k]).abs().sum()) for k in w0)  # noqa: E731
    assert moved(a) > 5 * moved(b)  # AdamW's first step moves each weight by about lr
    assert [g["lr"] for g in a.optimizer.param_groups] == [cfg.trainer.lr] * len(a.optimizer.param_groups)


def test_kl_reference_is_the_warm_started_policy_and_survives_a_checkpoint(cfg, tmp_path):
    """set_reference (after the warm start) re-anchors the KL; a checkpoint keeps that reference, so a
    resumed run does not fall back to the initial checkpoint's policy."""
    tc = TrainerConfig(lr=1e-2, kl_coef=0.1)
    core = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    b = make_batch(core.model)
    for _ in range(3):
        core.sft_step(b.input_ids, b.loss_mask)  # the warm start moves the policy
    b = make_batch(core.model)  # μ = the warm-started policy
    assert core.train_step(b)["kl_ref"] > 1e-4  # still anchored to the initial policy
    core = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    for _ in range(3):
        core.sft_step(b.input_ids, b.loss_mask)
    assert core.state.set_reference()
    b = make_batch(core.model)
    assert core.train_step(b)["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    ref = {k: v.clone() for k, v in core.ref_model.state_dict().items()}
    core.save(tmp_path / "ckpt")
    fresh = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    fresh.load(tmp_path / "ckpt")
    assert same(ref, {k: v for k, v in fresh.ref_model.state_dict().items()})
    assert not same(ref, {k: v.detach() for k, v in TrainCore.from_config(Config(model=cfg.model, trainer=tc)).ref_model.state_dict().items()})


def test_adaptive_entropy_coefficient_steps_and_is_checkpointed(cfg, tmp_path):
    tc = TrainerConfig(lr=1e-3, entropy_coef=0.001, entropy_target=100.0, entropy_adapt_rate=1e-4,
                       entropy_coef_max=0.5)
    core = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    b = make_batch(core.model)
    m1 = core.train_step(b)
    m2 = core.train_step(b)
    assert m1["entropy_coef"] == 0.001  # the coefficient the step used
    assert m2["entropy_coef"] == pytest.approx(0.001 + 1e-4 * (100.0 - m1["entropy"]))
    core.save(tmp_path / "ckpt")
    fresh = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    fresh.load(tmp_path / "ckpt")
    assert fresh.entropy_coef == core.entropy_coef > m2["entropy_coef"]


def test_micro_batches_accumulate_to_the_full_batch_step(cfg):
    full = TrainCore.from_config(cfg)
    micro = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, micro_batch_size=4)))
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
    core = TrainCore.from_config(cfg)
    b = make_batch(core.model)
    with torch.no_grad():
        lp = torch.log_softmax(core.model(b.input_ids)[:, :-1].float() / 0.5, -1)
        lp = lp.gather(2, b.input_ids[:, 1:, None]).squeeze(-1)
    beh = torch.zeros_like(b.behaviour_logprobs)
    beh[:, 1:] = lp * b.loss_mask[:, 1:]
    m = core.train_step(replace(b, behaviour_logprobs=beh))
    assert m["is_ess"] == pytest.approx(1.0, abs=1e-5)
    assert abs(m["kl_sampler_learner"]) < 1e-5 and m["mismatch_resp_max"] < 1e-5


# ---- PPO minibatches / epochs --------------------------------------------------------------------

def hand_steps(core: TrainCore, b: Batch, minibatches: int, epochs: int = 1, fixed_old: bool = True) -> None:
    """The minibatch schedule written out directly: π_old from the weights before the first step
    (or, fixed_old=False, re-taken before every step: the bug a fixed π_old guards against)."""
    mask, mu = b.loss_mask[:, 1:], b.behaviour_logprobs[:, 1:]
    with torch.no_grad():
        old = token_logprobs(core.model, b.input_ids)
    for split in minibatch_rows(b.num_samples, minibatches, epochs, core.seed, core.version):
        for rows in split:
            if not fixed_old:
                with torch.no_grad():
                    old = token_logprobs(core.model, b.input_ids)
            loss, _ = policy_loss(token_logprobs(core.model, b.input_ids[rows]), old[rows], mu[rows], mask[rows],
                                  b.advantages[rows], core.tcfg)  # denominators: this minibatch's own
            loss.backward()
            torch.nn.utils.clip_grad_norm_(core.model.parameters(), core.tcfg.grad_clip)
            core.optimizer.step()
            core.optimizer.zero_grad(set_to_none=True)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("epochs, micro", [(1, 0), (2, 0), (2, 2)])
def test_minibatches_equal_hand_steps_against_a_fixed_pi_old(cfg, epochs, micro):
    lr = 1e-2
    # the unchunked loss head: hand_steps score with token_logprobs, which the bitwise comparison needs
    # (the chunked head equals it within float rounding, tests/test_chunked_logprobs.py)
    c = Config(model=cfg.model, trainer=TrainerConfig(lr=lr, minibatches=2, epochs=epochs, micro_batch_size=micro,
                                                      logprob_chunk_tokens=0))
    auto, hand, drift = TrainCore.from_config(c), TrainCore.from_config(c), TrainCore.from_config(c)  # same seed: same initial weights
    b = make_batch(auto.model, n=7, mu_noise=0.2)
    m = auto.train_step(b)
    hand_steps(hand, b, 2, epochs)
    hand_steps(drift, b, 2, epochs, fixed_old=False)
    assert m["optimizer_steps"] == 2 * epochs and m["version"] == 1 and auto.version == 1
    if micro == 0:
        assert same(weights(auto), weights(hand))
    else:  # micro-batch sums differ in the last fp32 bit, which AdamW's g/(|g|+eps) amplifies
        assert max_diff(weights(auto), weights(hand)) < 0.01 * lr
    assert max_diff(weights(auto), weights(drift)) > 0.5 * lr  # so the comparison can tell π_old apart


def test_minibatches_make_the_clip_bite_and_the_version_advance_once(cfg):
    one = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-2)))
    four = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-2, minibatches=4)))
    b = make_batch(one.model, n=8)  # behaviour logprobs = the learner's own: on-policy
    m1, m4 = one.train_step(b), four.train_step(b)
    assert m1["clip_frac"] == 0.0 and m1["optimizer_steps"] == 1  # r = π_θ / π_old = 1 exactly
    assert m4["clip_frac"] > 0 and m4["optimizer_steps"] == 4  # later minibatches see a moved policy
    assert m1["version"] == m4["version"] == 1 and four.version == 1
    assert m4["tokens"] == m1["tokens"] and m4["is_ess"] == pytest.approx(1.0)


def test_minibatch_plan_splits_each_minibatch_across_ranks_in_lockstep():
    for n, mbs_count, world, mbs in [(7, 2, 2, 0), (8, 4, 3, 1), (5, 5, 4, 2), (16, 3, 2, 3)]:
        plans = [minibatch_plan(n, mbs_count, world, r, mbs) for r in range(world)]
        single = minibatch_plan(n, mbs_count, 1, 0, 0)
        for m, (rows, _) in enumerate(single):
            got = sorted(int(i) for p in plans for c, keep in p[m][1] if keep for i in c)
            assert got == rows.tolist()  # the ranks' shares make up the single-rank minibatch
            assert len({len(p[m][1]) for p in plans}) == 1  # same number of micro-batches everywhere
            if mbs:
                assert all(len(c) <= mbs for p in plans for c, _ in p[m][1])


def test_micro_batches_take_rows_of_like_length_in_every_rank_and_minibatch():
    lengths = torch.tensor([5, 19, 7, 19, 3, 11, 2, 13, 17])
    for n, mbs_count, world, mbs in [(9, 1, 1, 2), (9, 2, 2, 2), (9, 1, 3, 1)]:
        sorted_plans = [minibatch_plan(n, mbs_count, world, r, mbs, lengths[:n]) for r in range(world)]
        plain = [minibatch_plan(n, mbs_count, world, r, mbs) for r in range(world)]
        for ps, pp in zip(sorted_plans, plain):
            for (rows_s, micro_s), (rows_p, micro_p) in zip(ps, pp):
                assert torch.equal(rows_s, rows_p) and len(micro_s) == len(micro_p)  # the same shares
                mine = torch.cat([c for c, keep in micro_s if keep])
                assert sorted(mine.tolist()) == sorted(torch.cat([c for c, k in micro_p if k]).tolist())
                if len(micro_s) > 1:  # cut into micro-batches: longest first
                    assert lengths[mine].tolist() == sorted(lengths[mine].tolist(), reverse=True)
                else:
                    assert torch.equal(mine, torch.cat([c for c, k in micro_p if k]))
    # one micro-batch: the batch order stays (nothing to gain; bitwise the unsorted step)
    assert torch.equal(minibatch_plan(9, 1, 1, 0, 0, lengths)[0][1][0][0], torch.arange(9))


def test_length_sorted_cut_micro_batches_give_the_padded_batch_gradient(cfg):
    """Rows of very different lengths (right padding, one row with trailing non-loss tokens, one
    without loss tokens): the step over length-sorted micro-batches cut to their longest row, the head
    on loss tokens only, has the gradient of the whole padded batch scored at once (token_logprobs,
    the full logits) and the same metrics."""
    tc = TrainerConfig(lr=1e-3, micro_batch_size=2, logprob_chunk_tokens=5, grad_clip=1e9, correction="tis",
                       entropy_coef=0.01)
    core = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    b = make_batch(core.model, n=7, t=24, prompt_len=4, mu_noise=0.3, seed=3)
    mask, ids = b.loss_mask.clone(), b.input_ids.clone()
    for i, end in enumerate([24, 9, 15, 6, 24, 12, 4]):  # row 6: no loss tokens
        mask[i, end:] = 0
        ids[i, end:] = 0
    mask[4, 20:] = 0  # row 4: environment tokens after its last loss token (kept in ids)
    b = replace(b, input_ids=ids, loss_mask=mask, behaviour_logprobs=b.behaviour_logprobs * mask,
                versions=torch.where(mask > 0, 0, -1).long())
    plan = minibatch_plan(7, 1, 1, 0, 2, spans(mask))
    assert [c.tolist() for c, _ in plan[0][1]] == [[0, 4], [2, 5], [1, 3], [6]]
    params = [p for p in core.model.parameters()]
    logp = token_logprobs(core.model, ids)  # generator.temperature 1.0
    m1 = mask[:, 1:]
    logits = core.model(ids)[:, :-1].float()  # the bonus: the full logits' entropy
    ent = -(torch.log_softmax(logits, -1).exp() * torch.log_softmax(logits, -1)).sum(-1)
    loss, _ = policy_loss(logp, logp.detach(), b.behaviour_logprobs[:, 1:], m1, b.advantages, tc,
                          entropy=ent, entropy_coef=0.01)
    want = torch.autograd.grad(loss, params)
    got: list = []
    core.optimizer.register_step_pre_hook(lambda *_: got.append([p.grad.clone() for p in params]) if not got else None)
    m = core.train_step(b)
    for (name, _), g, w in zip(core.model.named_parameters(), got[0], want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert m["tokens"] == float(m1.sum())
    with torch.no_grad():
        want_ent = float((ent * m1).sum() / m1.sum())
    assert m["entropy"] == pytest.approx(want_ent, rel=1e-5)


def test_too_few_samples_for_the_minibatches_are_refused(cfg):
    core = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(minibatches=8)))
    before = weights(core)
    with pytest.raises(BadBatchError, match="trainer.minibatches=8"):
        core.train_step(make_batch(core.model, n=6))
    assert same(before, weights(core)) and core.version == 0


def test_nonfinite_later_minibatch_raises_before_its_own_update(cfg):
    """Documented behaviour: the first minibatch's step stays applied, the failing one is not, and
    the version does not advance (nothing is snapshotted; the run is expected to stop)."""
    core = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, minibatches=2)))
    first, _ = minibatch_rows(6, 2, 1, core.seed, core.version)[0]
    adv = torch.full((6,), 3e38)  # finite, but the second minibatch's loss overflows
    adv[first] = torch.tensor([1.0, -1.0, 0.5])
    b = make_batch(core.model, adv=adv)
    before = weights(core)
    with pytest.raises(NonFiniteLossError, match="weights not updated by it"):
        core.train_step(b)
    assert not same(before, weights(core)) and core.version == 0
    assert all(p.grad is None for p in core.model.parameters())
    assert core.optimizer.state_dict()["state"][0]["step"] == 1  # exactly one optimizer step ran


def mis_cfg(cfg: Config, max_staleness: int = 3) -> Config:
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, correction="mis_balance"),
                               generator=dataclasses.replace(cfg.generator, on_update="drain"),
                               buffer=dataclasses.replace(cfg.buffer, max_staleness=max_staleness))


def with_versions(b: Batch, own: list[int], trainer_version: int) -> Batch:
    ver = b.versions.clone()
    for i, v in enumerate(own):
        ver[i][b.loss_mask[i] > 0] = v
    return replace(b, versions=ver, trainer_version=trainer_version)


def trainer_log_mixture(c: Config, copies: dict, b: Batch, own: list[int]) -> list[float]:
    """log Σ_j α_j q_j(y_i) in float64 by hand, every q_j a forward of a fresh core with version j's
    whole state dict (`copies`), for the first samples, each of the one version `own` names."""
    mask = b.loss_mask[:, 1:].float()
    ref = TrainCore.from_config(c)
    vs = sorted(set(own))
    logq = torch.zeros(b.num_samples, len(vs), dtype=torch.float64)
    for k, j in enumerate(vs):
        ref.model.load_state_dict(copies[j])
        with torch.no_grad():
            logq[:, k] = (token_logprobs(ref.model, b.input_ids) * mask).sum(1).double()
    alpha = [own.count(j) / len(own) for j in vs]
    return [math.log(sum(a * math.exp(logq[i, k]) for k, a in enumerate(alpha))) for i in range(len(own))]


def test_mis_balance_scores_every_sample_under_every_version_of_its_batch(cfg):
    """Three steps make versions 0, 1, 2; a batch with samples of all three and of the current one (and
    one spanning two) gets log Σ_j α_j q_j(y) with every q_j from a copy of version j's weights (taken
    here by hand), the sample's own version included; the spanning one gets seq_is's weight, counted."""
    c = mis_cfg(cfg)
    core = TrainCore.from_config(c)
    copies = {}
    for v in range(3):
        copies[v] = weights(core)
        core.train_step(make_batch(core.model, seed=10 + v))
    copies[3] = weights(core)
    b = make_batch(core.model, n=7, seed=20, mu_noise=0.3)
    own = [0, 0, 1, 2, 2, 2, 3]
    b = with_versions(b, own, 3)
    ver = b.versions.clone()
    ver[6, -2:] = 2  # sample 6 spans versions 3 and 2: no single proposal
    b = replace(b, versions=ver)
    mask = b.loss_mask[:, 1:].float()
    mu = (b.behaviour_logprobs[:, 1:] * mask).sum(1).double()
    expect = trainer_log_mixture(c, copies, b, own[:6])  # sample 6 is not counted in any version
    prox = Proximal(mask.shape, core.device, c.trainer)
    plan = minibatch_plan(7, 1, 1, 0, c.trainer.micro_batch_size)
    before = weights(core)
    m = core.snapshots.balance_mixture(core.version, b, plan, prox)
    assert same(before, weights(core))  # the live weights are back after scoring with the snapshots
    assert prox.log_mix[:6].tolist() == pytest.approx(expect, abs=1e-4)
    assert prox.log_mix[6].item() == pytest.approx(mu[6].item(), abs=1e-6)  # seq_is's weight
    assert m["mis_balance/versions"] == 3 and m["mis_balance/mixed_samples"] == 1 and m["mis_balance/fallback"] == 0
    assert sorted(core.snapshots.weights) == [0, 1, 2, 3]  # max_staleness = 3 versions before 3, and 3 itself
    params = list(core.model.parameters())  # a full fine-tune: every parameter trains, and is kept
    assert m["mis_balance/snapshots"] == 4 and all(len(core.snapshots.weights[v]) == len(params) for v in range(4))
    assert m["mis_balance/snapshot_mb"] == sum(p.numel() * 4 for p in params) / 2**20  # float32
    assert m["mis_balance/live_copy_mb"] == m["mis_balance/snapshot_mb"]
    metrics = core.train_step(b)
    assert metrics["version"] == 4.0 and 0 < metrics["is_ess"] <= 1


def test_mis_balance_likelihoods_come_from_the_trainer_not_the_sampler(cfg):
    """A batch of versions 0 and 1 (the current one) whose sampler logprobs differ from the trainer's
    by noise: log_mix is the same under two noise draws (the sampler's likelihood is in no q_j) and
    equals the log-mixture of the trainer's forwards with each version's weights, in float64 by hand."""
    c = mis_cfg(cfg)
    core = TrainCore.from_config(c)
    copies = {0: weights(core)}
    core.train_step(make_batch(core.model, seed=40))
    copies[1] = weights(core)
    own = [0, 0, 1, 1, 1, 1]
    expect = None
    for noise_seed in (1, 2):
        b = with_versions(make_batch(core.model, seed=41), own, 1)
        g = torch.Generator().manual_seed(noise_seed)
        noisy = (b.behaviour_logprobs + 0.3 * torch.randn(b.behaviour_logprobs.shape, generator=g)).clamp(max=0)
        b = replace(b, behaviour_logprobs=noisy * b.loss_mask)
        expect = expect or trainer_log_mixture(c, copies, b, own)
        prox = Proximal(b.loss_mask[:, 1:].shape, core.device, c.trainer)
        m = core.snapshots.balance_mixture(core.version, b, minibatch_plan(6, 1, 1, 0, 0), prox)
        assert m["mis_balance/versions"] == 2 and m["mis_balance/mixed_samples"] == 0
        assert prox.log_mix.tolist() == pytest.approx(expect, abs=1e-4)


def test_mis_balance_without_a_snapshot_falls_back_to_seq_is(cfg):
    c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, correction="mis_balance"),
                            generator=dataclasses.replace(cfg.generator, on_update="drain"))
    core = TrainCore.from_config(c)
    b = make_batch(core.model, seed=3, mu_noise=0.2)
    core.version = 5  # as after a resume: versions 4 and 5 in the batch, no snapshot of 4
    ver = torch.where(b.loss_mask > 0, 5, -1).long()
    ver[0][b.loss_mask[0] > 0] = 4
    prox = Proximal(b.loss_mask[:, 1:].shape, core.device, c.trainer)
    m = core.snapshots.balance_mixture(core.version, replace(b, versions=ver, trainer_version=5),
                                       minibatch_plan(6, 1, 1, 0, c.trainer.micro_batch_size), prox)
    mu = (b.behaviour_logprobs[:, 1:] * b.loss_mask[:, 1:]).sum(1)
    assert m["mis_balance/fallback"] == 1 and prox.log_mix.tolist() == pytest.approx(mu.tolist(), abs=1e-5)


def test_grad_variance_is_the_spread_of_the_micro_batch_gradients(cfg):
    """trainer.grad_variance against a direct computation: each micro-batch's gradient of its share of
    the loss (global denominators) by autograd, then K/(K-1)·(Σ||g_k||² − ||Σ g_k||²/K); a batch of
    identical rows has identical chunks, so no variance."""
    tc = TrainerConfig(lr=1e-3, micro_batch_size=2, grad_variance=True, kl_coef=0.0, correction="seq_is")
    core = TrainCore.from_config(Config(model=cfg.model, trainer=tc))
    b = make_batch(core.model, n=8, mu_noise=0.3)
    params = [p for p in core.model.parameters()]
    mask = b.loss_mask[:, 1:].float()
    den = (float(mask.sum()), float((mask.sum(1) > 0).sum()))
    chunks = []
    for rows in torch.arange(8).split(2):
        logp = token_logprobs(core.model, b.input_ids[rows])
        loss, _ = policy_loss(logp, logp.detach(), b.behaviour_logprobs[rows, 1:], mask[rows],
                              b.advantages[rows], tc, denominators=den)
        chunks.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]).double())
    total = torch.stack(chunks).sum(0)
    want = 4 / 3 * (sum(float(g @ g) for g in chunks) - float(total @ total) / 4)
    m = core.train_step(b)
    assert m["grad/var_chunks"] == 4
    assert m["grad/var"] == pytest.approx(want, rel=1e-4) and want > 0
    assert m["grad/var_rel"] == pytest.approx(want / float(total @ total), rel=1e-4)

    same_rows = make_batch(core.model, n=8)
    one = lambda t: t[:1].expand(8, *t.shape[1:]).clone()  # noqa: E731
    same_rows = Batch(one(same_rows.input_ids), one(same_rows.loss_mask), one(same_rows.behaviour_logprobs),
                      one(same_rows.versions), torch.ones(8), torch.ones(8), tuple(range(8)), core.version)
    m = core.train_step(same_rows)
    assert m["grad/var_rel"] < 1e-6, m


def test_overlong_filter_trains_as_if_the_truncated_samples_had_no_loss_tokens(cfg):
    """DAPO's overlong filtering in the trainer (trainer.overlong_filter): the step on a batch with two
    truncated samples moves the weights exactly as the same step with those samples' loss masks zeroed,
    reports their share, and differs from the unfiltered step."""
    def step(overlong_filter: bool, batch: Batch) -> tuple[dict, dict]:
        torch.manual_seed(0)
        core = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-2, overlong_filter=overlong_filter)))
        return core.train_step(batch), weights(core)

    torch.manual_seed(0)
    base = make_batch(TrainCore.from_config(cfg).model, mu_noise=0.05)
    truncated = torch.tensor([False, True, False, True, False, False])
    flagged = dataclasses.replace(base, truncated=truncated)
    masked = dataclasses.replace(base, loss_mask=base.loss_mask * (~truncated).float()[:, None])
    m_filtered, w_filtered = step(True, flagged)
    _, w_masked = step(False, masked)
    m_plain, w_plain = step(False, flagged)
    assert same(w_filtered, w_masked)
    assert not same(w_filtered, w_plain)
    assert m_filtered["overlong_filtered_frac"] == pytest.approx(2 / 6) and m_plain["overlong_filtered_frac"] == 0.0
    assert m_filtered["truncated_frac"] == m_plain["truncated_frac"] == pytest.approx(2 / 6)


def test_dr_grpo_divides_by_the_batchs_rollout_budget(cfg):
    """aggregation=constant (Dr. GRPO) divides by Batch.max_len, the budget of the batch's rollouts
    (task.max_total_tokens for multi-turn ones), and by generator.max_new_tokens when the batch has none."""
    def loss(max_len: int) -> float:
        torch.manual_seed(0)
        core = TrainCore.from_config(Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, recipe="dr_grpo", correction="none")))
        base = make_batch(core.model)
        return core.train_step(dataclasses.replace(base, max_len=max_len))["loss"]

    default = cfg.generator.max_new_tokens
    assert loss(0) == pytest.approx(loss(default), rel=1e-6)
    assert loss(4 * default) == pytest.approx(loss(default) / 4, rel=1e-6)


def minibatch_log(core: TrainCore) -> list[list[list[int]]]:
    """Spy on the core's optimizer steps: per train_step, each step's minibatch as sorted real rows."""
    log: list[list[list[int]]] = []
    inner = core._ppo_step

    def spy(batch, micro, den, prox, first):
        if first:
            log.append([])
        log[-1].append(sorted(int(i) for rows, keep in micro if keep for i in rows))
        return inner(batch, micro, den, prox, first)
    core._ppo_step = spy
    return log


def test_minibatches_are_reshuffled_every_epoch_from_the_seed_and_the_version(cfg):
    """trainer.minibatches > 1 with several epochs: each epoch splits the batch's rows anew, by a
    permutation drawn from run.seed and the policy version alone (not the global RNG), so a rerun and
    every data-parallel rank draw the same minibatches, and the clip sees other neighbours each pass."""
    def run(seed: int, steps: int = 2) -> list[list[list[int]]]:
        c = Config(model=cfg.model, trainer=TrainerConfig(lr=1e-3, minibatches=2, epochs=3))
        c.run.seed = seed
        core = TrainCore.from_config(c)
        log = minibatch_log(core)
        for v in range(steps):
            torch.manual_seed(100 + v + seed)  # the global RNG plays no part
            core.train_step(make_batch(core.model, n=8, seed=v))
        return log

    a, b, other = run(0), run(0), run(1)
    assert a == b  # reproducible from the seed
    for step in a + other:
        epochs = [step[i:i + 2] for i in range(0, len(step), 2)]
        assert len(epochs) == 3 and all(sorted(e[0] + e[1]) == list(range(8)) for e in epochs)
        assert all(len(e[0]) == len(e[1]) == 4 for e in epochs)
    # contiguous, identical minibatches in every epoch would be [[0..3], [4..7]] three times over
    assert any(e != [[0, 1, 2, 3], [4, 5, 6, 7]] for step in a for e in (step[0:2], step[2:4], step[4:6]))
    assert all(len({tuple(map(tuple, step[i:i + 2])) for i in range(0, 6, 2)}) > 1 for step in a)  # epochs differ
    assert a[0] != a[1] and a != other  # a new draw per version and per seed
