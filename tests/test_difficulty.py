"""DifficultyFilter (online difficulty filtering): set aside, retry, never starve, epochs, state.

    .venv/bin/python -m pytest -q tests/test_difficulty.py
"""

from __future__ import annotations

import json
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig, ConfigError
from pipeline.difficulty import MAX_DOUBLINGS, DifficultyFilter
from pipeline.tasks import PromptStream, Task
from pipeline.types import PromptItem, Rollout

REPO = Path(__file__).resolve().parents[1]
FLAT1, FLAT0, SPREAD = [1.0] * 4, [0.0] * 4, [0.0, 1.0, 1.0, 0.0]


def list_task(prompts: list[str]) -> Task:
    items = tuple(PromptItem(uid=i, prompt=p) for i, p in enumerate(prompts))
    return Task(name="list", prompts=lambda seed, split: items, reward_fn=lambda p, c: 0.0)


def test_flat_groups_set_a_prompt_aside_and_it_is_retried_with_doubling_waits():
    f = DifficultyFilter(set_aside_after=2, retry_after=3)
    f.observe("a", FLAT1, version=0)
    assert f.admit("a", 1)  # one flat group is not enough
    f.observe("a", FLAT1, version=1)
    assert f.aside_now == 1 and f.stats()["prompts_set_aside"] == 1
    assert not f.admit("a", 1) and not f.admit("a", 3)  # aside until 1 + 3
    assert f.admit("b", 3)  # other prompts are untouched
    assert f.admit("a", 4) and f.stats()["prompts_retried"] == 1 and f.aside_now == 0
    f.observe("a", FLAT1, version=5)  # the retry is flat again: aside for twice as long
    assert not f.admit("a", 5 + 2 * 3 - 1) and f.admit("a", 5 + 2 * 3)
    waits = []
    for k in range(2, 8):  # the wait doubles up to 2^MAX_DOUBLINGS
        f.observe("a", FLAT1, version=100 * k)
        until = f._entries["a"].until
        waits.append(until - 100 * k)
        assert f.admit("a", until)
    assert waits == [3 * 2 ** min(k, MAX_DOUBLINGS) for k in range(2, 8)]
    assert f.stats()["prompts_skipped"] == 3


def test_a_reward_spread_forgets_the_prompt_and_chat_prompts_are_keyed_by_content():
    f = DifficultyFilter(set_aside_after=1, retry_after=10)
    chat = [{"role": "user", "content": "hi"}]
    f.observe(chat, FLAT0, version=0)
    assert not f.admit([{"content": "hi", "role": "user"}], 1)  # same messages, other key order
    assert f.admit(chat, 10)
    f.observe(chat, SPREAD, version=10)
    assert f.stats()["prompts_retried_with_signal"] == 1 and not f._entries
    f.observe(chat, FLAT0, version=11)  # a fresh streak: first set-aside again, not a doubled one
    assert f._entries[("messages", '[{"content": "hi", "role": "user"}]')].until == 21


def test_filter_off_admits_everything_and_the_buffer_counts_evidence_in_samples():
    f = DifficultyFilter(set_aside_after=0, retry_after=1)
    for v in range(5):
        f.observe("a", FLAT1, v)
    assert f.admit("a", 5) and f.stats()["prompts_aside"] == 0 and f.stats()["groups_observed"] == 5
    assert not ReplayBufferCore(BufferConfig(set_aside_samples=0), pad_id=0).difficulty.enabled
    # on by default: 16 samples, i.e. 2 flat groups of 8, 8 of 2, 1 of 16 or more
    assert [ReplayBufferCore(BufferConfig(group_size=g), pad_id=0).difficulty.after for g in (8, 2, 16, 32, 5)] == \
        [2, 8, 1, 1, 4]
    with pytest.raises(ConfigError, match="buffer.set_aside_samples"):
        BufferConfig(set_aside_samples=-1)
    with pytest.raises(ConfigError, match="buffer.retry_after"):
        BufferConfig(retry_after=0)


