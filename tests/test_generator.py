"""GeneratorActor on real Monarch procs with a real vLLM CPU engine and the tiny model.

One engine (built with on_update=keep, so prefix caching is off and every strategy is safe on it)
serves all tests; each weight update loads a different tiny checkpoint (seed k -> version k) through
the generator's own weight-sync endpoints (`serve_checkpoint`: a same-host shm WeightSender here ->
attach_weights -> stage_weights -> apply_weights). The work source is a real queue-backed actor defined here, feeding real
prompts from pipeline.tasks.reverse. Trainer logprobs come from pipeline.models.hf (torchtitan, fp32).

    .venv/bin/python -m pytest -q tests/test_generator.py -x
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections import deque
from pathlib import Path

import pytest
import torch
from monarch.actor import Actor, endpoint, this_host

from actors.generator import GeneratorActor
from pipeline.config import Config, GeneratorConfig, ModelConfig
from pipeline.generator.liveness import WORKING_CAP_FACTOR
from pipeline.models.hf import build_model, token_logprobs
from pipeline.models.tiny import TinySpec, ensure_tiny
from pipeline.procs import descendants
from pipeline.tasks import load_task, take
from pipeline.types import PromptGroup, PromptItem

from tests.conftest import REPO

N_PRIME, GROUP, MAX_NEW = 4, 2, 160
CACHE = str(REPO / ".cache" / "tiny-model")


class QueueSource(Actor):
    """A tiny real work source: admits groups from a list of prompts, records rollouts and releases."""

    def __init__(self):
        self.items: deque[PromptItem] = deque()
        self.rollouts, self.released, self.next_id = [], [], itertools.count()

    @endpoint
    async def feed(self, items: list[PromptItem]) -> None:
        self.items.extend(items)

    @endpoint
    async def admit(self, wait_s: float, lessee=None) -> PromptGroup | None:
        if not self.items:
            await asyncio.sleep(min(wait_s, 0.05))
            return None
        return PromptGroup(next(self.next_id), self.items.popleft(), GROUP, admitted_version=0)

    @endpoint
    async def add(self, rollout, lessee=None) -> None:
        rollout.validate()
        self.rollouts.append(rollout)

    @endpoint
    async def release(self, group_id: int, lessee=None) -> bool:
        self.released.append(group_id)
        return True

    @endpoint
    async def drain(self) -> tuple[list, list, int]:
        """Rollouts and releases so far (cleared), and prompts not yet admitted."""
        out = (self.rollouts, self.released, len(self.items))
        self.rollouts, self.released = [], []
        return out


def make_cfg() -> Config:
    return Config(model=ModelConfig(hf_dir=str(ckpt(0))), generator=GeneratorConfig(
        concurrency=N_PRIME, on_update="keep", carry_over="keep", max_new_tokens=MAX_NEW, ignore_eos=True,
        temperature=1.0, max_model_len=256, start_timeout_s=240, request_timeout_s=120))


def ckpt(seed: int):
    return ensure_tiny(TinySpec(seed=seed), CACHE)


async def serve_checkpoint(gen, version: int, on_update: str) -> int:
    """Make `gen` serve tiny checkpoint seed `version` as `version` through its production endpoints."""
    from pipeline.config import WeightSyncConfig
    from pipeline.models.hf import load_hf_state_dict
    from pipeline.weightsync import WeightSender

    sd = load_hf_state_dict(ckpt(version))
    sender = WeightSender(WeightSyncConfig(transport="shm"), sd, num_receivers=1)
    try:
        await gen.attach_weights.call_one(sender.handle(), 0)
        await sender.push(sd, version)
        await gen.stage_weights.call_one(version)
        return await gen.apply_weights.call_one(version, on_update)
    finally:
        sender.close()


@pytest.fixture(scope="module")
def env():
    loop = asyncio.new_event_loop()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    src_procs = this_host().spawn_procs(per_host={"procs": 1})
    gen = procs.spawn("gen", GeneratorActor, make_cfg(), 0)
    src = src_procs.spawn("src", QueueSource)
    info = loop.run_until_complete(gen.setup.call_one())
    assert info["generator_id"] == 0
    models: dict[int, torch.nn.Module] = {}

    def model(version: int):
        if version not in models:
            models[version] = build_model(ckpt(version))[0].eval()
        return models[version]

    yield loop, gen, src, model
    # Tests use versions relative to the one served when they start (`now`), so each passes alone
    # and in any order: the engine serving version k always holds checkpoint seed k.
    loop.run_until_complete(gen.shutdown.call_one())
    loop.run_until_complete(procs.stop())
    loop.run_until_complete(src_procs.stop())
    loop.close()


def prompts(n: int, seed: int) -> list[PromptItem]:
    return take(load_task("pipeline.tasks.reverse"), seed, "train", n)


async def wait_until(pred, timeout_s: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        v = await pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(every)


async def run_stage_with_update(gen, src, version: int, on_update: str, n_prompts: int, seed: int):
    """Start a stage, update to `version` mid-flight, end the stage, wait until idle; return rollouts."""
    base = (await gen.stats.call_one())["groups"]
    await src.feed.call_one(prompts(n_prompts, seed))
    await gen.start_generation.call_one(src)
    await wait_until(lambda: _all_sampling(gen), 60, "N' requests in the engine, each past its first token")
    served = await serve_checkpoint(gen, version, on_update)
    assert served == version == await gen.version.call_one()
    await finish_stage(gen, base + n_prompts)
    rollouts, released, _ = await src.drain.call_one()
    assert not released
    return rollouts


async def finish_stage(gen, groups: int, carry_over: str = "keep"):
    """Once `groups` groups were admitted and started, end the stage and wait for the engine to idle."""
    async def started():
        s = await gen.stats.call_one()
        return s["groups"] == groups and s["pending"] == 0
    await wait_until(started, 120, f"{groups} groups admitted and started")
    await gen.end_stage.call_one(carry_over)
    await wait_until(lambda: _idle(gen), 120, "in-flight requests to finish")


async def _all_in_engine(gen):
    return (await gen.stats.call_one())["in_engine"] == N_PRIME


async def _all_sampling(gen):
    """Every one of the N' requests is in the engine and has sampled its first token (a cut before it
    carries nothing: on a loaded machine the prefill can take a while)."""
    s = await gen.stats.call_one()
    return s["in_engine"] == N_PRIME and s["prefilling"] == 0


async def _idle(gen):
    s = await gen.stats.call_one()
    return s["in_flight"] == 0 and s["sending"] == 0  # every finished rollout reached the source


def recompute(model, r) -> torch.Tensor:
    ids = torch.tensor([list(r.prompt_tokens) + list(r.completion_tokens)])
    with torch.no_grad():
        lp = token_logprobs(model, ids)[0]
    return lp[len(r.prompt_tokens) - 1:]


def check_against_trainer(model_of, r, exact_versions: set[int]) -> None:
    """Tokens of a version in `exact_versions` match that version's trainer logprobs (fp32, 1e-3)."""
    versions = torch.tensor(r.versions)
    beh = torch.tensor(r.logprobs)
    for v in sorted(set(r.versions) & exact_versions):
        mask = versions == v
        err = (recompute(model_of(v), r)[mask] - beh[mask]).abs().max().item()
        assert err <= 1e-3, f"group {r.group_id}: version-{v} tokens differ from the trainer by {err:.2e}"


