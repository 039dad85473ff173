"""Faults stay local (issue #11, items 2 and 4): a bad reward or prompt rejects its sample or group
with a counted reason, a trainer step with a non-finite loss or no loss tokens is skipped and its
batch given back, and only rates or streaks above the configured bounds end the run.

    .venv/bin/python -m pytest -q tests/test_faults.py -m "not slow"    # pure logic and TrainCore, seconds
    .venv/bin/python -m pytest -q tests/test_faults.py                  # + real actors and one CLI run
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig, Config, ModelConfig, RunConfig, TaskConfig, TrainerConfig
from pipeline.generator.rewards import REJECT_MIN_SAMPLES, REJECT_WINDOW, RewardScorer, RolloutStats, reject_rate_problem
from pipeline.tasks import RewardRejected, Task, check_reward
from pipeline.trainer.errors import (EmptyBatchError, NonFiniteLossError, NonFiniteWeightsError, TooManySkippedSteps,
                                     skipped_step_error)
from pipeline.trainer.batches import minibatch_rows
from pipeline.trainer.step import TrainCore
from pipeline.types import PromptItem, Rollout

from .conftest import REPO
from .test_trainer_core import make_batch, replace, same, weights


def task_of(fn) -> Task:
    return Task(name="test.task", prompts=lambda seed, split: iter(()), reward_fn=fn)


# ---- rewards ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, reason", [
    (float("nan"), "reward_nan"), (float("inf"), "reward_nan"), (-math.inf, "reward_nan"),
    (np.float32("nan"), "reward_nan"),
    ("0.5", "reward_not_a_number"), (True, "reward_not_a_number"), (np.bool_(False), "reward_not_a_number"),
    (None, "reward_not_a_number"), (np.array([0.5]), "reward_not_a_number"),
])
def test_unusable_reward_values_are_rejected_with_their_reason(value, reason):
    with pytest.raises(RewardRejected) as e:
        task_of(lambda p, c: value).reward("p", "c")
    assert e.value.reason == reason


@pytest.mark.parametrize("value", [0, 1, 0.25, np.float32(0.5), np.int64(1), np.float64(-2.0)])
def test_real_numbers_are_rewards(value):
    r = check_reward(value)
    assert type(r) is float and r == float(value)


def test_a_reward_that_raises_is_rejected_not_propagated():
    def boom(p, c):
        raise KeyError("no such answer")

    with pytest.raises(RewardRejected, match="KeyError") as e:
        task_of(boom).reward("p", "c")
    assert e.value.reason == "reward_raised"
    import pickle

    back = pickle.loads(pickle.dumps(e.value))  # crosses actor boundaries
    assert back.reason == "reward_raised" and str(back) == str(e.value)


def test_scorer_runs_rewards_off_the_loop_and_times_out_a_slow_one():
    release = threading.Event()

    def reward(p, c):
        if c == "slow":
            release.wait(5)
        if c == "boom":
            raise RuntimeError("bad")
        return len(c) / 10

    async def go():
        s = RewardScorer(task_of(reward), timeout_s=0.3, workers=2)
        ticks = 0

        async def ticker():  # the event loop keeps running while the slow reward blocks its thread
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        t = asyncio.create_task(ticker())
        res = await asyncio.gather(s.score("p", "slow"), s.score("p", "abc"), s.score("p", "boom"),
                                   return_exceptions=True)
        t.cancel()
        overdue = s.overdue
        release.set()
        await asyncio.sleep(0.1)
        return res, ticks, overdue, s.overdue

    (slow, ok, boom), ticks, overdue, later = asyncio.run(go())
    assert isinstance(slow, RewardRejected) and slow.reason == "reward_timeout"
    assert ok == pytest.approx(0.3)
    assert isinstance(boom, RewardRejected) and boom.reason == "reward_raised"
    assert ticks >= 5, ticks
    assert overdue == 1 and later == 0  # the timed-out call held its worker until it returned


def test_hung_rewards_use_up_the_workers_and_every_later_call_times_out():
    hang = threading.Event()

    async def go():
        s = RewardScorer(task_of(lambda p, c: hang.wait(10) or 0.0), timeout_s=0.2, workers=1)
        first = await asyncio.gather(s.score("p", "a"), return_exceptions=True)
        second = await asyncio.gather(s.score("p", "b"), return_exceptions=True)
        hang.set()
        return first[0], second[0]

    first, second = asyncio.run(go())
    assert first.reason == second.reason == "reward_timeout"
    # refused for want of a worker, not left to wait for the hung one
    assert "no reward worker free" in str(second) and "1 reward call(s) still running" in str(second)


def test_reject_rate_is_judged_over_a_window_once_enough_samples_were_seen():
    s = RolloutStats()
    for _ in range(REJECT_MIN_SAMPLES - 1):
        s.reject("reward_raised", "g: boom")
    assert reject_rate_problem(s.snapshot(), 0.2) is None  # too few seen to judge
    s.fail("empty_prompt", "g: empty")
    msg = reject_rate_problem(s.snapshot(), 0.2)
    assert msg is not None and "100% of its last 20 samples" in msg and "top reason reward_raised" in msg
    for _ in range(REJECT_WINDOW):  # a good stretch pushes the old rejections out of the window
        s.accept()
    snap = s.snapshot()
    assert snap["recent_samples"] == REJECT_WINDOW and snap["recent_rejected_frac"] == 0.0
    assert reject_rate_problem(snap, 0.2) is None
    assert snap["rejected"] == {"reward_raised": REJECT_MIN_SAMPLES - 1} and snap["failed"] == {"empty_prompt": 1}
    for i in range(REJECT_WINDOW):  # 25% rejected: above 0.2, within 0.3
        s.reject("reward_timeout", "g: slow") if i % 4 == 0 else s.accept()
    assert "25%" in reject_rate_problem(s.snapshot(), 0.2) and reject_rate_problem(s.snapshot(), 0.3) is None


def test_only_the_first_rejections_are_logged_in_full():
    s = RolloutStats()
    assert [s.reject("reward_nan", "x") for _ in range(7)] == [True] * 5 + [False] * 2


def test_config_bounds_for_the_new_keys():
    from pipeline.config import ConfigError, load_config

    for bad in ("task.reward_timeout_s=0", "task.max_reject_frac=0", "task.max_reject_frac=1.5",
                "task.reward_workers=0", "trainer.max_skipped_steps=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])
    cfg = load_config(None, [])
    assert (cfg.task.reward_timeout_s, cfg.task.max_reject_frac, cfg.trainer.max_skipped_steps) == (30.0, 0.2, 5)


# ---- the buffer gives a skipped step's batch back ----------------------------------------------

def _rollout(group, idx: int, version: int = 0, reward: float | None = None, n: int = 2) -> Rollout:
    return Rollout(group_id=group.group_id, sample_idx=idx, prompt=group.item.prompt, prompt_tokens=(7, 8, 9),
                   completion="x", completion_tokens=(3,) * n, logprobs=(-0.1,) * n, versions=(version,) * n,
                   finish_reason="stop", reward=float(idx) if reward is None else reward)


def _fill(buf: ReplayBufferCore, version: int = 0) -> list:
    groups = []
    while buf.can_admit():
        g = buf.admit(PromptItem(buf._next_id, "rev ab="))
        for i in range(buf.cfg.group_size):
            buf.add(_rollout(g, i, version))
        groups.append(g)
    return groups


@pytest.mark.parametrize("staleness, delta", [(0, 0), (1, 2)])
def test_skipped_step_books_its_groups_as_dropped_and_admission_reopens(staleness, delta):
    B, G = 2, 2
    buf = ReplayBufferCore(BufferConfig(group_size=G, batch_groups=B, max_staleness=staleness,
                                        overcommit="fixed", delta=delta), pad_id=0)
    _fill(buf)
    batch = buf.take_batch()
    _fill(buf)  # whatever admission allows at version 0 with one batch counted as trained
    assert not buf.can_admit()
    before = buf.stats()
    assert buf.skip_batch(batch.group_ids) == B
    after = buf.check_accounting()
    s = buf.stats()
    assert after["trained_samples"] == 0 and s["dropped_groups"] == {"skipped_step": B}
    assert after["admitted_samples"] == after["dropped_samples"] + after["held_samples"]
    assert s["wasted_tokens"] == before["wasted_tokens"] + int(batch.loss_mask.sum())
    assert s["batches"] == 0 and s["staleness_hist"] == {} and s["deferred_groups"] == 0
    if staleness == 0:
        assert buf.can_admit()  # the B slots the batch held at version 0 are free again
    with pytest.raises(ValueError, match="last batch taken"):
        buf.skip_batch(batch.group_ids)  # given back once only
    # training goes on: the next batch at the same version, then the version advances
    _fill(buf)
    nxt = buf.take_batch()
    assert set(nxt.group_ids).isdisjoint(batch.group_ids) and nxt.trainer_version == 0
    buf.set_trainer_version(1)
    buf.end_step(0.5)
    assert buf.can_admit() and buf.check_accounting()["trained_samples"] == B * G


def test_without_the_give_back_admission_stays_closed_at_max_staleness_zero():
    """What skip_batch prevents: a taken batch counts as trained against v·B, and the version does
    not advance on a skipped step, so with η = 0 the buffer would never admit again."""
    buf = ReplayBufferCore(BufferConfig(group_size=2, batch_groups=2, max_staleness=0, overcommit="none"), pad_id=0)
    _fill(buf)
    buf.take_batch()
    buf.set_trainer_version(0)
    assert not buf.can_admit() and buf.admission_limit() == 0


def test_skip_batch_refuses_a_batch_it_did_not_hand_out():
    buf = ReplayBufferCore(BufferConfig(group_size=2, batch_groups=1, overcommit="none"), pad_id=0)
    with pytest.raises(ValueError, match="none"):
        buf.skip_batch([0])
    _fill(buf)
    buf.take_batch()
    with pytest.raises(ValueError, match=r"groups \[5\]"):
        buf.skip_batch([5])
    buf.check_accounting()


# ---- the trainer skips a step instead of failing -------------------------------------------------

@pytest.fixture(scope="module")
def tcfg() -> Config:
    return Config(model=ModelConfig(), trainer=TrainerConfig(lr=1e-3, max_skipped_steps=2))


def test_batch_with_no_loss_tokens_is_skipped_not_fatal(tcfg):
    core = TrainCore.from_config(tcfg)
    b = make_batch(core.model)
    empty = replace(b, loss_mask=torch.zeros_like(b.loss_mask))  # every completion empty
    before = weights(core)
    with pytest.raises(EmptyBatchError, match="no loss tokens") as e:
        core.train_step(empty)
    assert skipped_step_error(e.value) is e.value
    assert same(before, weights(core)) and core.version == 0 and core.skipped_steps == 1
    m = core.train_step(b)
    assert m["version"] == 1 and m["skipped_steps"] == 1.0


def test_nonfinite_loss_is_skipped_and_a_streak_of_skips_stops_the_run(tcfg):
    core = TrainCore.from_config(tcfg)  # max_skipped_steps=2
    nan_batch = make_batch(core.model, adv=torch.full((6,), 3e38))  # finite inputs; the loss overflows
    good = make_batch(core.model, seed=1)
    with pytest.raises(NonFiniteLossError) as e:
        core.train_step(nan_batch)
    assert skipped_step_error(e.value) is e.value and core.version == 0
    assert core.train_step(good)["skipped_steps"] == 1.0  # a good step resets the streak
    with pytest.raises(NonFiniteLossError):
        core.train_step(nan_batch)
    with pytest.raises(TooManySkippedSteps, match="2 steps in a row skipped.*max_skipped_steps=2") as e:
        core.train_step(nan_batch)
    assert skipped_step_error(e.value) is None  # not skippable: the controller ends the run
    assert core.version == 1 and core.skipped_steps == 3


def test_skip_reason_is_recognised_through_monarchs_actor_error():
    from monarch._src.actor.actor_mesh import ActorError

    inner = NonFiniteLossError("trainer: loss is nan")
    assert skipped_step_error(ActorError(inner)) is inner
    assert skipped_step_error(ActorError(EmptyBatchError("no loss tokens"))) is not None
    assert skipped_step_error(ActorError(ValueError("trainer: input_ids outside the vocabulary"))) is None


def test_nonfinite_weights_after_an_optimizer_step_are_never_pushed(tcfg):
    core = TrainCore.from_config(tcfg)
    core.optimizer.param_groups[0]["lr"] = float("inf")  # an optimizer blow-up from finite gradients
    with pytest.raises(NonFiniteWeightsError, match="non-finite parameter value") as e:
        core.train_step(make_batch(core.model))
    assert skipped_step_error(e.value) is None and core.version == 0


def test_minibatch_step_before_a_nonfinite_one_stays_applied_and_counts_as_skipped(tcfg):
    """Documented choice: minibatch 1's update stays, minibatch 2's non-finite step is not applied,
    the version stays and the step is skipped (its batch goes back); the next batch trains normally."""
    core = TrainCore.from_config(Config(model=tcfg.model, trainer=TrainerConfig(lr=1e-3, minibatches=2)))
    first, _ = minibatch_rows(6, 2, 1, core.seed, core.version)[0]
    adv = torch.full((6,), 3e38)  # finite, but the second minibatch's loss overflows
    adv[first] = torch.tensor([1.0, -1.0, 0.5])
    b = make_batch(core.model, adv=adv)
    before = weights(core)
    with pytest.raises(NonFiniteLossError, match="1 earlier optimizer step"):
        core.train_step(b)
    assert not same(before, weights(core)) and core.version == 0 and core.skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in weights(core).values())
    assert core.train_step(make_batch(core.model, seed=2))["version"] == 1


# ---- the controller path, on real actors ----------------------------------------------------------

@pytest.mark.slow
def test_controller_gives_a_skipped_batch_back_and_admission_reopens_on_real_actors(loop):
    """TrainLoop.train_once against a real ReplayBufferActor and a real trainer mesh: a batch of empty
    completions comes back from the trainer as Monarch's ActorError(EmptyBatchError); the batch goes
    back to the buffer, which, at max_staleness 0, admits the next group only because of that, and
    the step trains on it. Two skips in a row (trainer.max_skipped_steps=2) end the run."""
    from monarch.actor import this_host

    from actors.replay_buffer import ReplayBufferActor
    from actors.trainer import Trainer
    from pipeline.driver.calls import RunError
    from pipeline.driver.hooks import Hooks
    from pipeline.driver.job import Job
    from pipeline.driver.loop import SyncPublish, TrainLoop
    from pipeline.models.tiny import TINY_PAD_ID

    cfg = Config(model=ModelConfig(), buffer=BufferConfig(group_size=2, batch_groups=1, max_staleness=0,
                                                          overcommit="none"),
                 trainer=TrainerConfig(max_skipped_steps=2, init_timeout_s=120),
                 run=RunConfig(warm_start_steps=0))  # RL from the initial weights, as before 'auto'
    pipe = Job(cfg)
    steps = TrainLoop(pipe, SyncPublish(pipe), Hooks([]))

    async def feed(kinds: list[str]) -> None:
        """Admit a group whenever admission opens and complete it: 'empty' completions or normal ones."""
        for kind in kinds:
            g = await pipe.buffer.admit.call_one(60.0)  # generator 0's lease (the default)
            assert g is not None, "admission did not reopen"
            for i in range(2):
                r = _rollout(g, i, pipe.version, n=0 if kind == "empty" else 3)
                await pipe.buffer.add.call_one(r)

    async def go():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        pipe.buffer = procs.spawn("buffer", ReplayBufferActor, cfg, TINY_PAD_ID)
        pipe.trainer = await Trainer.start(cfg)
        try:
            (_, metrics), _ = await asyncio.gather(steps.train_once(), feed(["empty", "normal"]))
            s1 = await pipe.buffer.stats.call_one()
            with pytest.raises(RunError, match="2 steps in a row skipped") as e:
                await asyncio.gather(steps.train_once(), feed(["empty", "empty"]))
            return metrics, s1, str(e.value), await pipe.buffer.stats.call_one()
        finally:
            await pipe.trainer.close()
            await procs.stop()

    metrics, s1, err, s2 = loop.run_until_complete(go())
    assert metrics["version/trainer"] == 1 and metrics["trainer/skipped_steps"] == 1.0
    assert s1["dropped_groups"] == {"skipped_step": 1} and s1["trained_samples"] == 2
    assert s1["admitted_samples"] == s1["trained_samples"] + s1["dropped_samples"] + s1["held_samples"]
    assert "max_skipped_steps=2" in err
    assert s2["dropped_groups"] == {"skipped_step": 2}  # the first of the streak went back; the last ended the run


def test_reject_rate_above_the_bound_ends_the_run_naming_generator_fraction_and_reason():
    """The controller's health probe on generator stats (a stand-in for the generator actor, which
    needs a vLLM engine; the stats are a real RolloutStats snapshot)."""
    from pipeline.driver.calls import RunError
    from pipeline.driver.job import Job

    s = RolloutStats()
    for i in range(40):
        s.reject("reward_timeout", "group 1 sample 0: reward_timeout: slow") if i % 2 else s.accept()
    snap = {**s.snapshot(), "error": None}

    class Stats:
        async def call_one(self):
            return snap

    class Gen:
        stats = Stats()

    pipe = Job(Config(task=TaskConfig(max_reject_frac=0.4)))
    slot = pipe.fleet.generators[0]
    slot.handle, slot.live = Gen(), True
    with pytest.raises(RunError, match=r"generator0: 50% of its last 40 samples were rejected.*"
                                       r"max_reject_frac=0.4.*top reason reward_timeout"):
        asyncio.run(pipe.supervisor.probe())
    pipe.supervisor.cfg = Config(task=TaskConfig(max_reject_frac=0.5))
    assert asyncio.run(pipe.supervisor.probe()) == {}


# ---- one real run ------------------------------------------------------------------------------

FAULTY_TASK = '''
"""A task plug-in with faults: every 20 reward calls (per process) one raises, one returns NaN, one
returns the str "0.5" and one sleeps past task.reward_timeout_s; every 10 training prompts one is
empty and one is not a string; the eval prompts start with an empty and an over-long one."""
import itertools
import time

from pipeline.tasks import reverse
from pipeline.types import PromptItem

_calls = itertools.count()


def prompts(seed, split):
    if split == "eval":
        yield PromptItem(uid=-1, prompt="")
        yield PromptItem(uid=-2, prompt="rev " + "a" * 400 + "=")
    for item in reverse.prompts(seed, split):
        if split == "train" and item.uid % 10 == 3:
            yield PromptItem(item.uid, "")
        elif split == "train" and item.uid % 10 == 7:
            yield PromptItem(item.uid, None)
        else:
            yield item


def reward(prompt, completion):
    k = next(_calls) % 20
    if k == 1:
        raise ValueError("injected reward fault")
    if k == 6:
        return float("nan")
    if k == 11:
        return "0.5"
    if k == 16:
        time.sleep(3.0)
        return 0.5
    return reverse.reward(prompt, completion)
'''


@pytest.mark.slow
def test_cli_run_with_faulty_rewards_and_prompts_finishes_and_counts_them(tmp_path):
    pkg = tmp_path / "faulty_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "task.py").write_text(textwrap.dedent(FAULTY_TASK))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.steps=4",
                        "run.eval_every=2", "run.progress=false", "run.warm_start_steps=0", "buffer.batch_groups=2",
                        "buffer.group_size=2", "generator.concurrency=4", "generator.max_new_tokens=6",
                        "task.name=faulty_plugin.task", "task.eval_prompts=6", "task.reward_timeout_s=1.0",
                        "task.max_reject_frac=0.6", f"run.out_dir={out}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-6000:]
    assert "== done: 4 steps" in p.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "version/trainer" in r]
    assert [(r["step"], r["version/trainer"]) for r in steps] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    last = steps[-1]
    for reason in ("reward_raised", "reward_nan", "reward_not_a_number", "reward_timeout",
                   "empty_prompt", "prompt_not_tokenizable"):
        assert last.get(f"rejected/{reason}", 0) >= 1, (reason, {k: v for k, v in last.items() if "reject" in k})
    evals = [r for r in rows if "eval/reward" in r]
    assert len(evals) == 3 and all(r["eval/skipped_prompts"] == 2 for r in evals)  # step 0, 2, 4
    assert all(math.isfinite(r["eval/reward"]) for r in evals)
    ev_rejected = {k for r in evals for k in r if k.startswith("eval/rejected/")}
    assert ev_rejected == {f"eval/rejected/{k}" for k in ("reward_raised", "reward_nan", "reward_not_a_number",
                                                          "reward_timeout")}, ev_rejected
    assert "sample rejected" in p.stderr  # the first few are logged with prompt and completion


def test_supervisor_restarts_a_slot_once_per_incarnation_and_drops_stale_reports(tmp_path):
    """The Supervisor's one queue: a failure of a slot's current incarnation starts one restart
    (the same algorithm for a generator and the reward model, here with a stand-in for the wiring,
    which needs real meshes); repeated and stale reports (an older incarnation, as a late Monarch
    fault of a replaced mesh) start nothing; past the budget the run ends naming the key."""
    from pipeline.config import GeneratorConfig
    from pipeline.driver.calls import RunError
    from pipeline.driver.fleet import Fleet
    from pipeline.driver.supervisor import Supervisor

    cfg = Config(generator=GeneratorConfig(num_generators=2, max_restarts=1), run=RunConfig(out_dir=str(tmp_path)))
    fleet = Fleet(cfg)
    assert [fleet.generators[1].incarnation_of(n) for n in ("generator1r2-x7", "generator11r0-x", "generator1r0")] \
        == [2, None, None]

    class Watch:
        async def call_one(self):
            await asyncio.Event().wait()  # a healthy generator's watch never answers

    class Gen:
        watch = Watch()

    class Wiring:
        brought: list[str] = []

        async def take_out(self, slot):
            return {"requeued_groups": 0}

        async def bring_back(self, slot):
            self.brought.append(slot.mesh_name)
            slot.handle = Gen()
            return {"version": 0}

    sup = Supervisor(cfg, fleet, Wiring())

    async def go():
        run = asyncio.create_task(sup.run())
        sup.report(0, "engine died")
        sup.report(0, "engine died, said again")
        await asyncio.sleep(0.1)
        sup.report(fleet.generators[0], "late fault of the replaced mesh", 0)
        await asyncio.sleep(0.1)
        assert not run.done()
        sup.report(0, "the new one died too")
        with pytest.raises(RunError, match=r"generator0 failed and has used its 1 restarts \(generator.max_restarts\)"):
            await asyncio.wait_for(run, 5)

    asyncio.run(go())
    assert Wiring.brought == ["generator0r1"]
    events = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(e["generator"], e["restart"], e["cause"]) for e in events] == [(0, 1, "engine died")]
