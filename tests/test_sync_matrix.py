"""Every advertised weight-sync path in a real run: transport x on_update x rolling, two generators.

One pipeline (trainer, replay buffer, two vLLM generators, built with on_update=keep so every
strategy is safe on its engines) serves every case; each case rewires the transport
(`WeightSync.attach`) and runs a few steps of the job's own training loop (`TrainLoop.run`), then
checks that the served versions advanced with the trainer's and that no trained sample exceeded
max_staleness. The last case ends each stage with CoPRIS carry-over and checks that partial
rollouts were carried and resumed.

    .venv/bin/python -m pytest -q tests/test_sync_matrix.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest

from pipeline.config import load_config
from pipeline.driver.checkpointing import Checkpointing
from pipeline.driver.hooks import Hooks, step_hooks
from pipeline.driver.job import Job
from pipeline.driver.loop import TrainLoop, publish_for
from pipeline.driver.metrics import Progress
from pipeline.driver.shutdown import shut_down
from pipeline.weightsync.sync import WeightSync

from .conftest import REPO

pytestmark = pytest.mark.slow
STEPS = 3
SMALL = ["run.eval_every=0", "run.progress=false", "run.warm_start_steps=0", "buffer.batch_groups=2",
         "buffer.group_size=2", "generator.concurrency=4", "buffer.max_staleness=1", "generator.num_generators=2",
         "generator.on_update=keep",
         # the job here is unsupervised (no restart), and the suite's other file on the same 2 cores can
         # starve an engine for seconds: a false hang alarm would break the module's generators for
         # every case after it. Liveness has its own tests (test_generator, test_liveness).
         "generator.hang_timeout_s=60",
         # generation is the bottleneck (as in the long-tail workloads carry-over is for), so requests
         # are still running when a batch completes
         "generator.max_new_tokens=48", "generator.ignore_eos=true"]
CASES = [(t, m, r) for t, m, r in itertools.product(("shm", "rdma", "collective"), ("keep", "abort", "drain"),
                                                     (True, False))]


class ListSink:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log(self, step: int, metrics: dict, at: float | None = None) -> None:
        self.rows.append({"step": step, **metrics})

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def started_job(out_dir, *extra: str):
    loop = asyncio.new_event_loop()
    p = Job(load_config(REPO / "configs" / "tiny.yaml", [*SMALL, *extra, f"run.out_dir={out_dir}"]))
    try:
        loop.run_until_complete(p.start())
        loop.run_until_complete(p.start_generation())
        yield loop, p
    finally:
        loop.run_until_complete(shut_down(p))
        loop.close()


class SharedJob:
    """The module's job, shared by its cases and started anew after a case that failed or when a
    generator does not answer: one broken job (an engine lost on a loaded machine; the job here is
    unsupervised) fails its own case, not every case after it, each at its deadline."""

    def __init__(self, out_dir) -> None:
        self.out_dir, self.started, self.job, self.broken = out_dir, 0, None, False

    def get(self):
        if self.job is None or self.broken or not self._answers():
            self.close()
            self.started += 1
            self._gen = started_job(self.out_dir / f"job{self.started}")
            self.job, self.broken = next(self._gen), False
        return self.job

    def _answers(self) -> bool:
        loop, p = self.job

        async def versions() -> list[int]:
            return await asyncio.wait_for(asyncio.gather(*[g.version.call_one() for g in p.fleet.handles]), 60)

        try:
            loop.run_until_complete(versions())
            return True
        except Exception as e:
            print(f"the module's job stopped answering ({e!r}): starting a new one")
            return False

    def close(self) -> None:
        if self.job is not None:
            self.job = None
            next(self._gen, None)  # its finally: the job's shutdown


@pytest.fixture(scope="module")
def shared_job(tmp_path_factory):
    shared = SharedJob(tmp_path_factory.mktemp("matrix"))
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def pipe(shared_job, request):
    failed = request.session.testsfailed
    yield shared_job.get()
    if request.session.testsfailed > failed:  # the case's call failed: its job may be what broke
        shared_job.broken = True


@pytest.fixture
def long_pipe(tmp_path):
    """A job of its own whose requests are long (up to 200 tokens, ending at the model's EOS, so they
    do not end together): generation is then the bottleneck, and a batch completes while other
    requests are still sampling. With the matrix's short requests the
    buffer fills ahead of the trainer, and the only requests in flight when a batch is taken are the
    ones its freed room just admitted, cut before their first token (measured under a loaded suite:
    22-50 partials carried in 18 steps, none with a token)."""
    yield from started_job(tmp_path, "generator.max_new_tokens=200", "generator.ignore_eos=false")


def run_case(loop, pipe: Job, **changes) -> list[dict]:
    """Rewire the sync for this case's config and run STEPS steps of the real training loop."""
    base = pipe.cfg
    cfg = dataclasses.replace(
        base, weight_sync=dataclasses.replace(base.weight_sync, transport=changes.get("transport", "shm")),
        generator=dataclasses.replace(base.generator, on_update=changes.get("on_update", "keep"),
                                      rolling=changes.get("rolling", True),
                                      carry_over=changes.get("carry_over", "keep")),
        run=dataclasses.replace(base.run, steps=pipe.version + STEPS))
    first = pipe.version + 1
    pipe.cfg = cfg
    pipe.sync = WeightSync(pipe.trainer, pipe.fleet.handles, cfg)
    sink = ListSink()
    try:
        loop.run_until_complete(pipe.sync.attach(pipe.trainer_addr))
        hooks = step_hooks(pipe, sink, Progress(STEPS, False), Checkpointing(pipe), first)
        loop.run_until_complete(asyncio.wait_for(TrainLoop(pipe, publish_for(pipe), hooks).run(first), 180))
    finally:
        pipe.cfg = base
    return sink.rows