def now(loop, gen) -> int:
    return loop.run_until_complete(gen.version.call_one())


def test_in_flight_stays_at_n_prime_while_prompts_remain(env):
    loop, gen, src, model = env
    v = now(loop, gen) + 1

    async def go():
        await src.feed.call_one(prompts(12, seed=1))
        await gen.start_generation.call_one(src)
        await wait_until(lambda: _all_in_engine(gen), 60, "N' requests in the engine")
        samples = []
        served = await serve_checkpoint(gen, v, "keep")
        deadline = time.monotonic() + 120
        while (s := await gen.stats.call_one())["groups"] < 12 or s["pending"] > 0:
            assert s["error"] is None and time.monotonic() < deadline, s["error"] or "12 groups not admitted in 120s"
            if s["pending"] > 0:
                samples.append(s["in_flight"])
            await asyncio.sleep(0.01)
        await finish_stage(gen, 12)
        rollouts, _, _ = await src.drain.call_one()
        return served, samples, rollouts

    served, samples, rollouts = loop.run_until_complete(go())
    assert served == v and len(rollouts) == 12 * GROUP
    assert len(samples) >= 10, f"too few samples while prompts remained: {samples}"
    assert all(n == N_PRIME for n in samples), f"in-flight count left N'={N_PRIME}: {samples}"


