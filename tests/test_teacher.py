"""On-policy distillation (pipeline/teacher.py, actors/teacher.py, pipeline/losses.py token_advantages):
streamed teacher log-probs equal a one-shot prefill and HF transformers' forward (float64), the
loss and its gradient equal a re-implementation of the published OPD objective (float64),
distill_coef=0 is exactly GRPO, a teacher equal to the student gives advantage 0, a tokenizer
mismatch exits 2 naming both directories, the teacher actor on a real proc with the generators'
client, and a CLI run with self-distillation whose teacher is SIGKILLed mid-run.

    .venv/bin/python -m pytest -q tests/test_teacher.py -x
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pipeline import losses
from pipeline.config import Config, ConfigError, ModelConfig, TrainerConfig, load_config
from pipeline.tasks import RewardRejected
from pipeline.teacher import TeacherScorer, check_tokenizers, one_shot_logprobs, teacher_prompt

from tests.conftest import REPO, actor_spawner, run_and_kill

T = 0.7  # a sampling temperature != 1: the teacher scores softmax(logits / T), as the learner does


def seqs(n: int, lo: int = 5, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 60) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def teacher64(tiny_dir):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return TeacherScorer(tiny_dir, dtype=torch.float64, max_sequences=8, max_batch=3, temperature=T)


# ---------------------------------------------------------------- the scorer


def test_streamed_teacher_logprobs_equal_one_shot_prefill_and_hf_forward(teacher64, tiny_dir):
    """Chunks of uneven sizes, several streams batched (their caches left-padded), equal one forward of
    the whole sequence and HF transformers' own logits, in float64."""
    ss = seqs(4, 8, 40, seed=3)
    rng = random.Random(5)
    pos = {k: 0 for k in range(len(ss))}
    rounds = []
    while any(pos[k] < len(s) for k, s in enumerate(ss)):  # interleaved chunks of 1..7 tokens, a round a forward
        ops = []
        rounds.append(ops)
        for k, s in enumerate(ss):
            if pos[k] >= len(s):
                continue
            n = rng.randint(1, 7)
            chunk = s[pos[k]:pos[k] + n]
            kind = "finish" if pos[k] + n >= len(s) else "prefill"
            ops.append((kind, f"s{k}", pos[k], chunk))
            pos[k] += len(chunk)
    streamed = {}
    for ops in rounds:
        streamed.update({op[1]: r for op, r in zip(ops, teacher64.run(ops)) if op[0] == "finish"})
    whole = teacher64.logprobs(ss)
    for k, s in enumerate(ss):
        lps = streamed[f"s{k}"]["logprobs"]
        assert len(lps) == len(s) - 1
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), torch.tensor(whole[k], dtype=torch.float64),
                              atol=1e-10, rtol=0)
        hf = one_shot_logprobs(tiny_dir, s, T, torch.float64)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), torch.tensor(hf, dtype=torch.float64),
                              atol=1e-10, rtol=0)
        assert all(x <= 0 for x in lps)
    assert teacher64.held == 0 and teacher64.counts["prefill_tokens"] > 0


def test_a_groups_samples_share_one_prefill_of_the_teachers_prompt(teacher64):
    """A group's streams start with the same teacher prompt, sent alone: one forward serves them all
    (twins in one round, or a later stream from the prefix cache), and their log-probs are unchanged."""
    prompt = seqs(1, 12, 12, seed=21)[0]
    tails = seqs(4, 3, 9, seed=22)
    before = teacher64.counts.get("shared_tokens", 0)
    forwards = teacher64.counts["forwards"]
    assert teacher64.run([("prefill", f"p{k}", 0, prompt) for k in range(3)]) == [True] * 3
    assert teacher64.counts["forwards"] == forwards + 1  # three twins, one forward
    assert teacher64.run([("prefill", "p3", 0, prompt)]) == [True]  # later: from the prefix cache
    assert teacher64.counts["forwards"] == forwards + 1
    out = teacher64.run([("finish", f"p{k}", len(prompt), t) for k, t in enumerate(tails)])
    whole = teacher64.logprobs([prompt + t for t in tails])
    for got, want in zip(out, whole):
        assert torch.allclose(torch.tensor(got["logprobs"], dtype=torch.float64),
                              torch.tensor(want, dtype=torch.float64), atol=1e-10, rtol=0)
    assert teacher64.counts["shared_tokens"] - before == 3 * len(prompt)


