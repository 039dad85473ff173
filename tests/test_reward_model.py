"""The reward model (pipeline/reward_model.py, actors/reward_model.py, pipeline/generator/reward_client.py):
streamed scores equal whole-sequence scores (and HF's own classifier forward), the actor on a real
Monarch proc with the generators' client, its faults (timeout, a sequence it cannot score, a killed
actor and its successor), config checks, and a short CLI run whose reward model is SIGKILLed.

    .venv/bin/python -m pytest -q tests/test_reward_model.py -x
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.reward_model import ScorerError, StreamingScorer, check_tokenizer, init_scorer
from pipeline.tasks import RewardRejected

from tests.conftest import REPO, actor_spawner, run_and_kill


@pytest.fixture(scope="module")
def scorer_dir(tiny_dir, tmp_path_factory):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return init_scorer(tiny_dir, tmp_path_factory.mktemp("scorer"), seed=1)


@pytest.fixture(scope="module")
def scorer(scorer_dir):
    return StreamingScorer(scorer_dir, max_sequences=3, max_batch=4)


def seqs(n: int, lo: int = 5, hi: int = 90, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 60) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def other_tokenizer_copy(scorer_dir, dst):
    """A copy of the scorer whose tokenizer has one token more than the policy's."""
    dst.mkdir()
    for f in scorer_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tj = json.loads((dst / "tokenizer.json").read_text())
    tj["model"]["vocab"]["zz"] = len(tj["model"]["vocab"])
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


# ---------------------------------------------------------------- the scorer


def test_streamed_score_equals_the_whole_sequence_score_and_hf_classifier_output(scorer, scorer_dir):
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(scorer_dir, dtype=torch.float32).eval()
    rng = random.Random(3)
    for k, seq in enumerate(seqs(6)):
        with torch.no_grad():  # HF's own classifier forward on the unpadded sequence: the reference
            ref = hf(input_ids=torch.tensor([seq])).logits[0, 0].item()
        whole = scorer.score([seq])[0]
        for chunk in (1, 3, 16, None):  # None: random cut points
            cuts = list(range(chunk, len(seq), chunk)) if chunk else sorted(rng.sample(range(1, len(seq)), 3))
            bounds = [0, *cuts]
            sid = f"s{k}-{chunk}"
            for a, b in zip(bounds, bounds[1:]):
                assert scorer.prefill(sid, a, seq[a:b])
            streamed = scorer.finish(sid, bounds[-1], seq[bounds[-1]:])
            assert streamed == pytest.approx(whole, abs=1e-5), (chunk, len(seq))
        assert whole == pytest.approx(ref, abs=1e-5)
    assert scorer.held == 0  # every finished stream was freed


def test_streams_of_different_lengths_batched_together_score_as_alone(scorer_dir):
    """The actor's path: many streams' chunks at once (caches left-padded to the longest, chunks
    right-padded, a stream's consecutive chunks joined), finishes and whole sequences mixed."""
    sc = StreamingScorer(scorer_dir, max_batch=3)
    rng = random.Random(7)
    data = seqs(7, 3, 70, seed=8)
    ops, sent = [], [0] * len(data)
    while any(sent[i] < len(s) for i, s in enumerate(data)):
        i = rng.randrange(len(data))
        s = data[i]
        if sent[i] >= len(s):
            continue
        n = rng.randint(1, 9)
        last = sent[i] + n >= len(s) and rng.random() < 0.7
        if last:
            ops.append(("finish", f"q{i}", sent[i], s[sent[i]:]))
            sent[i] = len(s)
        else:
            ops.append(("prefill", f"q{i}", sent[i], s[sent[i]:sent[i] + n]))
            sent[i] = min(len(s), sent[i] + n)
    ops += [("finish", f"q{i}", len(s), []) for i, s in enumerate(data)
            if not any(o[0] == "finish" and o[1] == f"q{i}" for o in ops)]  # all streamed: an empty last chunk
    cut = rng.randrange(1, len(ops))  # two rounds of the actor's queue
    res = sc.run(ops[:cut]) + sc.run(ops[cut:])
    scores = {o[1]: r for o, r in zip(ops, res) if o[0] == "finish"}
    assert all(r is True for o, r in zip(ops, res) if o[0] == "prefill")
    for i, s in enumerate(data):
        assert scores[f"q{i}"] == pytest.approx(sc.score([s])[0], abs=1e-5), i
    assert sc.held == 0 and sc.counts["lost"] == 0
    assert sc.counts["forwards"] < len(ops)  # batched: fewer forwards than operations