def test_keep_versions_and_logprobs(env):
    loop, gen, src, model = env
    v = now(loop, gen)
    rollouts = loop.run_until_complete(run_stage_with_update(gen, src, v + 1, "keep", 8, seed=2))
    assert len(rollouts) == 8 * GROUP
    spanning = [r for r in rollouts if set(r.versions) == {v, v + 1}]
    assert spanning, "no trajectory spanned the update"
    for r in rollouts:
        assert list(r.versions) == sorted(r.versions), "versions must only move forward"
        assert len(r.completion_tokens) == MAX_NEW and r.finish_reason == "length"
        check_against_trainer(model, r, {v})  # old-version tokens are exact
        if set(r.versions) == {v + 1}:
            check_against_trainer(model, r, {v + 1})  # one-version trajectories are exact
    # how closely the engine reproduces the old weights on tokens they sampled (~1e-6 in fp32)
    floor = max((recompute(model(v), r)[torch.tensor(r.versions) == v] - torch.tensor(r.logprobs)[
        torch.tensor(r.versions) == v]).abs().max().item() for r in spanning)
    for r in spanning:
        # The first new-version token is sampled by the new weights over stale KV, so it matches
        # neither model; had the old weights sampled it, it would match them to within the floor.
        k = r.versions.index(v + 1)
        old = recompute(model(v), r)[k].item()
        assert abs(old - r.logprobs[k]) > max(10 * floor, 1e-5), \
            f"token labelled with the new version was sampled by the old one ({abs(old - r.logprobs[k]):.1e}, " \
            f"floor {floor:.1e})"
        assert r.reprefill_tokens == 0


def test_abort_resumes_on_exact_tokens_under_new_weights(env):
    loop, gen, src, model = env
    v = now(loop, gen)
    before = loop.run_until_complete(gen.stats.call_one())
    rollouts = loop.run_until_complete(run_stage_with_update(gen, src, v + 1, "abort", 8, seed=3))
    spanning = [r for r in rollouts if set(r.versions) == {v, v + 1}]
    assert spanning, "no trajectory spanned the update"
    for r in rollouts:
        assert list(r.versions) == sorted(r.versions)
        # Both parts match the trainer exactly: old tokens under version 2, and the resumed part under
        # the new version conditioned on exactly those tokens (a fresh re-prefill, no stale KV).
        check_against_trainer(model, r, {v, v + 1})
    for r in spanning:
        assert r.reprefill_tokens == len(r.prompt_tokens) + r.versions.index(v + 1)
    stats = loop.run_until_complete(gen.stats.call_one())
    assert stats["reprefill_tokens"] - before["reprefill_tokens"] == sum(r.reprefill_tokens for r in rollouts) > 0
    assert stats["updates"] == before["updates"] + 1 and len(stats["pause_s"]) == stats["updates"]


def test_drain_gives_every_trajectory_one_version(env):
    loop, gen, src, model = env
    v = now(loop, gen)
    rollouts = loop.run_until_complete(run_stage_with_update(gen, src, v + 1, "drain", 8, seed=4))
    assert len(rollouts) == 8 * GROUP
    assert {r.versions[0] for r in rollouts} == {v, v + 1}, "expected trajectories on both sides of the update"
    for r in rollouts:
        assert len(set(r.versions)) == 1, f"group {r.group_id} has versions {set(r.versions)}"
        check_against_trainer(model, r, {v, v + 1})


