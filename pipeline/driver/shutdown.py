"""Shutdown: close -> cancel -> stop, bounded, never raising over the run's own error.

    await shut_down(job)                                  # at most SHUTDOWN_TIMEOUT_S, all of it
    ok = await settle({"a": aw_a, "b": aw_b}, deadline)   # the bounded, concurrent step it is made of
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60.0
GENERATOR_CLOSE_S = 15.0


async def settle(steps: dict[Any, Awaitable[Any]], deadline: float, name: str = "{}") -> dict[Any, bool]:
    """Run shutdown steps (key -> awaitable) concurrently until all end or `deadline` (loop time);
    log each failure (the step named name.format(key)) and cancel what is late. Returns which steps
    succeeded, by key. Raises only the caller's own cancellation."""
    tasks = {asyncio.ensure_future(aw): key for key, aw in steps.items()}
    if not tasks:
        return {}
    try:
        done, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    for t in late:
        t.cancel()
        log.error("shutdown: %s still running at the shutdown's deadline; cancelled", name.format(tasks[t]))
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.warning("shutdown: %s failed: %s: %s", name.format(tasks[t]), type(t.exception()).__name__,
                        t.exception())
    return {key: t in done and not t.cancelled() and t.exception() is None for t, key in tasks.items()}


async def shut_down(job: Any, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop every proc mesh of `job`, whatever of it started, within timeout_s overall.

    Contract, in order: cancel the push in flight and wait for it to end; close every generator
    (its generation and engine) concurrently, since one still sending to a buffer whose mesh is
    stopping would break on it (and say so) at the end of a run that went well; then stop every slot
    (MeshSlot.stop: procs, leftover engine processes, segments) and every other proc mesh
    concurrently. Never raises: a failed or late step is logged, so the error that caused the
    shutdown is the one that propagates (what a timeout leaves running, pipeline.run kills at exit).
    Safe to call twice.

    Example:
        try:
            await job.start()
            ...
        finally:
            await shut_down(job)
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    if job.sync is not None:
        job.sync.cancel()
        await settle({"weight sync": job.sync.wait()}, deadline)
    procs, job.procs = job.procs, []
    gens = {i: s for i, s in enumerate(job.fleet.generators) if s.handle is not None}
    closed = await settle({i: asyncio.wait_for(s.handle.shutdown.call_one(), GENERATOR_CLOSE_S) for i, s in gens.items()},
                          deadline, "generator{} shutdown")
    await settle({**{f"{s.label} stop": s.stop(closed.get(i, False)) for i, s in enumerate(job.fleet.generators)},
                  **{f"{s.label} stop": s.stop() for s in job.fleet.sides()},
                  **{f"proc mesh {k} stop": p.stop() for k, p in enumerate(procs)}}, deadline)
    stop_env_server(job)


def stop_env_server(job: Any) -> None:
    """The run's own OpenEnv server (task.openenv.serve=local), after the generators that use it."""
    srv, job.env_server = getattr(job, "env_server", None), None
    if srv is not None:
        try:
            srv.stop()
        except Exception as e:
            log.warning("stopping the OpenEnv server failed: %s", e)