def test_only_a_streak_at_one_reward_sets_a_prompt_aside():
    f = DifficultyFilter(set_aside_after=2, retry_after=5)
    f.observe("a", FLAT0, 0)
    f.observe("a", FLAT1, 1)  # never solved, then always: it is learning, not stuck
    assert f.admit("a", 2) and f.aside_now == 0
    f.observe("a", FLAT1, 2)
    assert not f.admit("a", 3) and f.aside_now == 1


def test_every_prompt_set_aside_never_starves_the_draw_and_says_so(caplog):
    prompts = [f"p{i}" for i in range(6)]
    f = DifficultyFilter(set_aside_after=1, retry_after=1000)
    for i, p in enumerate(prompts):
        f.observe(p, FLAT1 if i % 2 else FLAT0, version=0)
    stream = PromptStream(list_task(prompts), seed=0)
    with caplog.at_level(logging.WARNING, logger="pipeline.difficulty"):
        item = f.draw(stream, version=1)
    assert item is not None and stream.progress() == (2 * 6 + 2) / 6  # 2·6 + 1 skips, then one admitted
    assert f.saturated and f.stats()["prompts_forced"] == 1 and f.stats()["prompts_skipped"] == 13
    assert "every prompt drawn lately is set aside (6 prompts: 3 at reward 1, 3 at reward 0" in caplog.text
    drawn = [f.draw(stream, version=1).prompt for _ in range(12)]  # saturated: every draw admitted
    assert len(drawn) == 12 and stream.progress() == (4 * 6 + 2) / 6  # no skip
    f.observe("p0", SPREAD, version=2)  # a spread: filtering resumes
    assert not f.saturated and f.aside_now == 5
    f.observe("p0", FLAT0, version=2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.difficulty"):
        f.draw(stream, version=3)  # saturated again soon after: said at INFO, not warned again
    assert f.saturated and f.stats()["filter_saturations"] == 2
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_a_finite_split_is_still_served_whole_every_epoch_and_nothing_starves():
    """10 prompts: 3 always solved, 2 never, 5 with a spread, through the real buffer and stream.
    Every epoch still passes over every prompt, set-aside ones come back, signal share rises."""
    prompts = [f"q{i}" for i in range(10)]
    rewards = {p: FLAT1 if i < 3 else FLAT0 if i < 5 else SPREAD for i, p in enumerate(prompts)}

    def run(set_aside_samples: int, steps: int = 60) -> tuple[ReplayBufferCore, list[tuple[int, str]]]:
        buf = ReplayBufferCore(BufferConfig(group_size=4, batch_groups=2, overcommit="none",
                                            set_aside_samples=set_aside_samples, retry_after=5), pad_id=0)
        stream, admitted = PromptStream(list_task(prompts), seed=1), []
        for step in range(steps):
            while buf.can_admit():
                g = buf.admit(buf.difficulty.draw(stream, buf.version))
                admitted.append((step, g.item.prompt))
                for i, r in enumerate(rewards[g.item.prompt]):
                    buf.add(Rollout(group_id=g.group_id, sample_idx=i, prompt=g.item.prompt, prompt_tokens=(1,),
                                    completion="c", completion_tokens=(2,), logprobs=(-1.0,), versions=(step,),
                                    finish_reason="stop", reward=r))
            buf.take_batch()
            buf.set_trainer_version(step + 1)
            buf.check_accounting()
        return buf, admitted

    off, admitted_off = run(0)
    on, admitted = run(8)  # 2 groups of 4
    s = on.stats()
    assert s["prompts_set_aside"] >= 5 and s["prompts_retried"] >= 5 and s["prompts_skipped"] > 0
    share = lambda adm: sum(rewards[p] is SPREAD for _, p in adm) / len(adm)  # noqa: E731
    assert share(admitted) > share(admitted_off) + 0.2  # batches prefer prompts with signal
    assert s["signal_share"] > off.stats()["signal_share"] + 0.2
    for p in prompts:  # nothing starves: each comes back within its longest wait plus an epoch
        steps = [st for st, q in admitted if q == p]
        gaps = [b - a for a, b in zip([0, *steps], [*steps, 60])]
        assert max(gaps) <= 5 * 2 ** MAX_DOUBLINGS + 10, (p, steps)
    assert not on.difficulty.saturated


def test_state_round_trips_through_the_buffer_checkpoint_and_old_checkpoints_load():
    f = DifficultyFilter(set_aside_after=1, retry_after=4)
    for i in range(5):
        f.observe(f"p{i}", FLAT1, version=i)
    f.observe("p4", SPREAD, version=5)
    f.admit("p0", 10)  # p0 retried
    for _ in range(3):
        f.admit("p1", 0)
    g = DifficultyFilter(set_aside_after=1, retry_after=4)
    g.load_state_dict(pickle.loads(pickle.dumps(f.state_dict())))  # checkpoints pickle it
    assert g.stats() == f.stats()
    for p, v in [("p1", 4), ("p1", 6), ("p2", 5), ("p0", 5), ("p4", 0), ("p9", 0)]:
        assert g.admit(p, v) == f.admit(p, v), (p, v)
    buf = ReplayBufferCore(BufferConfig(group_size=8), pad_id=0)
    buf.difficulty.observe("x", [1.0] * 8, 0)
    buf.difficulty.observe("x", [1.0] * 8, 0)
    state = buf.state_dict()
    restored = ReplayBufferCore(BufferConfig(group_size=8), pad_id=0)
    restored.load_state_dict(state)
    assert not restored.difficulty.admit("x", 1) and restored.stats()["prompts_set_aside"] == 1
    del state["difficulty"]  # a checkpoint from before the filter
    old = ReplayBufferCore(BufferConfig(group_size=8), pad_id=0)
    old.load_state_dict(state)
    assert old.difficulty.admit("x", 1) and old.stats()["prompts_set_aside"] == 0


def test_tracked_prompts_are_bounded(monkeypatch):
    monkeypatch.setattr("pipeline.difficulty.MAX_TRACKED", 3)
    f = DifficultyFilter(set_aside_after=1, retry_after=100)
    for i in range(5):
        f.observe(f"p{i}", FLAT0, version=0)
    assert list(f._entries) == ["p2", "p3", "p4"] and f.aside_now == 3
    assert f.admit("p0", 1) and not f.admit("p4", 1)  # the least recently seen are forgotten


def test_cli_run_sets_aside_prompts_that_always_pay_the_same_and_retries_them(tmp_path):
    """A real run (tests/filter_task.py: 4 of 8 prompts always pay 1.0): the flat ones are set aside
    after 2 groups of 4, passed over, and retried 4 steps later, as the per-step metrics show; the others keep
    coming, so batches keep their signal."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.steps=16",
                        "run.eval_every=0", "run.warm_start_steps=0", "run.checkpoint_every=0", "run.progress=false",
                        "buffer.batch_groups=2", "buffer.group_size=4", "buffer.overcommit=none",
                        "buffer.set_aside_samples=8", "buffer.retry_after=4", "generator.concurrency=8",
                        "generator.max_new_tokens=4", "task.name=tests.filter_task", f"run.out_dir={out}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "buffer/prompts_set_aside" in r]
    assert len(steps) == 16
    last = steps[-1]
    assert last["buffer/prompts_set_aside"] >= 2 and last["buffer/prompts_retried"] >= 1, last
    assert last["buffer/prompts_skipped"] >= 1 and 0 < last["buffer/signal_share"] < 1, last
    assert last["buffer/filter_saturated"] == 0.0
    # prompts with signal fill the batches once the flat ones are set aside
    assert sum(r["groups/zero_variance_frac"] for r in steps[-4:]) / 4 < 0.5