def test_save_carries_partials_into_next_stage(env):
    loop, gen, src, model = env

    async def go():
        s0 = await gen.stats.call_one()
        await src.feed.call_one(prompts(4, seed=5))
        await gen.start_generation.call_one(src)
        await wait_until(lambda: _all_in_engine(gen), 60, "N' requests in the engine")
        ended = await gen.end_stage.call_one("save")
        s1 = await gen.stats.call_one()
        first, _, _ = await src.drain.call_one()
        await gen.start_generation.call_one(src)
        await finish_stage(gen, s0["groups"] + 4)
        second, _, _ = await src.drain.call_one()
        return ended, first, second, s1["carried_tokens"] - s0["carried_tokens"]

    ended, first, second, carried_tokens = loop.run_until_complete(go())
    assert ended["carried"] >= 1 and ended["running"] == 0
    assert len(first) + len(second) == 4 * GROUP
    # a partial cut after its first token resumes with prompt + tokens re-prefilled; one cut before
    # any token was sampled (in the engine, not yet decoded) starts afresh, with nothing to re-prefill
    resumed = [r for r in second if r.reprefill_tokens > 0]
    assert len(resumed) <= ended["carried"]
    assert (len(resumed) >= 1) == (carried_tokens > 0)
    assert sum(r.reprefill_tokens for r in resumed) >= carried_tokens
    v = now(loop, gen)
    for r in first + second:
        assert len(r.completion_tokens) == MAX_NEW and set(r.versions) == {v}
        check_against_trainer(model, r, {v})


def test_stage_end_carries_partials_that_resume_on_new_weights_with_their_own_logprobs(env):
    """CoPRIS stage end: in-flight rollouts are cut at the stage end, kept with their tokens, logprobs
    and versions, and resumed first once the next version loads; the cross-stage importance weight of
    every carried token uses that token's own behaviour logprob (the old version's)."""
    from pipeline import losses
    from pipeline.config import TrainerConfig

    loop, gen, src, model = env
    v = now(loop, gen)

    async def go():
        base = (await gen.stats.call_one())["groups"]
        await src.feed.call_one(prompts(4, seed=7))
        await gen.start_generation.call_one(src)
        await wait_until(lambda: _all_sampling(gen), 60, "N' requests in the engine, each past its first token")
        ended = await gen.end_stage.call_one("save", True)
        first, _, _ = await src.drain.call_one()
        served = await serve_checkpoint(gen, v + 1, "keep")  # resumes the stage
        await finish_stage(gen, base + 4)
        second, _, _ = await src.drain.call_one()
        return ended, served, first, second, await gen.stats.call_one()

    ended, served, first, second, stats = loop.run_until_complete(go())
    assert served == v + 1 and ended["carried"] >= 1 and stats["carried_tokens"] > 0
    assert len(first) + len(second) == 4 * GROUP
    spanning = [r for r in second if set(r.versions) == {v, v + 1}]
    assert len(spanning) == ended["carried"], "every carried partial resumes on the new version"
    cfg = TrainerConfig(correction="tis", is_cap=1e9)
    for r in spanning:
        check_against_trainer(model, r, {v, v + 1})  # old tokens: version v's logprobs; new: v + 1's
        k = r.versions.index(v + 1)
        assert r.reprefill_tokens == len(r.prompt_tokens) + k
        learner = recompute(model(v + 1), r)[None]  # π_old at training time: the newest weights
        mu = torch.tensor([r.logprobs])
        w, _ = losses.is_weights(learner, mu, torch.ones_like(mu), cfg)
        own = torch.exp(learner[0, :k] - recompute(model(v), r)[:k])  # each carried token's own μ
        assert torch.allclose(w[0, :k], own, rtol=1e-2, atol=1e-3)


def test_bad_requests_fail_alone_and_are_counted(env):
    loop, gen, src, model = env
    bad = [PromptItem(10_000, ""), PromptItem(10_001, "rev " + "a" * 300 + "=")]

    async def go():
        s0 = await gen.stats.call_one()
        await src.feed.call_one(bad + prompts(3, seed=6))
        await gen.start_generation.call_one(src)
        await finish_stage(gen, s0["groups"] + 5)
        rollouts, released, _ = await src.drain.call_one()
        with pytest.raises(Exception, match="bad_sampling_params"):
            await gen.generate_eval.call_one(["rev abc="], 0)
        texts = await gen.generate_eval.call_one(["rev abc=", "rev hgf="], 8)
        return s0["failed"], (await gen.stats.call_one())["failed"], rollouts, released, texts

    before, after, rollouts, released, texts = loop.run_until_complete(go())
    for reason in ("empty_prompt", "prompt_too_long"):
        assert 1 <= after.get(reason, 0) - before.get(reason, 0) <= GROUP, (reason, after)
    assert len(released) == 2
    assert len(rollouts) == 3 * GROUP
    assert len(texts) == 2 and all(isinstance(t, str) and len(t) <= 8 for t in texts)


