"""A weight push overlapping the next train step, timed as the async controller orders them
(tools.bench.trainer_bench --overlap, and the planner's calibration of the push's cost to the trainer).

    pushes = await push_overlap(trainer, batches, print)
"""

from __future__ import annotations

import time

from pipeline.types import Batch


async def push_overlap(trainer, batches: list[Batch], bar) -> dict:
    """The async controller's order (WeightSync.start, then the next train_step): the push of version v
    (gather, snapshot and pack on the trainer rank 0; it returns once packed) is awaited, then the
    step is issued. "With a push" times both, i.e. how much later the next step ends because of the
    push; a receiver (shm, in this process) pulls v afterwards. Steps with and without a push
    alternate (the order flips each pair), so load on the machine hits both alike."""
    import statistics

    from pipeline.config import WeightSyncConfig
    from pipeline.weightsync import WeightReceiver

    receiver = WeightReceiver(await trainer.sync_handle(1, "127.0.0.1", WeightSyncConfig(transport="shm")), 0)
    alone, with_push, ratios, push_s = [], [], [], []

    async def step(b: Batch, push: bool) -> float:
        t = time.perf_counter()
        wv = None
        if push:  # as WeightSync.start: the step is issued once the trainer says the snapshot is packed
            wv = await trainer.push_weights()
            push_s.append(time.perf_counter() - t)
        await trainer.train_step(b)
        dt = time.perf_counter() - t
        if wv is not None:  # the receiver pulls after the step here; in a run a generator pulls meanwhile
            await receiver.pull(wv.version)
        return dt

    try:
        for i, b in enumerate(batches):
            first = i % 2 == 0
            a = await step(b, push=not first)
            c = await step(b, push=first)
            plain, pushed = (c, a) if first else (a, c)
            alone.append(plain)
            with_push.append(pushed)
            ratios.append(pushed / plain)
            bar(f"pair {i + 1}/{len(batches)}: {plain * 1e3:.0f} ms alone, {pushed * 1e3:.0f} ms with a push "
                f"before it ({ratios[-1]:.2f}x); the push itself {push_s[-1] * 1e3:.0f} ms")
    finally:
        receiver.close()
    med = statistics.median
    return {"pairs": len(ratios), "step_s_alone_median": med(alone), "step_s_with_push_median": med(with_push),
            "with_push_over_alone_median": med(ratios), "with_push_over_alone_min": min(ratios),
            "with_push_over_alone_max": max(ratios), "push_s_median": med(push_s),
            "push_over_step_median": med(push_s) / med(alone)}
