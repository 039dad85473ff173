"""Multi-turn rollouts on a real vLLM CPU engine (the tiny model), driven by GeneratorCore in-process.

Scripted environments decide the episode (the tiny model's text does not matter to them), so the
tests check the token flow exactly: what the engine is fed each turn, the layout of the rollout
(model tokens with logprobs and versions, observation tokens masked out), a weight update between
two turns, and environments that raise, hang or flood. One engine serves every test.

    .venv/bin/python -m pytest -q tests/test_multiturn.py -x
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time

import pytest

from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig, Config, GeneratorConfig, ModelConfig, TaskConfig
from pipeline.models.tiny import TINY_EOS_ID, TINY_PAD_ID, ensure_tiny
from pipeline.tokens import encode_completion
from pipeline.generator.core import GeneratorCore
from pipeline.tasks import take
from pipeline.types import ENV_VERSION, PromptGroup, PromptItem

from tests.conftest import REPO

CACHE = str(REPO / ".cache" / "tiny-model")
GROUP, MAX_NEW = 2, 6
OBS = "ab:12;"
GROUP_IDS = itertools.count()  # unique across tests, as the buffer's are: the engine remembers released groups


class ListSource:
    """An in-process work source (pipeline.generator.trajectory.WorkSource): admits the groups fed to it."""

    def __init__(self) -> None:
        self.items: list[PromptItem] = []
        self.rollouts, self.released = [], []

    async def admit(self, wait_s: float):
        if not self.items:
            await asyncio.sleep(min(wait_s, 0.05))
            return None
        return PromptGroup(next(GROUP_IDS), self.items.pop(0), GROUP, admitted_version=0)

    async def add(self, rollout) -> None:
        rollout.validate()
        self.rollouts.append(rollout)

    async def release(self, group_id: int) -> bool:
        self.released.append(group_id)
        return True


class Scripted:
    """Observation OBS after each of the first `calls` turns, then the end; `hook(n)` runs first."""

    def __init__(self, calls: int, hook=None, obs: str = OBS) -> None:
        self.calls, self.hook, self.obs, self.seen = calls, hook, obs, []

    def step(self, turn: str):
        self.seen.append(turn)
        if self.hook is not None:
            self.hook(len(self.seen))
        return self.obs if len(self.seen) <= self.calls else None


@pytest.fixture(scope="module")
def eng():
    cfg = Config(model=ModelConfig(hf_dir=str(ensure_tiny(cache_dir=CACHE))),
                 generator=GeneratorConfig(concurrency=4, on_update="keep", max_new_tokens=MAX_NEW, ignore_eos=True,
                                           max_model_len=128, start_timeout_s=240, request_timeout_s=60,
                                           # unsupervised and shared by the module: one false hang alarm under
                                           # the suite's load failed every test after it (liveness: test_liveness)
                                           hang_timeout_s=30),
                 task=TaskConfig(name="pipeline.tasks.calc", max_turns=3, max_total_tokens=40, max_obs_tokens=8,
                                 env_timeout_s=1.0))
    env_before = dict(os.environ)  # vLLM's CPU platform sets LOCAL_WORLD_SIZE etc. in this process
    loop = asyncio.new_event_loop()
    e = GeneratorCore(cfg, 0)
    loop.run_until_complete(e.start_engine())
    calls: list[list[int]] = []
    generate = e.engine.llm.generate

    def recording(prompt, sp, request_id):  # what each request is conditioned on, token for token
        calls.append(list(prompt["prompt_token_ids"]))
        return generate(prompt, sp, request_id=request_id)

    e.engine.llm.generate = recording
    yield loop, e, calls
    loop.run_until_complete(e.close())
    loop.close()
    os.environ.clear()  # later tests start CLI runs: they must not inherit the engine's settings
    os.environ.update(env_before)


def run_groups(loop, e, env_factory, n: int, seed: int, timeout_s: float = 90) -> ListSource:
    """Generate `n` calc prompts (GROUP samples each) with environment `env_factory`; wait until all
    are sent or released."""
    e.episodes.task = dataclasses.replace(e.episodes.task, env=env_factory)
    src = ListSource()
    src.items = take(e.episodes.task, seed, "train", n)

    async def go():
        e.begin_stage(src)
        deadline = time.monotonic() + timeout_s
        while len(src.rollouts) + GROUP * len(set(src.released)) < GROUP * n:
            e.check()
            assert time.monotonic() < deadline, f"{len(src.rollouts)} rollouts after {timeout_s}s"
            await asyncio.sleep(0.05)
        await e.end_stage(30)

    loop.run_until_complete(go())
    return src


def test_multi_turn_layout_and_exact_token_flow(eng):
    loop, e, calls = eng
    calls.clear()
    envs = []
    src = run_groups(loop, e, lambda item: envs.append(Scripted(calls=2)) or envs[-1], n=2, seed=1)
    assert len(src.rollouts) == 2 * GROUP and not src.released
    obs_ids = encode_completion(e.engine.tok, OBS)
    for r in src.rollouts:
        v = list(r.versions)
        # ignore_eos: each model turn is MAX_NEW sampled tokens; two observations between three turns
        assert v == [0] * MAX_NEW + [ENV_VERSION] * len(obs_ids) + [0] * MAX_NEW + [ENV_VERSION] * len(obs_ids) \
            + [0] * MAX_NEW, v
        toks = list(r.completion_tokens)
        assert toks[MAX_NEW:MAX_NEW + len(obs_ids)] == obs_ids  # the observation, tokenised on its own
        assert all(lp == 0.0 for lp, ver in zip(r.logprobs, v) if ver == ENV_VERSION)
        assert all(lp < 0.0 for lp, ver in zip(r.logprobs, v) if ver >= 0)  # sampled tokens have logprobs
        # token in, token out: turn k was fed exactly the prompt and every token before it
        ctx = list(r.prompt_tokens) + toks
        for start in (0, MAX_NEW + len(obs_ids), 2 * (MAX_NEW + len(obs_ids))):
            assert ctx[:len(r.prompt_tokens) + start] in calls
        assert r.completion == e.engine.tok.decode(toks, skip_special_tokens=True) and OBS in r.completion
    # the environment saw each turn but the last (task.max_turns = 3 ends the episode), as text
    assert len(envs) == 2 * GROUP and all(len(env.seen) == 2 for env in envs)
    assert e.snapshot()["turns"] >= 3 * 2 * GROUP
    # through the buffer: observations are context, not trained on
    buf = ReplayBufferCore(BufferConfig(group_size=GROUP, batch_groups=2, overcommit="none"), pad_id=TINY_PAD_ID)
    for g in range(2):
        buf.admit(PromptItem(uid=g, prompt="p"))
    for r in src.rollouts:
        buf.add(r)
    b = buf.take_batch()
    for i in range(b.num_samples):
        p = len(src.rollouts[0].prompt_tokens)
        n = int((b.input_ids[i] != TINY_PAD_ID).sum()) - p
        assert b.loss_mask[i, p:p + n].tolist() == [float(x >= 0) for x in b.versions[i, p:p + n].tolist()]
    assert b.num_tokens == 3 * MAX_NEW * 2 * GROUP


def test_weight_update_between_two_turns_gives_two_versions_and_staleness(eng):
    loop, e, _ = eng
    v = e.version
    at_step, go_on = threading.Event(), threading.Event()

    def hook(n: int) -> None:  # hold the first observation until the update is in
        if n == 1:
            at_step.set()
            go_on.wait(30)

    async def relabel() -> None:  # a load that labels the engine with the new version
        await e.engine.llm.update_weight_version(str(v + 1))

    async def update_when_parked():
        deadline = time.monotonic() + 60
        while not at_step.is_set():
            assert time.monotonic() < deadline, "no rollout reached its environment in 60s"
            await asyncio.sleep(0.01)
        await e.update(v + 1, relabel, "keep")
        go_on.set()

    e.episodes.task = dataclasses.replace(e.episodes.task, env=lambda item: Scripted(calls=1, hook=hook))
    src = ListSource()
    src.items = take(e.episodes.task, 2, "train", 1)

    async def go():
        e.begin_stage(src)
        upd = asyncio.create_task(update_when_parked())
        deadline = time.monotonic() + 90
        while len(src.rollouts) < GROUP:
            e.check()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await upd
        await e.end_stage(30)

    loop.run_until_complete(go())
    assert e.version == v + 1
    obs = len(encode_completion(e.engine.tok, OBS))
    parked = [r for r in src.rollouts if set(r.versions) - {ENV_VERSION} == {v, v + 1}]
    assert parked, [r.versions for r in src.rollouts]
    for r in parked:
        assert list(r.versions) == [v] * MAX_NEW + [ENV_VERSION] * obs + [v + 1] * MAX_NEW
        assert r.min_version == v
    buf = ReplayBufferCore(BufferConfig(group_size=GROUP, batch_groups=1, max_staleness=2, overcommit="none"),
                           pad_id=TINY_PAD_ID)
    buf.admit(PromptItem(uid=0, prompt="p"))
    buf.set_trainer_version(v + 1)
    for r in src.rollouts:
        buf.add(dataclasses.replace(r, group_id=0))  # the buffer's own group id
    b = buf.take_batch()
    assert b.staleness().tolist() == [1 if r in parked else 0 for r in src.rollouts]


def test_environments_that_raise_hang_or_flood_fail_their_rollout_alone(eng):
    loop, e, _ = eng
    before = e.snapshot()

    class Faulty:
        def __init__(self, item) -> None:
            self.kind = item.uid % 4

        def step(self, turn: str):
            if self.kind == 0:
                raise RuntimeError("tool crashed")
            if self.kind == 1:
                time.sleep(1.5)  # past task.env_timeout_s = 1
            if self.kind == 2:
                return "x" * 500  # cut to task.max_obs_tokens
            return None

    src = run_groups(loop, e, Faulty, n=8, seed=3)
    after = e.snapshot()
    rejected = {k: after["rejected"].get(k, 0) - before["rejected"].get(k, 0) for k in after["rejected"]}
    assert rejected.get("env_raised", 0) >= 2 and rejected.get("env_timeout", 0) >= 2, rejected
    assert after["obs_truncated"] - before["obs_truncated"] >= 2
    flooded = [r for r in src.rollouts if ENV_VERSION in r.versions]
    runs = [len(list(run)) for r in flooded for env, run in itertools.groupby(r.versions, lambda v: v == ENV_VERSION)
            if env]
    assert flooded and runs and max(runs) == 8, runs  # each observation cut to task.max_obs_tokens
    assert len(set(src.released)) >= 4 and len(src.rollouts) >= 4 * GROUP  # the others went on
    e.check()  # the generator is not broken
    assert TINY_EOS_ID not in encode_completion(e.engine.tok, OBS)


def test_carry_over_save_between_two_turns_resumes_the_episode(eng):
    """A stage end with carry_over=save while a rollout waits for its environment: the trajectory
    (environment included) is kept and resumed first in the next stage, its next turn conditioned
    on the exact tokens so far."""
    loop, e, calls = eng
    at_step, go_on = threading.Event(), threading.Event()
    envs, waiting, lock = [], [], threading.Lock()

    def hook(n: int) -> None:
        if n == 1:  # the stage ends once every rollout of the group waits here (on a loaded machine
            with lock:  # the second may still be sampling its first turn when the first arrives)
                waiting.append(n)
                if len(waiting) == GROUP:
                    at_step.set()
            go_on.wait(30)

    def factory(item):
        envs.append(Scripted(calls=1, hook=hook))
        return envs[-1]

    e.episodes.task = dataclasses.replace(e.episodes.task, env=factory)
    src = ListSource()
    src.items = take(e.episodes.task, 4, "train", 1)

    async def go():
        e.begin_stage(src)
        deadline = time.monotonic() + 60
        while not at_step.is_set():
            e.check()
            assert time.monotonic() < deadline, "no rollout reached its environment in 60s"
            await asyncio.sleep(0.01)
        ending = asyncio.create_task(e.end_stage(30, carry_over="save"))
        await asyncio.sleep(0.2)
        go_on.set()  # the observation comes back after the stage ended: the next turn waits for a stage
        info = await ending
        assert not src.rollouts and info["carried"] == GROUP, info
        calls.clear()
        e.begin_stage(src)
        deadline = time.monotonic() + 60
        while len(src.rollouts) < GROUP:
            e.check()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await e.end_stage(30)

    loop.run_until_complete(go())
    obs = encode_completion(e.engine.tok, OBS)
    for r in src.rollouts:
        toks = list(r.completion_tokens)
        assert list(r.versions).count(ENV_VERSION) == len(obs) and toks[MAX_NEW:MAX_NEW + len(obs)] == obs
        assert list(r.prompt_tokens) + toks[:MAX_NEW + len(obs)] in calls  # resumed on the exact tokens
        assert r.reprefill_tokens == 0  # a new turn is not a re-prefill
    # the same environments went on: each saw the turn before the stage end and the one after it
    assert len(envs) == GROUP and all(len(env.seen) == 2 for env in envs)


def test_streaming_reward_model_scores_each_rollout_as_its_whole_token_sequence(eng, tiny_dir, tmp_path):
    """vLLM streams tokens (DELTA outputs) to a reward model on its own Monarch proc in chunks of 3,
    observations included; each rollout's reward equals the model's score of its whole sequence."""
    from monarch.actor import this_host

    from actors.reward_model import RewardModelActor
    from pipeline.generator.reward_client import RewardModelClient
    from pipeline.reward_model import StreamingScorer, init_scorer

    loop, e, _ = eng
    path = init_scorer(tiny_dir, tmp_path / "scorer", seed=2)
    cfg0 = e.episodes.cfg
    e.episodes.cfg = dataclasses.replace(cfg0, reward_model=dataclasses.replace(cfg0.reward_model, path=str(path),
                                                                      chunk_tokens=3, task_weight=0.0, weight=2.0))
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        rm = procs.spawn("rm_mt", RewardModelActor, e.episodes.cfg, 0)
        loop.run_until_complete(asyncio.wait_for(rm.setup.call_one(), 120))
        e.episodes.rm = RewardModelClient(rm, 3, 30.0, "g0r0/")
        src = run_groups(loop, e, lambda item: Scripted(calls=1), n=2, seed=4)
        stats = loop.run_until_complete(asyncio.wait_for(rm.stats.call_one(), 30))
    finally:
        e.episodes.rm, e.episodes.cfg = None, cfg0
        loop.run_until_complete(asyncio.wait_for(procs.stop(), 30))
    scorer = StreamingScorer(path)
    assert len(src.rollouts) == 2 * GROUP and not src.released
    for r in src.rollouts:
        whole = scorer.score([list(r.prompt_tokens) + list(r.completion_tokens)])[0]
        assert r.reward == pytest.approx(2.0 * whole, abs=1e-4)  # reward_model.weight * score
        assert ENV_VERSION in r.versions  # an observation was part of the scored stream
    # chunks were prefilled before EOS (how many depends on the load: queued chunks join their finish)
    assert stats["prefill_tokens"] > 0 and stats["lost"] == 0 and stats["held"] == 0
    assert e.snapshot()["reward_latency_s"]