def test_stats_answers_while_an_eval_runs(env):
    """The supervisor's probe (stats, concurrent) is not queued behind a long eval: generate_eval is a
    serial endpoint (actors/endpoints.py), not a plain one that Monarch's dispatch loop awaits. The
    engine core is stopped for a moment so the eval cannot finish before stats answers (well under
    the hang bound); with a plain endpoint stats would answer only after the eval."""
    loop, gen, _, _ = env
    cores = [p for p, _ in descendants(os.getpid()) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    if not cores or loop.run_until_complete(gen.stats.call_one())["error"]:
        pytest.skip("the engine was killed by an earlier test of this module; run this test alone")

    async def go():
        os.kill(cores[0], signal.SIGSTOP)
        try:
            ev = asyncio.ensure_future(gen.generate_eval.call_one(["rev abc=", "rev hgf="], 8))
            await asyncio.sleep(0.5)
            s = await asyncio.wait_for(gen.stats.call_one(), 10)
            pending = not ev.done()
        finally:
            os.kill(cores[0], signal.SIGCONT)
        return s, pending, await asyncio.wait_for(ev, 60)

    s, pending, texts = loop.run_until_complete(go())
    assert pending, "stats answered only after the eval"
    assert s["error"] is None, s["error"]
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_feeds_the_real_replay_buffer(env):
    """The production wiring: admit(wait_s) / add / release against ReplayBufferActor, then a Batch."""
    from actors.replay_buffer import ReplayBufferActor
    from pipeline.config import BufferConfig
    from pipeline.models.tiny import TINY_PAD_ID

    loop, gen, src, model = env
    cfg = make_cfg()
    cfg.buffer = BufferConfig(group_size=GROUP, batch_groups=2, max_staleness=0, overcommit="none")

    async def go():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            buf = procs.spawn("buf", ReplayBufferActor, cfg, TINY_PAD_ID)
            version = await gen.version.call_one()
            await buf.finish_step.call_one(version, 0.0)
            await gen.start_generation.call_one(buf)
            batch = await buf.get_batch.call_one(version, 120.0)
            await gen.end_stage.call_one("keep")
            await wait_until(lambda: _idle(gen), 120, "in-flight requests to finish")
            return version, batch, await gen.stats.call_one()
        finally:
            await procs.stop()

    version, batch, stats = loop.run_until_complete(go())
    assert batch.num_samples == 2 * GROUP and stats["error"] is None
    mask = batch.loss_mask.bool()
    assert (batch.versions[mask] == version).all() and (batch.behaviour_logprobs[mask] < 0).all()
    assert int(mask.sum()) == batch.num_samples * MAX_NEW


def test_the_engine_core_is_the_generator_procs_child_on_the_cores_vllm_chose(env):
    """The engine core is forked from the generator proc (pipeline/generator/llm.py): it is that proc's
    child, and its OpenMP settings are still the ones vLLM's executor chose for it, which a forked
    process's OpenMP does not read from the environment: every thread runs on those cores only."""
    loop, gen, _, _ = env
    if "died" in (loop.run_until_complete(gen.stats.call_one()).get("error") or ""):
        pytest.skip("the engine was killed by an earlier test of this module; run this test alone")
    cores = [p for p, _ in descendants(os.getpid()) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(cores) == 1, cores
    core = cores[0]
    proc = int(Path(f"/proc/{core}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert b"EngineCore" not in Path(f"/proc/{proc}/cmdline").read_bytes()  # the generator proc itself
    allowed = os.sched_getaffinity(proc)
    if len(allowed) > 1:  # vLLM keeps a core for the generator proc
        for t in os.listdir(f"/proc/{core}/task"):
            assert os.sched_getaffinity(int(t)) < allowed, (t, os.sched_getaffinity(int(t)), allowed)


def test_engine_core_killed_during_a_weight_apply_fails_it_within_seconds(env):
    """Runs last: it kills the module's engine. An engine call in flight when the core dies never
    returns; the apply (pause, load, label, resume) must fail within seconds naming the dead engine,
    not after weight_sync.timeout_s, and the generator must report itself broken."""
    from pipeline.config import WeightSyncConfig
    from pipeline.models.hf import load_hf_state_dict
    from pipeline.weightsync import WeightSender

    loop, gen, _, _ = env
    cores = [p for p, _ in descendants(os.getpid())
             if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(cores) == 1, cores
    version = now(loop, gen) + 1
    sd = load_hf_state_dict(ckpt(version))
    sender = WeightSender(WeightSyncConfig(transport="shm", timeout_s=600), sd, num_receivers=1)

    async def go() -> tuple[BaseException | None, float]:
        await gen.attach_weights.call_one(sender.handle(), 0)
        await sender.push(sd, version)
        await gen.stage_weights.call_one(version)
        os.kill(cores[0], signal.SIGSTOP)  # every engine call now hangs, as on a dead core
        apply = asyncio.ensure_future(gen.apply_weights.call_one(version, "keep"))
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        os.kill(cores[0], signal.SIGKILL)
        try:
            await asyncio.wait_for(apply, 60)
        except Exception as e:
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0

    try:
        err, took = loop.run_until_complete(go())
    finally:
        sender.close()
    assert err is not None and "engine" in str(err) and "died" in str(err), err
    # the death notice failed the apply (60 s of waiting would have raised a TimeoutError without "died")
    print(f"the apply failed {took:.1f}s after the engine core died")
    assert "died" in loop.run_until_complete(gen.stats.call_one())["error"]


def test_watch_returns_once_the_idle_engine_core_dies(env):
    """Runs last (after, or instead of, the kill above): a long-held watch, with nothing in flight,
    returns the failure's text within seconds of the engine core's death, without any other call."""
    loop, gen, _, _ = env

    async def go() -> tuple[str, float]:
        watch = asyncio.ensure_future(gen.watch.call_one())
        cores = [p for p, _ in descendants(os.getpid()) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
        if cores:  # still alive (this test runs alone): the watch must be held until the core dies
            await asyncio.sleep(1.0)
            assert not watch.done(), "watch returned while the generator was sound"
            os.kill(cores[0], signal.SIGKILL)
        t0 = time.monotonic()
        return await asyncio.wait_for(watch, 30), time.monotonic() - t0

    text, took = loop.run_until_complete(go())
    assert "died" in text, (text, took)  # the death notice, not the 30 s wait, ended the watch


def test_a_stopped_engine_core_is_found_hung_within_its_bound(env):
    """Liveness from progress (generator.hang_timeout_s) on the real engine, both sides: with requests
    in flight, a stall shorter than the bound (SIGSTOP, then SIGCONT after 3 s: a slow engine) is left
    alone; a core stopped for good is found hung within its bound, the watch returning the evidence.
    Breaks the generator: runs after the kill tests above, so in a whole-file run their kill leaves no
    core and it is skipped; run it alone: pytest tests/test_generator.py -k stopped_engine_core."""
    loop, gen, src, _ = env
    cores = [p for p, _ in descendants(os.getpid()) if b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    if not cores or loop.run_until_complete(gen.stats.call_one())["error"]:
        pytest.skip("the engine was killed by an earlier test of this module; run this test alone")
    base = make_cfg().generator.hang_timeout_s

    async def go() -> tuple[dict, str, float]:
        watch = asyncio.ensure_future(gen.watch.call_one())
        await src.feed.call_one(prompts(200, seed=5))
        await gen.start_generation.call_one(src)
        await wait_until(lambda: _all_in_engine(gen), 60, "N' requests in the engine")
        os.kill(cores[0], signal.SIGSTOP)  # a slow engine: a 3 s stall, under the bound
        await asyncio.sleep(3.0)
        os.kill(cores[0], signal.SIGCONT)
        await asyncio.sleep(base + 2.0)
        slow = await gen.stats.call_one()
        assert not watch.done() and slow["error"] is None, slow["error"]
        os.kill(cores[0], signal.SIGSTOP)  # hung for good
        t0 = time.monotonic()
        try:
            text = await asyncio.wait_for(watch, 60)
        finally:
            os.kill(cores[0], signal.SIGCONT)
        return slow, text, time.monotonic() - t0

    slow, text, took = loop.run_until_complete(go())
    print(f"stopped engine core found hung after {took:.1f}s: {text}")
    assert "hung" in text and "requests in the engine" in text, text
    # found by the stopped processes' missing CPU use at the bound, not by the working engine's cap
    assert "CPU s in the last" in text and "(working" not in text, text
    assert took < WORKING_CAP_FACTOR * slow["hang_bound_s"], (took, slow["hang_bound_s"])