def test_a_padded_batch_scores_each_sequence_as_alone(scorer):
    batch = seqs(7, 2, 40, seed=5)
    together = scorer.score(batch)  # max_batch=4: two forwards, right-padded
    alone = [scorer.score([s])[0] for s in batch]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(x, 6) for x in together)) > 1  # the head is not constant: the check can fail


def test_a_stream_out_of_step_is_dropped_and_finish_asks_for_the_whole_sequence(scorer):
    s = seqs(1, 20, 20)[0]
    assert scorer.prefill("x", 0, s[:8])
    assert scorer.finish("x", 9, s[9:]) is None  # offset 9 but 8 prefilled: lost, state dropped
    assert scorer.finish("x", 8, s[8:]) is None  # and gone
    assert scorer.prefill("y", 0, s[:8]) and not scorer.prefill("y", 4, s[4:])
    lost = scorer.counts["lost"]
    for i in range(4):  # max_sequences=3: the least recently used goes
        scorer.prefill(f"e{i}", 0, s[:5])
    assert scorer.held == 3 and scorer.finish("e0", 5, s[5:]) is None and scorer.counts["lost"] == lost + 1
    assert scorer.finish("e3", 5, s[5:]) == pytest.approx(scorer.score([s])[0], abs=1e-5)
    assert scorer.release_prefix("e") == 2 and scorer.held == 0


@pytest.mark.parametrize("tokens,why", [([], "empty"), ([5, 10_000], "outside the reward model's vocabulary"),
                                        ([5] * 5000, "longer than the reward model's")])
def test_sequences_the_scorer_cannot_score_raise_naming_why(scorer, tokens, why):
    with pytest.raises(ScorerError, match=why):
        scorer.score([tokens])


def test_a_checkpoint_without_a_scalar_head_or_with_another_tokenizer_is_refused(tiny_dir, scorer_dir, tmp_path):
    with pytest.raises(ScorerError, match="num_labels=1"):
        StreamingScorer(tiny_dir)  # a causal LM: no scalar head
    other = other_tokenizer_copy(scorer_dir, tmp_path / "other")
    assert check_tokenizer(tiny_dir, scorer_dir) is None
    assert "tokenizer differs" in check_tokenizer(tiny_dir, other)


def test_config_checks_reward_model_keys(scorer_dir, tmp_path):
    cfg = load_config(None, [f"reward_model.path={scorer_dir}", "reward_model.chunk_tokens=0"])
    assert cfg.reward_model.path == str(scorer_dir.resolve())
    for ov, key in [(f"reward_model.path={tmp_path}", "reward_model.path"),
                    (f"reward_model.path={scorer_dir}|reward_model.weight=0", "reward_model.weight"),
                    ("reward_model.chunk_tokens=-1", "reward_model.chunk_tokens"),
                    ("reward_model.timeout_s=0", "reward_model.timeout_s"),
                    ("reward_model.max_batch=0", "reward_model.max_batch"),
                    ("reward_model.device=tpu", "reward_model.device"),
                    ("reward_model.weight=nan", "reward_model.weight")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ov.split("|"))


def test_cli_refuses_a_reward_model_with_another_tokenizer_with_exit_2(scorer_dir, tmp_path):
    other = other_tokenizer_copy(scorer_dir, tmp_path / "rm")
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
                        f"reward_model.path={other}", f"run.out_dir={tmp_path / 'out'}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "reward_model.path" in p.stderr and "tokenizer differs" in p.stderr


# ---------------------------------------------------------------- the actor and the generators' client


@pytest.fixture(scope="module")
def rm_mesh(scorer_dir, loop):
    """A spawner of reward-model actors on real procs; every proc it made is stopped at the end."""
    from actors.reward_model import RewardModelActor

    yield from actor_spawner(RewardModelActor, [f"reward_model.path={scorer_dir}", "reward_model.max_sequences=64"],
                             loop, "rm")


def test_client_streams_chunks_to_the_actor_and_gets_the_whole_sequence_score(rm_mesh, scorer, loop):
    from pipeline.generator.reward_client import RewardModelClient

    async def go():
        rm, _ = await rm_mesh()
        client = RewardModelClient(rm, chunk_tokens=4, timeout_s=30, prefix="g0r0/")
        out = {}
        for k, seq in enumerate(seqs(5, 6, 50, seed=9)):
            prompt, gen = seq[:5], seq[5:]
            for i in range(1, len(gen) + 1):  # tokens arriving one by one, as vLLM's DELTA outputs
                client.feed(f"t{k}", prompt, gen[:i])
            # decoding takes longer than a chunk's prefill: without this wait the actor may find the chunks
            # and the finish queued together and score the sequence whole (no prefill counted)
            await client.flush(30)
            out[k] = (await client.finish(f"t{k}", seq), seq)
        stats = await rm.stats.call_one()
        return client, out, stats

    client, out, stats = loop.run_until_complete(go())
    for score, seq in out.values():
        assert score == pytest.approx(scorer.score([seq])[0], abs=1e-5)
    assert client.counts["chunks"] >= 5 and client.counts["resent_whole"] == 0
    assert stats["prefill_tokens"] > 0 and stats["held"] == 0 and stats["lost"] == 0
    # the last chunk only was prefilled after EOS: fewer tokens than the sequences
    assert client.counts["finish_tokens"] < sum(len(s) for _, s in out.values()) / 2