def served(loop, pipe: Job) -> list[int]:
    return [loop.run_until_complete(g.version.call_one()) for g in pipe.fleet.handles]


@pytest.mark.parametrize("transport,on_update,rolling", CASES)
def test_every_transport_and_strategy_advances_served_versions_within_staleness(pipe, transport, on_update, rolling):
    loop, p = pipe
    v0 = p.version
    rows = run_case(loop, p, transport=transport, on_update=on_update, rolling=rolling)
    assert [r["version/trainer"] for r in rows] == list(range(v0 + 1, v0 + STEPS + 1))
    gen = [r["version/generator"] for r in rows]
    assert gen == sorted(gen) and gen[-1] >= v0 + STEPS - 1, gen  # a push overlaps the next step
    assert max(r["staleness/max"] for r in rows) <= p.cfg.buffer.max_staleness
    assert served(loop, p) == [p.version, p.version]  # the loop ends with the last push landed
    assert all(r["sync/latency_s"] > 0 for r in rows[1:])
    stats = loop.run_until_complete(p.buffer.stats.call_one())
    assert stats["admitted_samples"] == stats["trained_samples"] + stats["dropped_samples"] + stats["held_samples"]


def test_carry_over_saves_partials_at_stage_end_and_resumes_them_on_new_weights(long_pipe):
    """CoPRIS: at each batch the in-flight rollouts end early as partials and resume on the next
    version. Each step is the job's own `TrainLoop.step`, taken while requests are in the engines (when
    generation outruns training, nothing is in flight at a batch and there is nothing to carry)."""
    loop, p = long_pipe
    base = p.cfg
    p.cfg = dataclasses.replace(base, generator=dataclasses.replace(base.generator, carry_over="save"))
    p.sync = WeightSync(p.trainer, p.fleet.handles, p.cfg)
    steps = TrainLoop(p, publish_for(p), Hooks([]))

    async def busy() -> bool:
        stats = await asyncio.gather(*[g.stats.call_one() for g in p.fleet.handles])
        return any(s["in_engine"] > 0 for s in stats)

    def moved(before: list[dict], after: list[dict], key: str) -> int:
        return sum(a[key] - b[key] for a, b in zip(after, before))

    async def go() -> tuple[list, list, list]:
        await p.sync.attach(p.trainer_addr)
        before = await asyncio.gather(*[g.stats.call_one() for g in p.fleet.handles])
        rows, busy_steps, wait_s = [], 0, 0.05
        # Requests of equal length started together also end together, so a stage end may find none
        # running; steps go on (at most 6 * STEPS) until partials were carried and resumed.
        for _ in range(6 * STEPS):  # a saturated buffer (admission shut until the trainer steps) idles
            deadline = time.monotonic() + 5  # the engines: then step anyway, which reopens admission
            while not (was_busy := await busy()) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            # A batch already complete ends the stage the moment the step begins, cutting requests
            # that were just submitted (no token sampled: nothing to carry). Requests that have been
            # sampling for a moment are cut with tokens: the moment doubles while cuts carry none
            # (a loaded machine's first decode step is slow), from 50 ms up to 3.2 s.
            await asyncio.sleep(wait_s if was_busy else 0)
            rows.append((await steps.step())[1])
            busy_steps += was_busy
            now = await asyncio.gather(*[g.stats.call_one() for g in p.fleet.handles])
            if was_busy and moved(before, now, "carried_samples") and not moved(before, now, "carried_tokens"):
                wait_s = min(2 * wait_s, 3.2)
            if busy_steps >= STEPS and moved(before, now, "carried_tokens") and moved(before, now, "reprefill_tokens"):
                break
        assert busy_steps >= STEPS, f"only {busy_steps} of {len(rows)} steps were taken with requests in the engines"
        print(f"carried and resumed within {len(rows)} steps ({busy_steps} busy)")
        await p.sync.wait()
        return before, await asyncio.gather(*[g.stats.call_one() for g in p.fleet.handles]), rows

    try:
        # under the suite's 600 s bound per test, so a stall fails here, naming this wait
        before, after, rows = loop.run_until_complete(asyncio.wait_for(go(), 420))
    finally:
        p.cfg = base
    assert moved(before, after, "carried_tokens") > 0, (f"nothing carried over in {len(rows)} steps "
                                                        f"({moved(before, after, 'carried_samples')} samples carried)")
    assert moved(before, after, "reprefill_tokens") > 0
    assert max(r["staleness/max"] for r in rows) <= p.cfg.buffer.max_staleness
    assert served(loop, p) == [p.version, p.version]


