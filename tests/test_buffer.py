"""ReplayBufferCore: grouping, advantages, batch layout, rejection, staleness, admission, deferral.

    .venv/bin/python -m pytest -q tests/test_buffer.py
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.advantages import group_advantages
from pipeline.buffer import ReplayBufferCore, RolloutRejected
from pipeline.config import BufferConfig
from pipeline.types import PromptItem, Rollout

PAD = 99


def cfg(**kw) -> BufferConfig:
    base = dict(group_size=2, batch_groups=2, max_staleness=1, overcommit="none")
    return BufferConfig(**{**base, **kw})


def rollout(gid: int, idx: int, *, reward: float = 0.0, versions=(0, 0), n: int | None = None,
            prompt=(5, 6), **kw) -> Rollout:
    n = len(versions) if n is None else n
    base = dict(group_id=gid, sample_idx=idx, prompt="p", prompt_tokens=tuple(prompt), completion="c",
                completion_tokens=tuple(range(10, 10 + n)), logprobs=tuple(-0.5 - k for k in range(n)),
                versions=tuple(versions), finish_reason="stop", reward=reward)
    return Rollout(**{**base, **kw})


def admit(buf: ReplayBufferCore, n: int = 1) -> list[int]:
    return [buf.admit(PromptItem(uid=buf.admitted_groups, prompt="p")).group_id for _ in range(n)]


def fill(buf: ReplayBufferCore, gid: int, rewards=None, versions=(0, 0)) -> None:
    rewards = rewards or [float(i) for i in range(buf.cfg.group_size)]
    for i, r in enumerate(rewards):
        buf.add(rollout(gid, i, reward=r, versions=versions))


def test_group_advantages_mean_and_std():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], False) == [0.5, -0.5, -0.5, 0.5]
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], True)
    std = math.sqrt(4 * 0.25 / 3)
    assert adv == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)


def test_batch_layout_right_padded_with_masks_versions_and_advantages():
    buf = ReplayBufferCore(cfg(normalize_std=False), pad_id=PAD)
    g0, g1 = admit(buf, 2)
    buf.add(rollout(g0, 1, reward=1.0, versions=(0,), prompt=(1, 2, 3)))
    buf.add(rollout(g0, 0, reward=0.0, versions=(0, 0, 0)))
    fill(buf, g1, [2.0, 4.0])
    b = buf.take_batch()
    assert b.input_ids.shape == (4, 5) and b.group_ids == (g0, g0, g1, g1)
    assert b.input_ids[0].tolist() == [5, 6, 10, 11, 12]
    assert b.input_ids[1].tolist() == [1, 2, 3, 10, PAD]  # sample_idx order, right-padded
    assert b.loss_mask[1].tolist() == [0, 0, 0, 1, 0]
    assert b.behaviour_logprobs[0].tolist() == [0, 0, -0.5, -1.5, -2.5]
    assert b.versions[1].tolist() == [-1, -1, -1, 0, -1]
    assert b.advantages.tolist() == [-0.5, 0.5, -1.0, 1.0]
    assert b.rewards.tolist() == [0.0, 1.0, 2.0, 4.0]
    assert b.trainer_version == 0 and b.num_tokens == 3 + 1 + 2 + 2


def test_zero_signal_group_is_counted_and_kept_or_dropped():
    keep = ReplayBufferCore(cfg(zero_signal="keep"), PAD)
    drop = ReplayBufferCore(cfg(zero_signal="drop"), PAD)
    for buf in (keep, drop):
        (g,) = admit(buf)
        fill(buf, g, [1.0, 1.0])
        assert buf.zero_signal_groups == 1
        buf.check_accounting()
    assert keep.stats()["complete_groups"] == 1 and keep._complete[0].advantages == [0.0, 0.0]
    assert drop.stats()["complete_groups"] == 0 and drop.dropped_groups == {"zero_signal": 1}
    with pytest.raises(ValueError, match="group_size=1"):
        ReplayBufferCore(cfg(zero_signal="drop", group_size=1), PAD)


def test_auto_keeps_flat_groups_until_switched_to_drop_at_runtime():
    buf = ReplayBufferCore(cfg(zero_signal="auto"), PAD)
    assert buf.stats()["zero_signal_mode"] == "keep"
    g0, g1 = admit(buf, 2)
    fill(buf, g0, [1.0, 1.0])
    buf.set_zero_signal("drop")  # the pre-flight probe chose dynamic sampling
    fill(buf, g1, [0.0, 0.0])
    assert buf._complete[g0].advantages == [0.0, 0.0]  # finished before the switch: kept, not revisited
    assert g1 not in buf._complete and buf.dropped_groups == {"zero_signal": 1} and buf.zero_signal_groups == 2
    assert buf.stats()["zero_signal_mode"] == "drop"
    buf.check_accounting()
    buf.set_zero_signal("keep")
    (g2,) = admit(buf)
    fill(buf, g2, [1.0, 1.0])
    assert g2 in buf._complete


def test_set_zero_signal_refuses_to_override_an_explicit_setting_or_drop_everything():
    with pytest.raises(ValueError, match="only 'auto' is switched"):
        ReplayBufferCore(cfg(zero_signal="keep"), PAD).set_zero_signal("drop")
    ReplayBufferCore(cfg(zero_signal="drop"), PAD).set_zero_signal("drop")  # what it already is: fine
    with pytest.raises(ValueError, match="allowed: 'keep', 'drop'"):
        ReplayBufferCore(cfg(zero_signal="auto"), PAD).set_zero_signal("auto")
    single = ReplayBufferCore(cfg(zero_signal="auto", group_size=1), PAD)  # auto at G=1 is keep, not an error
    (g,) = admit(single)
    fill(single, g, [1.0])
    assert g in single._complete
    with pytest.raises(ValueError, match="group_size=1"):
        single.set_zero_signal("drop")


def test_auto_mode_is_kept_across_a_checkpoint_unless_the_config_names_one():
    buf = ReplayBufferCore(cfg(zero_signal="auto"), PAD)
    buf.set_zero_signal("drop")
    state = buf.state_dict()
    resumed = ReplayBufferCore(cfg(zero_signal="auto"), PAD)
    resumed.load_state_dict(state)
    assert resumed.zero_signal_mode == "drop"
    explicit = ReplayBufferCore(cfg(zero_signal="keep"), PAD)
    explicit.load_state_dict(state)
    assert explicit.zero_signal_mode == "keep"
    old = {k: v for k, v in state.items() if k != "zero_signal_mode"}  # a checkpoint from before auto
    before = ReplayBufferCore(cfg(zero_signal="auto"), PAD)
    before.load_state_dict(old)
    assert before.zero_signal_mode == "keep"


def _snapshot(buf: ReplayBufferCore) -> tuple:
    s = buf.stats()
    s.pop("rejected")
    return s, {k: dict(g.samples) for k, g in buf._in_flight.items()}


@pytest.mark.parametrize("reason,bad", [
    ("length_mismatch", rollout(0, 0, logprobs=(-1.0,))),
    ("length_mismatch", rollout(0, 0, versions=(0, 0, 0), n=2)),
    ("nan_reward", rollout(0, 0, reward=float("nan"))),
    ("invalid", rollout(0, 0, prompt=())),
    ("unknown_group", rollout(7, 0)),
    ("future_version", rollout(0, 0, versions=(0, 1))),
    ("bad_sample_idx", rollout(0, 2)),
    ("duplicate_sample", rollout(0, 1)),
])
def test_bad_rollout_is_rejected_counted_and_leaves_state_unchanged(reason, bad):
    buf = ReplayBufferCore(cfg(), PAD)
    admit(buf, 2)
    buf.add(rollout(0, 1, reward=1.0))
    before = _snapshot(buf)
    with pytest.raises(RolloutRejected, match=reason) as e:
        buf.add(bad)
    assert isinstance(e.value, ValueError) and e.value.reason == reason
    assert buf.rejected == {reason: 1}
    assert _snapshot(buf) == before


def test_stale_group_dropped_whole_and_late_samples_ignored():
    buf = ReplayBufferCore(cfg(max_staleness=1, batch_groups=1), PAD)
    (g,) = admit(buf)
    buf.add(rollout(g, 0, versions=(0, 0)))
    buf.set_trainer_version(1)
    assert buf.held_groups == 1  # staleness 1 is allowed
    buf.set_trainer_version(2)
    assert buf.held_groups == 0 and buf.dropped_groups == {"stale": 1}
    buf.add(rollout(g, 1, versions=(2, 2)))  # the generator finishing its work is not an error
    assert buf.late_rollouts == 1
    with pytest.raises(RolloutRejected, match="unknown_group"):
        buf.add(rollout(g, 1, versions=(2, 2)))  # but a second copy is
    assert buf.can_admit()  # the dropped group's slot came back
    buf.check_accounting()


def test_sample_arriving_stale_drops_its_group():
    buf = ReplayBufferCore(cfg(max_staleness=0, batch_groups=1), PAD)
    fill(buf, admit(buf)[0])
    buf.take_batch()
    buf.set_trainer_version(1)
    (g,) = admit(buf)
    buf.add(rollout(g, 0, versions=(0, 1)))  # a lagging generator: one token from version 0
    assert buf.dropped_groups == {"stale": 1} and buf.held_groups == 0


def test_overcommit_hands_first_B_completed_and_defers_the_rest():
    buf = ReplayBufferCore(cfg(batch_groups=2, overcommit="fixed", delta=2, max_staleness=3), PAD)
    gids = admit(buf, 4)
    assert not buf.can_admit()  # B + Δ in flight
    fill(buf, gids[3])
    buf.add(rollout(gids[0], 0, reward=1.0))  # gids[0] started first but is not done
    fill(buf, gids[1])
    b = buf.take_batch()
    assert b.group_ids == (gids[3], gids[3], gids[1], gids[1])  # FIFO by completion
    assert buf.held_groups == 2 and buf.deferred_groups == 2 and buf.dropped_groups == {}
    buf.add(rollout(gids[0], 1))  # the deferred group still completes next step
    assert buf.stats()["complete_groups"] == 1
    buf.check_accounting()


def test_admission_bound_areal_and_release_refunds():
    buf = ReplayBufferCore(cfg(batch_groups=2, max_staleness=1, overcommit="fixed", delta=8), PAD)
    admit(buf, 4)  # (η + v + 1)·B = 4 at v=0, although B + Δ = 10
    assert not buf.can_admit()
    with pytest.raises(RuntimeError, match="cannot admit"):
        buf.admit(PromptItem(uid=9, prompt="p"))
    assert buf.release(0) is True and buf.dropped_groups == {"failed": 1}
    assert buf.release(0) is False
    with pytest.raises(ValueError, match="never admitted"):
        buf.release(42)
    assert buf.can_admit()
    buf.set_trainer_version(3)
    with pytest.raises(ValueError, match="went back"):
        buf.set_trainer_version(2)


def test_state_dict_round_trip_requeues_in_flight_groups_instead_of_dropping_them():
    """(Complete groups survive too: tests/test_checkpoint.py.)"""
    buf = ReplayBufferCore(cfg(batch_groups=1, max_staleness=2), PAD)
    fill(buf, admit(buf)[0])
    buf.take_batch()
    buf.set_trainer_version(1)
    admit(buf)
    buf.end_step(0.5)
    new = ReplayBufferCore(cfg(batch_groups=1, max_staleness=2), PAD)
    new.load_state_dict(buf.state_dict())
    assert new.version == 1 and new.trained_groups == 1 and not new.dropped_groups
    assert new.check_accounting() == buf.check_accounting()
    new.add(rollout(1, 0, versions=(1, 1)))  # a straggler of the old run (its lease is gone) is ignored
    assert new.late_rollouts == 1
    assert new.take_requeued((0, 0)).group_id == 1 and not new.can_admit()


# ---- property test: random arrival orders, versions, updates and failures ---------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(G=st.integers(1, 3), B=st.integers(1, 3), eta=st.integers(0, 2), mode=st.sampled_from(["none", "fixed", "adaptive"]),
       delta=st.integers(0, 3), seed=st.integers(0, 2**31), steps=st.integers(20, 150))
def test_random_runs_keep_every_invariant(G, B, eta, mode, delta, seed, steps):
    c = BufferConfig(group_size=G, batch_groups=B, max_staleness=eta, overcommit=mode, delta=delta,
                     delta_min=0, delta_max=3, window=3, zero_signal="keep" if G == 1 else "drop")
    buf, rng = ReplayBufferCore(c, PAD), random.Random(seed)
    gen_version = 0  # generators lag the trainer by a random amount
    pending: list[tuple[int, int]] = []  # (group, sample) slots handed out and not yet sent
    trained: set[tuple[int, int]] = set()
    admitted: set[int] = set()
    for _ in range(steps):
        op = rng.random()
        if op < 0.3 and buf.can_admit():
            g = admit(buf)[0]
            admitted.add(g)
            pending += [(g, i) for i in range(G)]
        elif op < 0.7 and pending:
            g, i = pending.pop(rng.randrange(len(pending)))
            v0 = rng.randint(gen_version, buf.version)
            buf.add(rollout(g, i, reward=float(rng.randint(0, 2)), versions=(v0, rng.randint(v0, buf.version))))
        elif op < 0.75 and pending:  # a generator gives up on a group and sends nothing more of it
            failed = pending[rng.randrange(len(pending))][0]
            buf.release(failed)
            pending = [p for p in pending if p[0] != failed]
        elif op < 0.8:
            with pytest.raises(RolloutRejected):
                buf.add(rollout(10**6, 0))
        elif op < 0.9:
            gen_version = rng.randint(gen_version, buf.version)
        elif buf.ready():
            b = buf.take_batch()
            assert b.num_samples == B * G and len(set(b.group_ids)) == B
            assert int(b.staleness().max()) <= eta
            keys = {(g, k % G) for k, g in enumerate(b.group_ids)}
            assert not keys & trained
            trained |= keys
            buf.end_step(float(b.rewards.mean()))
            buf.set_trainer_version(buf.version + 1)
            # at the start of a step, delta_effective is exactly the room admission leaves beyond B
            assert buf.delta_effective() == max(0, buf.admission_limit() - B)
        buf.check_accounting()
        assert buf.trained_groups + buf.held_groups <= (eta + buf.version + 1) * B
        assert buf.held_groups <= B + buf.delta_ctl.bound
        assert 0 <= buf.delta_ctl.delta <= 3
        assert 0 <= buf.delta_effective() <= min(buf.delta_ctl.delta, eta * B)
        assert buf.delta_capped_steps <= buf.batches
    # every admitted group is in exactly one place: trained, held, or dropped (and counted so)
    trained_groups, held = {g for g, _ in trained}, {*buf._in_flight, *buf._complete}
    assert len(trained) == buf.trained_groups * G and not trained_groups & held
    assert len(admitted - trained_groups - held) == sum(buf.dropped_groups.values())


# ---- liveness: on-policy training with a generator that is slow to pick up new weights -----------
@pytest.mark.parametrize("mode", ["none", "fixed", "adaptive"])
def test_max_staleness_zero_never_deadlocks(mode):
    """η = 0, one slow generator that loads each new version 7 ticks late: 50 steps complete.

    Everything the generator makes while it lags is stale and dropped; the run lives only because
    those slots are re-admitted (a buffer that evicts them without refunding waits forever)."""
    B, G, steps = 2, 2, 50
    buf = ReplayBufferCore(BufferConfig(group_size=G, batch_groups=B, max_staleness=0, overcommit=mode,
                                        delta=2, delta_min=0, delta_max=4, window=3), PAD)
    gen_version, load_at, work = 0, None, []  # work: [group, sample, version at start, ticks left]
    train_until, batches, rng = None, 0, random.Random(0)
    for tick in range(20_000):
        if load_at is not None and tick >= load_at:  # the generator finally serves the new weights
            gen_version, load_at = buf.version, None
        if not work and buf.can_admit():
            g = buf.admit(PromptItem(uid=tick, prompt="p")).group_id
            work = [[g, i, None, 2] for i in range(G)]
        if work:  # slow generator: one sample at a time, two ticks each
            w = work[0]
            w[2] = gen_version if w[2] is None else w[2]
            w[3] -= 1
            if w[3] == 0:
                buf.add(rollout(w[0], w[1], reward=float(rng.random() < 0.5), versions=(w[2], gen_version)))
                work.pop(0)
        if train_until is not None and tick >= train_until:  # optimizer step done: v -> v+1
            buf.set_trainer_version(buf.version + 1)
            load_at, train_until = tick + 7, None
        if train_until is None and buf.ready():
            b = buf.take_batch()
            assert int(b.staleness().max()) == 0 and len(set(b.group_ids)) == B
            buf.end_step(float(b.rewards.mean()))
            batches, train_until = batches + 1, tick + 3
            if batches == steps:
                break
        buf.check_accounting()
    assert batches == steps, f"stalled after {batches} steps: {buf.stats()}"
    assert buf.dropped_groups["stale"] > 0  # the lag really produced stale work


def test_delta_beyond_the_staleness_bound_is_reported_as_inert():
    """η·B = 2 lets only 2 groups beyond B be admitted: a fixed Δ = 5 shows delta_effective = 2 and
    every step is counted in delta_capped_steps; Δ = 2 is never capped."""
    for delta, want_eff, want_capped in [(5, 2, 3), (2, 2, 0)]:
        buf = ReplayBufferCore(cfg(batch_groups=2, max_staleness=1, overcommit="fixed", delta=delta), PAD)
        for _ in range(3):
            assert buf.stats()["delta_effective"] == want_eff == buf.admission_limit() - 2
            for _ in range(10):  # more than any limit here: the buffer decides how many get in
                if buf.can_admit():
                    fill(buf, admit(buf)[0], versions=(buf.version, buf.version))
            assert buf.held_groups == 2 + want_eff  # what admission really let in
            buf.take_batch()
            buf.end_step(0.5)
            buf.set_trainer_version(buf.version + 1)
        assert buf.stats()["delta_capped_steps"] == want_capped and buf.stats()["delta"] == delta
        restored = ReplayBufferCore(buf.cfg, PAD)
        restored.load_state_dict(buf.state_dict())
        assert restored.delta_capped_steps == want_capped


def test_dead_generators_groups_are_requeued_whole_and_accounting_holds():
    buf = ReplayBufferCore(cfg(batch_groups=2, overcommit="fixed", delta=2), PAD)
    a = buf.admit(PromptItem(uid=0, prompt="p"), (0, 0)).group_id
    b = buf.admit(PromptItem(uid=1, prompt="p"), (1, 0)).group_id
    c = buf.admit(PromptItem(uid=2, prompt="p"), (1, 0)).group_id
    buf.add(rollout(b, 0, generator_id=1))  # half of b arrived before generator 1 died
    for i in range(2):  # c is complete: no longer in flight, it stays
        buf.add(rollout(c, i, reward=float(i), generator_id=1))
    assert buf.release_generator((1, 0)) == 1 and buf.revoked((1, 0)) and not buf.revoked((1, 1))
    assert buf.has_requeued() and buf.stats()["requeued_waiting"] == 1
    buf.check_accounting()  # requeued groups are still held
    # a sample of b still arriving under the revoked lease is ignored, not an error
    buf.add(rollout(b, 1, generator_id=1))
    assert buf.stats()["late_rollouts"] == 1 and buf.wasted_tokens == 4
    again = buf.take_requeued((2, 0))
    assert again.group_id == b and not buf.has_requeued()
    # the dead incarnation can neither add to nor release the group it lost
    buf.add(rollout(b, 0, generator_id=2), lessee=(1, 0))
    assert not buf.release(b, lessee=(1, 0)) and buf.stats()["late_rollouts"] == 2
    for i in range(2):
        buf.add(rollout(b, i, reward=float(i), generator_id=2))
    fill(buf, a)
    batch = buf.take_batch()
    assert set(batch.group_ids) <= {a, b, c} and buf.check_accounting()["dropped_samples"] == 0
    assert buf.stats()["requeued_groups"] == 1


def test_a_stale_groups_prompt_is_admitted_again_before_new_ones_and_survives_a_checkpoint():
    buf = ReplayBufferCore(cfg(max_staleness=0, batch_groups=1), PAD)
    (g0,) = admit(buf)
    first = buf._in_flight[g0].group.item
    buf.add(rollout(g0, 0, versions=(0, 0)))
    buf.set_trainer_version(1)  # g0's sample is now one version too old
    assert buf.dropped_groups == {"stale": 1} and buf.has_retry()
    state = buf.state_dict()
    again = buf.admit_retry((0, 0))
    assert again.item == first and again.group_id != g0 and not buf.has_retry()
    assert buf.stats()["retried_prompts"] == 1
    buf.check_accounting()
    restored = ReplayBufferCore(cfg(max_staleness=0, batch_groups=1), PAD)
    restored.load_state_dict(state)
    assert restored.has_retry() and restored.admit_retry((0, 0)).item == first
    off = ReplayBufferCore(cfg(max_staleness=0, retry_stale=False), PAD)
    (g,) = admit(off)
    off.add(rollout(g, 0, versions=(0, 0)))
    off.set_trainer_version(1)
    assert off.dropped_groups == {"stale": 1} and not off.has_retry()


def test_environment_tokens_are_masked_out_and_carry_no_staleness():
    """A multi-turn rollout: model turn (v0), observation (-1), model turn (v1). The observation is
    context, not trained on; staleness is the oldest model token's."""
    buf = ReplayBufferCore(cfg(normalize_std=False, max_staleness=1), pad_id=PAD)
    g0, g1 = admit(buf, 2)
    buf.set_trainer_version(1)
    turns = (0, 0, -1, -1, -1, 1, 1)
    lps = (-0.5, -0.6, 0.0, 0.0, 0.0, -0.7, -0.8)
    for gid in (g0, g1):
        for i in range(2):
            buf.add(rollout(gid, i, reward=float(i), versions=turns, logprobs=lps))
    b = buf.take_batch()
    p = 2
    assert b.loss_mask[0, p:p + 7].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert b.versions[0, p:p + 7].tolist() == list(turns)
    assert b.behaviour_logprobs[0, p:p + 7].tolist() == pytest.approx(list(lps))
    assert b.staleness().tolist() == [1, 1, 1, 1]
    assert b.num_tokens == 4 * 4


