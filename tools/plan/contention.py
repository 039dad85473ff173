"""`python -m tools.plan calibrate`'s contention part: what the trainer and the generator cost each other here.

The cost file's component figures are each measured alone; in a run the trainer's step and the
generator's decoding overlap, and on this machine they share two cores (and the memory bus):
`--placement disjoint` pins the trainer to one core and the generator to the other, yet a train step
was measured 1.0-2.5x its calibrated time in pipeline runs. This measures the two factors of the
cost file's `contention` section with the project's own Trainer and GeneratorActor, placed as
tools/bench/pipeline_bench.py places them, in one session, alternating (so a burst of other work on the
cores does not land on one side of a ratio only):

    alone     K train steps (N x T synthetic batch), nothing else running;
              K generator waves (n samples of L tokens), nothing else running
    together  generation kept busy (back-to-back waves) while K train steps are timed;
              training kept busy (back-to-back steps) while K waves are timed

    trainer_factor   = median(train step, generation busy) / median(train step alone)
    generator_factor = median(wave, training busy) / median(wave alone)

Both are floored at 1 (a ratio below 1 is noise: nothing speeds up by sharing). The raw times go to
the calibration record.

Example:
    rows = asyncio.run(measure_contention(cfg, reps=3))
    fit = fit_contention(rows)       # {"trainer_factor": 1.4, "generator_factor": 1.2}
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

from pipeline.config import Config
from pipeline.types import PromptItem
from pipeline.trainer.synthetic import synthetic_batch
from tools.lib.sources import TimedSource, wait_wave
from tools.plan.inrun import say

WAVE = (16, 64)
"""(samples, tokens each) of a timed generator wave: a run's typical running set here."""
TRAIN = (32, 112)
"""(samples, padded tokens) of a timed train step: a B=8, G=4 batch of the validation's workload."""


async def measure_contention(cfg: Config, reps: int, steps: int = 4) -> list[dict]:
    """Rows {"side": "trainer"|"generator", "state": "alone"|"together", "s": seconds}, `steps` of each
    per state per repeat."""
    from monarch.actor import this_host

    from actors.generator import GeneratorActor
    from actors.trainer import Trainer
    from pipeline.models.hf import model_dir, read_hf_config

    G = 4
    g = dataclasses.replace(cfg.generator, concurrency=32, max_new_tokens=96, ignore_eos=True)
    cfg = dataclasses.replace(cfg, generator=g)
    vocab = read_hf_config(model_dir(cfg.model))["vocab_size"]
    gprocs = this_host().spawn_procs(per_host={"procs": 1})
    sprocs = this_host().spawn_procs(per_host={"procs": 1})
    gen = gprocs.spawn("gen", GeneratorActor, cfg, 0)
    src = sprocs.spawn("src", TimedSource, G, cfg)  # on the buffer's cores, as in a run
    trainer = None
    rows: list[dict] = []
    uid = [0]

    async def wave() -> float:
        n, L = WAVE
        items = []
        for _ in range(n // G):
            uid[0] += 1
            items.append(PromptItem(uid=uid[0], prompt="rev abcdef=", answer="x", max_new_tokens=L))
        await src.feed.call_one(items)
        return (await wait_wave(src, n, 120, "contention wave"))[1]

    async def step(seed: int) -> float:
        batch = synthetic_batch(*TRAIN, 8, vocab, seed)
        t0 = time.perf_counter()
        await trainer.train_step(batch)
        return time.perf_counter() - t0

    async def keep_busy(fn, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await fn()

    try:
        say(f"contention: starting the generator (cpus {cfg.generator.cpus or 'unpinned'}) and the trainer "
             f"(cpus {cfg.trainer.cpus or 'unpinned'})")
        await asyncio.wait_for(gen.setup.call_one(), cfg.generator.start_timeout_s)
        await gen.start_generation.call_one(src)
        trainer = await Trainer.start(cfg, name="contention")
        await step(0)
        await wave()  # warm-up of both
        for rep in range(reps):
            for _ in range(steps):
                rows.append({"side": "trainer", "state": "alone", "s": await step(rep + 1)})
            for _ in range(steps):
                rows.append({"side": "generator", "state": "alone", "s": await wave()})
            stop = asyncio.Event()
            bg = asyncio.create_task(keep_busy(wave, stop))
            await asyncio.sleep(0.05)  # the first wave's requests are running
            for _ in range(steps):
                rows.append({"side": "trainer", "state": "together", "s": await step(rep + 1)})
            stop.set()
            await asyncio.wait_for(bg, 120)
            stop = asyncio.Event()
            bg = asyncio.create_task(keep_busy(lambda: step(rep + 1), stop))
            await asyncio.sleep(0.02)
            for _ in range(steps):
                rows.append({"side": "generator", "state": "together", "s": await wave()})
            stop.set()
            await asyncio.wait_for(bg, 120)
            say(f"contention: pass {rep + 1}/{reps} {fit_contention(rows)}")
        await gen.end_stage.call_one("keep")
        await gen.shutdown.call_one()
    finally:
        if trainer is not None:
            await trainer.close()
        await gprocs.stop()
        await sprocs.stop()
    return rows


def fit_contention(rows: list[dict]) -> dict:
    """The cost file's contention section from measure_contention's rows (module docstring)."""
    def med(side: str, state: str) -> float:
        xs = [r["s"] for r in rows if r["side"] == side and r["state"] == state]
        if not xs:
            raise ValueError(f"contention: no {side} {state} measurement")
        return statistics.median(xs)
    return {"trainer_factor": max(1.0, med("trainer", "together") / med("trainer", "alone")),
            "generator_factor": max(1.0, med("generator", "together") / med("generator", "alone"))}