def test_teacher_equal_to_the_student_gives_advantage_zero(tiny_dir):
    """teacher.hf_dir=self without context: the teacher's log-probs are the learner's own (HF
    transformers against torchtitan, float32), so A_t = -(log pi_old - log pi_teacher) is 0 up to
    float32 rounding, and the OPD loss's gradient vanishes with it."""
    from pipeline.trainer.step import TrainCore
    from tests.test_trainer_core import make_batch

    cfg = Config(model=ModelConfig(), trainer=TrainerConfig(lr=1e-3, recipe="opd"),
                 teacher=load_config(None, ["teacher.hf_dir=self"]).teacher)
    cfg.generator.temperature = T
    core = TrainCore.from_config(cfg)
    core.temperature = T
    b = make_batch(core.model, n=4, t=24, seed=2)
    teacher = TeacherScorer(tiny_dir, temperature=T)
    tl = torch.zeros_like(b.behaviour_logprobs)
    for i, lps in enumerate(teacher.logprobs(b.input_ids.tolist())):
        tl[i, 1:] = torch.tensor(lps) * b.loss_mask[i, 1:]
    with torch.no_grad():
        old = core._logprobs(b, torch.arange(4), "value")[0]
    mask = b.loss_mask[:, 1:]
    adv = losses.token_advantages(b.advantages, old, tl[:, 1:], mask, 0.0, 1.0)
    assert float(adv.abs().max()) < 1e-4
    # the same batch as an RL step has a gradient 4+ orders of magnitude larger
    from tests.test_trainer_core import replace

    m_opd = core.train_step(replace(b, teacher_logprobs=tl))
    core2 = TrainCore.from_config(Config(model=ModelConfig(), trainer=TrainerConfig(lr=1e-3)))
    core2.temperature = T
    m_rl = core2.train_step(b)
    assert m_opd["grad_norm"] < 1e-4 * m_rl["grad_norm"]
    assert abs(m_opd["distill/rkl"]) < 1e-5


# ---------------------------------------------------------------- the objective


def _inputs(seed=0, n=5, t=12):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(n, t, generator=g, dtype=torch.float64) - 2).clamp(max=-0.01)
    mu = (logp + 0.1 * torch.randn(n, t, generator=g, dtype=torch.float64)).clamp(max=0)
    teacher = (logp + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)).clamp(max=0)
    mask = (torch.rand(n, t, generator=g) > 0.2).double()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, mu, teacher, mask, adv


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_opd_loss_and_gradient_equal_the_published_objective(correction):
    """OPD (Agarwal et al. 2024; Thinking Machines 2025): minimise the per-token reverse KL on the
    student's own samples, whose score-function gradient is E_y[(log pi_s(y) - log pi_t(y)) grad log pi_s(y)],
    importance-weighted by pi_old/mu for samples of an older sampler. Our loss with recipe opd,
    one minibatch (pi_theta = pi_old), must have exactly that gradient, token-mean aggregated."""
    logp0, mu, teacher, mask, adv = _inputs(1)
    cfg = TrainerConfig(recipe="opd", correction=correction)
    logp = logp0.clone().requires_grad_(True)
    old = logp0.clone()
    a = losses.token_advantages(adv, old, teacher, mask, cfg.reward_coef, cfg.distill_coef)
    loss, _ = losses.policy_loss(logp, old, mu, mask, a, cfg)
    loss.backward()
    # the published objective, written out: w_t * (log pi_s - log pi_t).detach() * log pi_s, mean over tokens
    ref_logp = logp0.clone().requires_grad_(True)
    w = torch.ones_like(mu) if correction == "none" else torch.exp(old - mu).clamp(max=cfg.is_cap)
    rkl = (ref_logp - teacher).detach()
    ref = (w * rkl * ref_logp * mask).sum() / mask.sum()
    ref.backward()
    assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-14, rtol=0)
    # its value at pi_theta = pi_old: the IS-weighted reverse KL estimate's negative-advantage form
    assert float(loss) == pytest.approx(float((w * rkl * mask).sum() / mask.sum()), abs=1e-12)
    # the teacher pulls up tokens it likes more than the student does, and pushes down the others
    up = (teacher > old) & (mask > 0)
    assert bool((logp.grad[up] < 0).all()) and bool((logp.grad[(teacher < old) & (mask > 0)] > 0).all())