def test_environment_token_with_a_logprob_is_invalid():
    bad = rollout(0, 0, versions=(0, -1), logprobs=(-0.5, -0.1))
    with pytest.raises(ValueError, match="environment token"):
        bad.validate()
    with pytest.raises(ValueError, match="negative policy version"):
        rollout(0, 0, versions=(0, -2), logprobs=(-0.5, 0.0)).validate()


# --------------------------------------------------------------- DAPO: overlong shaping and dynamic sampling

def turns(gid: int, idx: int, lengths: list[int], obs: int = 2, reward: float = 1.0, **kw) -> Rollout:
    """A multi-turn rollout: model turns of `lengths` tokens with `obs` environment tokens between them."""
    versions: list[int] = []
    for k, n in enumerate(lengths):
        versions += [-1] * (obs if k else 0) + [0] * n
    lps = tuple(0.0 if v < 0 else -0.5 for v in versions)
    return rollout(gid, idx, reward=reward, versions=tuple(versions), logprobs=lps, **kw)


def test_multi_turn_overlong_shaping_counts_each_turn_against_its_own_budget():
    """L = 16 per turn, dapo's buffer 16 // 5 = 3, task.max_total_tokens = 64: one turn of 10 tokens and
    three turns of 10 both finished normally with reward 1. No turn came near its budget and the episode
    did not either, so neither is shaped and the group has no signal (not +0.707 / -0.707)."""
    from pipeline.advantages import overlong_shaping
    from pipeline.config import Config, GeneratorConfig, TaskConfig, TrainerConfig

    c = Config(buffer=cfg(zero_signal="keep"), trainer=TrainerConfig(recipe="dapo"),
               generator=GeneratorConfig(max_new_tokens=16),
               task=TaskConfig(name="pipeline.tasks.calc", max_total_tokens=64))
    assert c.trainer.overlong_buffer == 3
    buf = ReplayBufferCore(c.buffer, PAD, overlong_shaping(c, multi_turn=True))
    g0, g1 = admit(buf, 2)
    buf.add(turns(g0, 0, [10]))
    buf.add(turns(g0, 1, [10, 10, 10]))
    assert buf._complete[g0].advantages == [0.0, 0.0] and buf.overlong_shaped == 0
    # a turn cut at its budget (16 of 16) is shaped as DAPO shapes a response: -1; one of 15 tokens: -2/3
    buf.add(turns(g1, 0, [10, 16, 5]))
    buf.add(turns(g1, 1, [15]))
    single = ReplayBufferCore(cfg(zero_signal="keep", normalize_std=False), PAD, (16, 3, 1.0))
    (s,) = admit(single)
    single.add(rollout(s, 0, reward=1.0, versions=(0,) * 16))
    single.add(rollout(s, 1, reward=1.0, versions=(0,) * 15))
    assert single._complete[s].advantages == pytest.approx([-1 / 6, 1 / 6])  # shaped -1 and -2/3
    assert buf.overlong_shaped == 2 and buf._complete[g1].advantages[0] < 0 < buf._complete[g1].advantages[1]
    # the episode's budget: 63 of 64 completion tokens (model and environment) is in its last 3 tokens' window
    b2 = ReplayBufferCore(c.buffer, PAD, overlong_shaping(c, multi_turn=True))
    (h,) = admit(b2)
    b2.add(turns(h, 0, [12, 12, 12, 12], obs=5))  # 48 model + 15 environment tokens = 63 > 64 - 3
    b2.add(turns(h, 1, [12, 12, 12], obs=5))      # 46: unshaped
    assert b2.overlong_shaped == 1 and b2._complete[h].advantages[0] < 0
    # single-turn (the default): the whole completion is the one turn
    assert overlong_shaping(c) == (16, 3, 1.0, 0)


