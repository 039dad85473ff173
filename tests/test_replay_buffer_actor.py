"""ReplayBufferActor on real Monarch procs (one module-scoped proc mesh, one actor per test).

    .venv/bin/python -m pytest -q tests/test_replay_buffer_actor.py
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from monarch.actor import this_host

from actors.replay_buffer import ReplayBufferActor
from pipeline.config import BufferConfig, Config
from pipeline.tasks import load_task, take
from pipeline.types import Batch, PromptGroup, Rollout

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def procs():
    p = this_host().spawn_procs(per_host={"procs": 1})
    yield p
    p.stop().get()


def spawn(procs, name: str, **buffer):
    cfg = Config(buffer=BufferConfig(**{**dict(group_size=2, batch_groups=2, overcommit="none"), **buffer}))
    return procs.spawn(name, ReplayBufferActor, cfg, 0)


def rollout(g: PromptGroup, idx: int, *, version: int = 0, n: int = 2) -> Rollout:
    return Rollout(group_id=g.group_id, sample_idx=idx, prompt=g.item.prompt, prompt_tokens=(7, 8, 9),
                   completion=g.item.answer, completion_tokens=(3,) * n, logprobs=(-0.1,) * n,
                   versions=(version,) * n, finish_reason="stop", reward=float(idx))


def complete(buf, g: PromptGroup, version: int = 0) -> None:
    for i in range(g.group_size):
        buf.add.call_one(rollout(g, i, version=version)).get()


def test_actor_serves_task_prompts_batches_and_rejects_bad_rollouts(procs):
    buf = spawn(procs, "buf_basic")
    groups = [buf.admit.call_one().get() for _ in range(2)]
    assert buf.admit.call_one().get() is None  # B + Δ = 2 groups in flight
    expected = take(load_task("pipeline.tasks.reverse"), 0, "train", 2)
    assert [g.item for g in groups] == expected and [g.group_id for g in groups] == [0, 1]
    with pytest.raises(Exception, match="length_mismatch"):
        buf.add.call_one(replace(rollout(groups[0], 0), logprobs=(-0.1,))).get()
    with pytest.raises(Exception, match="future_version"):
        buf.add.call_one(rollout(groups[0], 0, version=1)).get()
    for g in groups:
        complete(buf, g)
    batch = buf.get_batch.call_one(0, 10.0).get()
    assert isinstance(batch, Batch) and batch.num_samples == 4 and batch.group_ids == (0, 0, 1, 1)
    assert batch.advantages.tolist() == pytest.approx([-0.7071, 0.7071] * 2, rel=1e-3)
    s = buf.stats.call_one().get()
    assert s["rejected"] == {"length_mismatch": 1, "future_version": 1} and s["trained_samples"] == 4
    assert s["held_samples"] == 0 and s["admitted_samples"] == 4


def test_get_batch_and_admit_wait_on_events_while_adds_arrive(procs):
    buf = spawn(procs, "buf_wait", batch_groups=1)
    g0 = buf.admit.call_one().get()
    pending_admit = buf.admit.call_one(10.0)  # blocks: B + Δ = 1 group is already held
    pending_batch = buf.get_batch.call_one(0, 10.0)  # blocks until g0 completes
    time.sleep(0.3)
    complete(buf, g0)  # add is served while both waits are parked on the condition
    batch = pending_batch.get()
    assert batch.group_ids == (g0.group_id,) * 2
    g1 = pending_admit.get()  # taking the batch freed a slot, which woke the admit
    assert isinstance(g1, PromptGroup) and g1.group_id == 1
    s = buf.stats.call_one().get()
    assert s["trainer_wait_s_last"] >= 0.2 and s["held_groups"] == 1


def test_get_batch_timeout_names_how_many_groups_were_ready(procs):
    buf = spawn(procs, "buf_timeout")
    g = buf.admit.call_one().get()
    complete(buf, g)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="1 of 2 groups ready, 0 in flight"):
        buf.get_batch.call_one(0, 0.3).get()
    assert time.monotonic() - t0 >= 0.3  # it waited its timeout, then named what was ready
    assert buf.admit.call_one().get() is not None  # the actor is still alive and serving


def test_set_zero_signal_turns_dynamic_sampling_on_at_runtime(procs):
    buf = spawn(procs, "buf_zero_signal", zero_signal="auto")

    def flat(g: PromptGroup) -> None:
        for i in range(g.group_size):
            buf.add.call_one(replace(rollout(g, i), reward=1.0)).get()

    flat(buf.admit.call_one().get())  # auto starts at keep
    assert buf.set_zero_signal.call_one("drop").get() == "drop"
    flat(buf.admit.call_one().get())
    s = buf.stats.call_one().get()
    assert s["zero_signal_mode"] == "drop" and s["complete_groups"] == 1 and s["dropped_groups"] == {"zero_signal": 1}
    with pytest.raises(Exception, match="allowed: 'keep', 'drop'"):
        buf.set_zero_signal.call_one("sometimes").get()
    assert buf.stats.call_one().get()["zero_signal_mode"] == "drop"  # the actor still serves


def test_state_dict_restores_prompt_position_and_counters(procs):
    a = spawn(procs, "buf_ckpt_a")
    a.admit.call_one().get()
    a.finish_step.call_one(0, 0.5).get()
    state = a.state_dict.call_one().get()
    nxt = a.admit.call_one().get()
    b = spawn(procs, "buf_ckpt_b")
    b.load_state_dict.call_one(state).get()
    requeued = b.admit.call_one().get()  # the group in flight at the save is handed out again first
    assert requeued.group_id == 0
    restored = b.admit.call_one().get()
    assert restored.item == nxt.item and restored.group_id == nxt.group_id
    s = b.stats.call_one().get()
    assert s["dropped_groups"] == {} and s["admitted_samples"] == 4 and s["held_samples"] == 4


def test_end_of_data_trains_every_full_batch_then_get_batch_returns_none(procs, tmp_path):
    """A finite task with run.epochs=1: 5 prompts, B=2. Two full batches are trained; once the stream
    ends, admit hands out nothing and a waiting get_batch returns None (not a timeout) as soon as the
    last in-flight group completes, leaving one group (fewer than B) untrained."""
    from pipeline.config import RunConfig, TaskConfig

    data = tmp_path / "five.jsonl"
    words = "abc bad cab dab fed".split()
    data.write_text("".join(f'{{"prompt": "rev {w}=", "answer": "{w[::-1]}"}}\n' for w in words))
    cfg = Config(buffer=BufferConfig(group_size=2, batch_groups=2, overcommit="none"), run=RunConfig(epochs=1),
                 task=TaskConfig(name="pipeline.tasks.jsonl", path=str(data)))
    buf = procs.spawn("buf_end_of_data", ReplayBufferActor, cfg, 0)
    prompts = []
    for v in range(2):
        groups = [buf.admit.call_one().get() for _ in range(2)]
        prompts += [g.item.prompt for g in groups]
        for g in groups:
            complete(buf, g, version=v)
        assert buf.get_batch.call_one(v, 10.0).get().num_samples == 4
        buf.finish_step.call_one(v + 1, 0.5).get()
    last = buf.admit.call_one().get()
    assert buf.admit.call_one(0.2).get() is None  # the stream ended: nothing new, and no busy wait
    prompts.append(last.item.prompt)
    assert sorted(prompts) == sorted(f"rev {w}=" for w in words)  # each prompt once
    pending = buf.get_batch.call_one(2, 30.0)
    time.sleep(0.3)
    complete(buf, last, version=2)
    assert pending.get() is None  # the end of the stream answers the waiting get_batch (its timeout is 30 s)
    s = buf.stats.call_one().get()
    assert s["data_epoch"] == 1.0 and s["data_exhausted"] and s["trained_samples"] == 8 and s["held_samples"] == 2