def test_reward_model_faults_fail_the_sample_alone_and_a_killed_actor_is_replaced(rm_mesh, scorer, loop):
    from pipeline.generator.reward_client import RewardModelClient

    seq = seqs(1, 30, 30, seed=11)[0]

    async def go():
        rm, info = await rm_mesh(1)
        res = {}
        bad = RewardModelClient(rm, 4, 30, "g1r0/")
        with pytest.raises(RewardRejected) as e:
            await bad.finish("oov", [5, 6, 100_000])  # outside the vocabulary: that sample fails
        res["failed"] = e.value.reason
        hurried = RewardModelClient(rm, 0, 1e-4, "g1r0/")
        for attempt in range(5):  # an event loop starved past the reply's arrival runs the reply before the
            try:                  # timer (asyncio takes I/O first): that score is in time; ask again
                await hurried.finish(f"slow{attempt}", seq)
            except RewardRejected as e:
                res["timeout"] = e.reason
                break
        res["after"] = await bad.finish("ok", seq)  # the actor serves on
        # SIGKILL the actor's proc while a stream is half sent; its finish waits for a successor
        client = RewardModelClient(rm, 4, 60, "g1r0/")
        client.feed("k", seq[:12])
        await asyncio.sleep(0.5)
        os.kill(info["pid"], signal.SIGKILL)
        pending = asyncio.ensure_future(client.finish("k", seq))
        await asyncio.sleep(2.0)
        res["waited"] = not pending.done()
        new, _ = await rm_mesh(2)
        client.set_handle(new)
        res["score"] = await asyncio.wait_for(pending, 60)
        res["resent"] = client.counts["resent_whole"]
        gone = RewardModelClient(rm, 4, 2.0, "g1r0/")  # nobody replaces this one's actor
        with pytest.raises(RewardRejected) as e:
            await gone.finish("z", seq)
        res["unavailable"] = e.value.reason
        return res

    import monarch.actor

    faults, hook = [], monarch.actor.unhandled_fault_hook
    monarch.actor.unhandled_fault_hook = faults.append  # as the controller's: a dead mesh is reported, not fatal
    try:
        res = loop.run_until_complete(go())
    finally:
        monarch.actor.unhandled_fault_hook = hook
    assert res["failed"] == "reward_model_failed" and res.get("timeout") == "reward_model_timeout"
    assert res["after"] == pytest.approx(scorer.score([seq])[0], abs=1e-5)
    assert res["waited"] and res["score"] == pytest.approx(scorer.score([seq])[0], abs=1e-5)
    assert res["unavailable"] in ("reward_model_unavailable", "reward_model_timeout")


# ---------------------------------------------------------------- a real run


@pytest.mark.slow
def test_cli_run_scores_with_the_reward_model_and_survives_its_sigkill(scorer_dir, tmp_path):
    """The default job with a reward model (streaming, chunks of 4): its proc is SIGKILLed mid-run;
    the supervisor restarts it, scores in flight wait for the new one, and the run completes."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.steps=14", "run.eval_every=0",
           "run.warm_start_steps=15", f"run.out_dir={out}", f"reward_model.path={scorer_dir}", "reward_model.chunk_tokens=4",
           "reward_model.task_weight=0.5", "run.progress=false"]
    rc, victim = run_and_kill(cmd, out, tmp_path / "log.txt", "reward_model", 3)
    text = (tmp_path / "log.txt").read_text()
    assert rc == 0, text[-4000:]
    events = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    rm_events = [e for e in events if e.get("reward_model")]
    assert len(rm_events) == 1 and rm_events[0]["recovery_s"] > 0, events
    assert json.loads((out / "placement.json").read_text())["reward_model"]["pid"] != victim
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "reward_model/restarts" in r][-1]
    assert last["reward_model/restarts"] == 1.0 and last["reward_model/chunks"] > 0
    assert last.get("rejected/recent_frac", 0.0) <= 0.2  # the restart cost latency, not the run
    assert rows[-1]["step"] == 14