def test_multi_turn_batches_carry_the_rollout_budget_for_dr_grpo():
    """aggregation=constant divides by the most loss tokens a rollout may have: generator.max_new_tokens
    for single-turn rollouts, task.max_total_tokens for multi-turn ones (Batch.max_len)."""
    from pipeline.advantages import overlong_shaping
    from pipeline.config import Config, TaskConfig

    c = Config(buffer=cfg(batch_groups=1), task=TaskConfig(name="pipeline.tasks.calc", max_total_tokens=64))
    for multi, want in ((True, 64), (False, c.generator.max_new_tokens)):
        buf = ReplayBufferCore(c.buffer, PAD, overlong_shaping(c, multi_turn=multi))
        fill(buf, admit(buf)[0])
        assert buf.take_batch().max_len == want


def test_dynamic_sampling_filters_on_the_task_reward_not_the_shaped_one():
    """DAPO filters on accuracy: an all-correct group with one response in the overlong window has equal
    task rewards and is dropped under zero_signal=drop (its only spread would be length), and counted as a
    zero-signal group under keep."""
    drop = ReplayBufferCore(cfg(zero_signal="drop"), PAD, (16, 3, 1.0))
    (g,) = admit(drop)
    drop.add(rollout(g, 0, reward=1.0, versions=(0,) * 15))  # shaped: 1 - 2/3
    drop.add(rollout(g, 1, reward=1.0, versions=(0,) * 5))
    assert drop.dropped_groups == {"zero_signal": 1} and g not in drop._complete
    keep = ReplayBufferCore(cfg(zero_signal="keep"), PAD, (16, 3, 1.0))
    (g,) = admit(keep)
    keep.add(rollout(g, 0, reward=1.0, versions=(0,) * 15))
    keep.add(rollout(g, 1, reward=1.0, versions=(0,) * 5))
    assert keep.zero_signal_groups == 1 and keep._complete[g].advantages[0] < 0  # kept: length shaping trains
    # a task-reward spread is kept under drop even where the shaping evens the rewards out
    drop2 = ReplayBufferCore(cfg(zero_signal="drop", normalize_std=False), PAD, (16, 3, 1.0))
    (g,) = admit(drop2)
    drop2.add(rollout(g, 0, reward=1.0, versions=(0,) * 16))  # 1 - 1 = 0
    drop2.add(rollout(g, 1, reward=0.0, versions=(0,) * 5))
    assert drop2.dropped_groups == {} and drop2._complete[g].advantages == [0.0, 0.0]