def test_distill_coef_zero_is_exactly_grpo():
    """With distill_coef=0 and reward_coef=1 the token advantages are the group advantage on every
    loss token, so the loss and gradient are bit for bit GRPO's (and the trainer takes the scalar
    path then, test below)."""
    logp0, mu, teacher, mask, adv = _inputs(2)
    cfg = TrainerConfig(recipe="grpo")
    a = losses.token_advantages(adv, logp0, teacher, mask, 1.0, 0.0)
    x = logp0.clone().requires_grad_(True)
    y = logp0.clone().requires_grad_(True)
    l1, _ = losses.policy_loss(x, logp0, mu, mask, a, cfg)
    l2, _ = losses.policy_loss(y, logp0, mu, mask, adv, cfg)
    l1.backward()
    l2.backward()
    assert torch.equal(l1, l2) and torch.equal(x.grad, y.grad)


def test_distill_coef_zero_run_step_equals_grpo_step_with_a_teacher_attached():
    """TrainCore: a batch carrying teacher log-probs, trained with distill_coef=0, moves the
    weights exactly as the same batch without them (GRPO)."""
    from pipeline.trainer.step import TrainCore
    from tests.test_trainer_core import make_batch, replace, weights

    cfg = Config(model=ModelConfig(), trainer=TrainerConfig(lr=1e-3, recipe="grpo"))
    a, b = TrainCore.from_config(cfg), TrainCore.from_config(cfg)
    batch = make_batch(a.model, seed=4)
    tl = (batch.behaviour_logprobs - 0.3) * batch.loss_mask
    ma = a.train_step(replace(batch, teacher_logprobs=tl))
    mb = b.train_step(batch)
    wa, wb = weights(a), weights(b)
    assert ma["loss"] == mb["loss"] and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_opd_step_moves_the_student_towards_the_teacher():
    """A few OPD steps on one batch: the student's log-probs of the batch's tokens move towards the
    teacher's (their mean absolute gap on the loss tokens falls)."""
    from pipeline.models.hf import token_logprobs
    from pipeline.trainer.step import TrainCore
    from tests.test_trainer_core import make_batch, replace

    cfg = Config(model=ModelConfig(), trainer=TrainerConfig(lr=3e-3, recipe="opd"),
                 teacher=load_config(None, ["teacher.hf_dir=self"]).teacher)
    core = TrainCore.from_config(cfg)
    batch = make_batch(core.model, seed=6)
    g = torch.Generator().manual_seed(0)
    tl = ((batch.behaviour_logprobs + 0.5 * torch.randn(batch.behaviour_logprobs.shape, generator=g)).clamp(max=0)
          * batch.loss_mask)
    batch = replace(batch, teacher_logprobs=tl)
    mask = batch.loss_mask[:, 1:]

    def gap() -> float:
        with torch.no_grad():
            lp = token_logprobs(core.model, batch.input_ids)
        return float(((lp - tl[:, 1:]).abs() * mask).sum() / mask.sum())

    before = gap()
    for _ in range(4):
        core.train_step(batch)
    assert gap() < 0.8 * before


# ---------------------------------------------------------------- config and start-up checks


def test_teacher_prompt_adds_the_context_to_the_last_user_turn_or_before_a_plain_prompt():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 2+2?"}]
    assert teacher_prompt(msgs, "The answer is 4.")[-1]["content"] == "What is 2+2?\n\nThe answer is 4."
    assert msgs[-1]["content"] == "What is 2+2?"  # the student's prompt is untouched
    assert teacher_prompt("rev ab=", "hint") == "hint\n\nrev ab="
    assert teacher_prompt(msgs, "") is msgs