def test_an_eval_beside_training_reads_one_version_and_the_next_push_waits_for_it(pipe):
    """run.eval_overlap in the job's own loop and hooks: the step-0 eval and pre-flight probe run
    beside step 1, the step-2 eval beside step 3 (run.steps=3 evaluates at the end, waited for). Each
    eval is held 5 s after it scores (time for the next batch to be generated on loaded cores, so the
    next train step starts inside it), so a push that did not wait for it would land inside it: every
    generator serves one version from its start to its end, the version of its step, while a train
    step ran within it; metrics.jsonl keeps one row per step, in order, the evals' figures in theirs."""
    loop, p = pipe
    base, real_eval, real_train = p.cfg, p.evaluation.evaluate, p.trainer.train_step
    evals: list[tuple[list[int], list[int], float, float]] = []
    trains: list[float] = []

    async def evaluate() -> dict:
        t0 = time.monotonic()
        before = [await g.version.call_one() for g in p.fleet.handles]
        out = await real_eval()
        await asyncio.sleep(5.0)
        evals.append((before, [await g.version.call_one() for g in p.fleet.handles], t0, time.monotonic()))
        return out

    async def train_step(batch):
        trains.append(time.monotonic())
        return await real_train(batch)

    p.evaluation.evaluate, p.trainer.train_step = evaluate, train_step
    p.cfg = dataclasses.replace(base, run=dataclasses.replace(base.run, steps=3, eval_every=2, eval_overlap=True))
    p.sync = WeightSync(p.trainer, p.fleet.handles, p.cfg)
    sink, v0 = ListSink(), p.version
    try:
        loop.run_until_complete(p.sync.attach(p.trainer_addr))
        hooks = step_hooks(p, sink, Progress(3, False), Checkpointing(p), 1)
        loop.run_until_complete(asyncio.wait_for(TrainLoop(p, publish_for(p), hooks).run(1), 300))
    finally:
        p.cfg, p.evaluation.evaluate, p.trainer.train_step = base, real_eval, real_train
    assert [r["step"] for r in sink.rows] == [0, 1, 2, 3]
    assert [r["step"] for r in sink.rows if "eval/reward" in r] == [0, 2, 3]
    assert "preflight/spread_share" in sink.rows[0] and "eval/time_s" in sink.rows[2]
    assert [(b, a) for b, a, _, _ in evals] == [([v] * 2, [v] * 2) for v in (v0, v0 + 2, v0 + 3)]
    # step 1 started training before the step-0 eval ended, step 3 before the step-2 eval ended (each
    # may start a moment before its eval's first line runs: the eval is a task the loop does not await)
    assert trains[0] < evals[0][3] and evals[0][3] < trains[2] < evals[1][3], (evals, trains)


def test_a_failing_eval_beside_training_fails_the_run_and_its_rows_are_written(pipe):
    """The eval pinned at step 2 raises: the run fails with its error at the next push, and the rows
    held for it (step 2's) are written without its figures."""
    loop, p = pipe
    base, real_eval = p.cfg, p.evaluation.evaluate
    calls = []

    async def evaluate() -> dict:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the held-out scorer broke")
        return await real_eval()

    p.evaluation.evaluate = evaluate
    p.cfg = dataclasses.replace(base, run=dataclasses.replace(base.run, steps=4, eval_every=2, eval_overlap=True))
    p.sync = WeightSync(p.trainer, p.fleet.handles, p.cfg)
    sink = ListSink()
    try:
        loop.run_until_complete(p.sync.attach(p.trainer_addr))
        hooks = step_hooks(p, sink, Progress(4, False), Checkpointing(p), 1)
        with pytest.raises(RuntimeError, match="the held-out scorer broke"):
            loop.run_until_complete(asyncio.wait_for(TrainLoop(p, publish_for(p), hooks).run(1), 300))
        assert p.pinned is None
    finally:
        p.cfg, p.evaluation.evaluate = base, real_eval
        loop.run_until_complete(p.sync.wait())
    assert [r["step"] for r in sink.rows] == [0, 1, 2] and "eval/reward" in sink.rows[0]
    assert "eval/reward" not in sink.rows[2]