def test_config_checks_teacher_keys(tmp_path):
    with pytest.raises(ConfigError, match="teacher.hf_dir"):
        load_config(None, ["trainer.recipe=opd"])  # distillation needs a teacher
    with pytest.raises(ConfigError, match="teacher.hf_dir"):
        load_config(None, [f"teacher.hf_dir={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="teacher.context"):
        load_config(None, ["teacher.hf_dir=self", "teacher.context=The answer is {answer"])
    with pytest.raises(ConfigError, match="teacher.context"):
        load_config(None, ["teacher.context={answer}"])  # a context without a teacher
    with pytest.raises(ConfigError, match="trainer.distill_coef"):
        load_config(None, ["teacher.hf_dir=self", "trainer.distill_coef=-1"])
    c = load_config(None, ["teacher.hf_dir=self", "trainer.recipe=opd"])
    assert (c.trainer.distill_coef, c.trainer.reward_coef) == (1.0, 0.0)
    c = load_config(None, ["teacher.hf_dir=self", "trainer.recipe=opd+grpo", "trainer.distill_coef=0.5"])
    assert (c.trainer.distill_coef, c.trainer.reward_coef, c.trainer.aggregation) == (0.5, 1.0, "seq_mean")


def other_tokenizer_copy(src, dst, change: str):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    if change == "none":
        return dst
    if change == "vocab":
        tj = json.loads((dst / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (dst / "tokenizer.json").write_text(json.dumps(tj))
    else:  # another end-of-sequence token
        tc = json.loads((dst / "tokenizer_config.json").read_text())
        conf = json.loads((dst / "config.json").read_text())
        vocab = json.loads((dst / "tokenizer.json").read_text())["model"]["vocab"]
        other = next(t for t in sorted(vocab, key=vocab.get)[5:] if t != tc.get("eos_token"))
        tc["eos_token"] = other
        (dst / "tokenizer_config.json").write_text(json.dumps(tc))
        conf["eos_token_id"] = vocab[other]
        (dst / "config.json").write_text(json.dumps(conf))
        gen = dst / "generation_config.json"
        if gen.exists():
            g = json.loads(gen.read_text())
            g["eos_token_id"] = vocab[other]
            gen.write_text(json.dumps(g))
    return dst


def test_tokenizer_mismatch_names_the_first_difference(tiny_dir, tmp_path):
    assert check_tokenizers(tiny_dir, tiny_dir) is None
    why = check_tokenizers(tiny_dir, other_tokenizer_copy(tiny_dir, tmp_path / "v", "vocab"))
    assert why is not None and "has id" in why and "(student)" in why and "(teacher)" in why
    why = check_tokenizers(tiny_dir, other_tokenizer_copy(tiny_dir, tmp_path / "e", "eos"))
    assert why is not None and "end-of-sequence id" in why


def test_cli_refuses_a_teacher_with_another_tokenizer_with_exit_2(tiny_dir, tmp_path):
    other = other_tokenizer_copy(tiny_dir, tmp_path / "teacher", "vocab")
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
                        f"teacher.hf_dir={other}", "trainer.recipe=opd", f"run.out_dir={tmp_path / 'out'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    line = [x for x in p.stderr.splitlines() if "teacher.hf_dir" in x]
    assert len(line) == 1 and str(other) in line[0] and str(tiny_dir) in line[0] and "has id" in line[0]
    m = tmp_path / "out" / "metrics.jsonl"
    assert not m.exists() or not m.read_text().strip()  # stopped before any step


# ---------------------------------------------------------------- the actor and the generators' client


@pytest.fixture(scope="module")
def teacher_mesh(tiny_dir, loop):
    from actors.teacher import TeacherActor

    yield from actor_spawner(TeacherActor, ["teacher.hf_dir=self", "teacher.max_sequences=64",
                                            f"generator.temperature={T}"], loop, "teacher")


def test_client_streams_to_the_teacher_actor_and_survives_its_sigkill(teacher_mesh, tiny_dir, loop):
    """Tokens fed one by one as vLLM's DELTA outputs arrive: after EOS only the last chunk is left,
    and the log-probs equal the one-shot ones. The actor's proc SIGKILLed mid-stream: finish waits,
    a successor takes the whole sequence; a sequence it cannot score fails that sample alone."""
    from pipeline.generator.reward_client import RewardModelClient

    ss = seqs(3, 20, 50, seed=9)
    ref = TeacherScorer(tiny_dir, temperature=T)

    async def go():
        t, info = await teacher_mesh()
        client = RewardModelClient(t, chunk_tokens=4, timeout_s=30, prefix="g0r0/", kind="teacher")
        out = []
        for k, s in enumerate(ss):
            prompt, gen = s[:5], s[5:]
            for i in range(1, len(gen) + 1):
                client.feed(f"t{k}", prompt, gen[:i])
            await client.flush(30)
            out.append(await client.finish(f"t{k}", s))
        stats = await t.stats.call_one()
        res = {"out": out, "stats": stats, "finish_tokens": client.counts["finish_tokens"]}
        with pytest.raises(RewardRejected) as e:
            await client.finish("oov", [5, 6, 100_000])
        res["failed"] = e.value.reason
        client.feed("k", ss[0][:12])
        await asyncio.sleep(0.5)
        os.kill(info["pid"], signal.SIGKILL)
        pending = asyncio.ensure_future(client.finish("k", ss[0]))
        await asyncio.sleep(2.0)
        res["waited"] = not pending.done()
        new, _ = await teacher_mesh(1)
        client.set_handle(new)
        res["after"] = await asyncio.wait_for(pending, 60)
        return res

    import monarch.actor

    faults, hook = [], monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append
    try:
        res = loop.run_until_complete(go())
    finally:
        monarch.actor.unhandled_fault_hook = hook
    whole = ref.logprobs(ss)
    for got, want in zip(res["out"], whole):
        assert torch.allclose(torch.tensor(got["logprobs"]), torch.tensor(want), atol=1e-5)
        assert len(got["top1"]) == len(want) and set(got["top1"]) <= {0, 1}
    assert res["stats"]["prefill_tokens"] > 0 and res["stats"]["held"] == 0
    assert res["finish_tokens"] < sum(len(s) for s in ss) / 2
    assert res["failed"] == "teacher_failed"
    assert res["waited"] and torch.allclose(torch.tensor(res["after"]["logprobs"]), torch.tensor(whole[0]), atol=1e-5)


# ---------------------------------------------------------------- a real run


@pytest.mark.slow
def test_cli_self_distillation_run_with_a_teacher_sigkill(tmp_path):
    """The default job with self-distillation mixed into its RL (opd+grpo, the answer in the
    teacher's context, streaming chunks of 4): every trained batch carries teacher log-probs and the
    distill metrics; the teacher's proc is SIGKILLed mid-run, the supervisor restarts it, and the
    run completes."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.steps=8", "run.eval_every=0",
           "run.warm_start_steps=0", f"run.out_dir={out}", "teacher.hf_dir=self", "teacher.chunk_tokens=4",
           "teacher.context=The answer is {answer}.", "trainer.recipe=opd+grpo", "run.progress=false"]
    rc, victim = run_and_kill(cmd, out, tmp_path / "log.txt", "teacher", 2)
    text = (tmp_path / "log.txt").read_text()
    assert rc == 0, text[-4000:]
    events = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    assert [e for e in events if e.get("teacher")], events
    assert json.loads((out / "placement.json").read_text())["teacher"]["pid"] != victim
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "distill/rkl" in r]
    assert len(trained) == 8 and all(r["distill/rkl"] == r["distill/rkl"] for r in trained)
    last = [r for r in rows if "teacher/restarts" in r][-1]
    assert last["teacher/restarts"] == 1.0 and 0 < last["teacher/overlap_frac"] <= 1
    assert 0 <= last["teacher/top1_agreement"] <= 1
    assert rows[-1]["step"] == 8


def test_expected_opd_gradient_equals_trl_gkd_reverse_kl_on_one_batch():
    """TRL's GKD with beta=1 (and lmbda=1: the student's own samples) minimises the full reverse KL
    KL(pi_s || pi_t) per position. Our loss uses one sampled token per position; its expectation over
    y ~ pi_s, enumerated exactly over a small vocabulary, has the same value and the same gradient
    (the score-function identity), on one batch in float64."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(7)
    n, t, v = 3, 5, 11
    s_logits = torch.randn(n, t, v, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    labels = torch.ones(n, t, dtype=torch.long)
    labels[0, 3:] = -100  # a shorter completion
    mask = (labels != -100).double()
    trl_loss = GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels, beta=1.0, temperature=T,
                                               num_items_in_batch=mask.sum())
    trl_loss.backward()
    trl_grad = s_logits.grad.clone()
    s_logits.grad = None

    # ours: every (position, token y) a loss token, weighted by pi_s(y) (detached): the exact expectation
    logp_all = torch.log_softmax(s_logits / T, -1)  # [n, t, v]
    lt = torch.log_softmax(t_logits / T, -1)
    p = logp_all.detach().exp()
    rows, old = logp_all.reshape(n * t, v), logp_all.detach().reshape(n * t, v)
    m = mask.reshape(n * t, 1).expand(n * t, v)
    adv = losses.token_advantages(torch.zeros(n * t, dtype=torch.float64), old, lt.reshape(n * t, v), m, 0.0, 1.0)
    adv = adv * p.reshape(n * t, v) * v  # token_mean over n·t·v tokens then sums pi_s(y)·(...) per position
    cfg = TrainerConfig(recipe="opd", correction="none")
    ours, _ = losses.policy_loss(rows, old, old, m, adv, cfg, denominators=(float(m.sum()), float(n * t)))
    ours.backward()
    assert torch.allclose(s_logits.grad, trl_grad, atol=1e-12, rtol=0)
    expected_rkl = (p * (logp_all.detach() - lt)).sum(-1)
    assert float((expected_rkl * mask).sum() / mask.sum()) == pytest.approx(float(trl_loss), abs=1e-12)


def test_a_truncated_or_unsupported_teacher_checkpoint_is_a_config_error_naming_the_key(tiny_dir, tmp_path):
    """Before anything starts: a teacher whose weights file is cut short, or whose family this build
    does not support, or a context naming a column the prompts lack, is a ConfigError naming the key."""
    from pipeline.driver.job import check_teacher
    from pipeline.models.hf import check_weights
    from pipeline.tasks import open_task

    trunc = other_tokenizer_copy(tiny_dir, tmp_path / "trunc", "none")
    w = next(trunc.glob("*.safetensors"))
    with open(w, "r+b") as f:
        f.truncate(w.stat().st_size // 3)
    assert "truncated" in check_weights(trunc) and check_weights(tiny_dir) is None
    fam = other_tokenizer_copy(tiny_dir, tmp_path / "fam", "none")
    conf = json.loads((fam / "config.json").read_text())
    conf["model_type"] = "gpt2"
    (fam / "config.json").write_text(json.dumps(conf))
    for d, why in ((trunc, "truncated"), (fam, "model_type='gpt2' is not supported")):
        cfg = load_config("configs/tiny.yaml", [f"teacher.hf_dir={d}", "trainer.recipe=opd"])
        with pytest.raises(ConfigError, match="teacher.hf_dir") as e:
            check_teacher(cfg, open_task(cfg.task, evaluate=False))
        assert why in str(e.value) and "\n" not in str(e.value)
    cfg = load_config("configs/tiny.yaml", ["teacher.hf_dir=self", "teacher.context=Hint {solution}"])
    with pytest.raises(ConfigError, match=r"teacher.context.*they have: answer, prompt"):
        check_teacher(cfg, open_task(cfg.task, evaluate=False))


def test_a_multi_turn_rollouts_environment_tokens_get_no_teacher_logprob():
    """The teacher reads the whole rollout (its prompt, model turns, observations); the rollout keeps
    its log-probs on the model's tokens only, aligned with completion_tokens, 0 on the environment's."""
    from types import SimpleNamespace

    from pipeline.generator.episode import Episodes
    from pipeline.generator.trajectory import Trajectory
    from pipeline.types import PromptGroup, PromptItem

    traj = Trajectory(PromptGroup(0, PromptItem(0, "q"), 1, 0), 0, (1, 2, 3), teacher_prompt=(1, 2, 3, 4, 5))
    traj.extend([10, 11], [-0.1, -0.2], [0, 0])
    traj.extend_env([20, 21, 22])
    traj.extend([12], [-0.3], [1])
    seq = traj.teacher_context()
    assert seq == [1, 2, 3, 4, 5, 10, 11, 20, 21, 22, 12]

    class Client:
        async def finish(self, key, tokens):
            assert tokens == seq
            return {"logprobs": [-float(i) for i in range(1, len(tokens))], "top1": [1] * (len(tokens) - 1)}

    eps = SimpleNamespace(teacher=Client(), teacher_counts={"tokens": 0, "top1": 0, "wait_s": 0.0, "scored": 0})
    out = asyncio.run(Episodes.teacher_logprobs(eps, traj, time.monotonic()))
    # token i of the sequence has log-prob -i (lps[i-1]); the completion starts at position 5
    assert out == (-5.0, -6.0, 0.0, 0.0, 0.0, -10.0)
    assert eps.teacher_counts["tokens"] == 3 and eps.teacher_counts["top1"] == 3
