"""Shadow weights, the generator side (generator.shadow_weights): load a staged version into the engine
worker's second copy while it generates, then swap it in under the update strategy.

    stage  `load_shadow`: the worker loads the staged segment into its copy on a thread of its own
           (weightsync/shadow.py) while engine steps go on; returns once the copy holds the version,
           woken by the worker through a FIFO (no polling, no engine step blocked).
    apply  `swap_into_vllm`, the `load` the update gate pauses around: one RPC between two engine steps
           swaps copy and served model, then the engine is labelled with the version, so tokens of
           every later step carry it and no earlier one does (the gate's pause spans both).

Contract: a failed shadow load leaves the served model untouched (it keeps serving the old version)
and raises WeightLoadError / SyncTimeoutError naming the version; a failed swap marks the engine
invalid as a failed load does (weightsync/load.py). Both are bounded by `timeout_s`.

Example:
    await receiver.pull(v)                                    # staged
    load_s = await load_shadow(engine.llm, receiver, v, 60)   # generation goes on meanwhile
    await gate.update(v, lambda: swap_into_vllm(engine.llm, receiver, v, 60), "keep")   # paused ~ms
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import uuid

import torch

from pipeline.weightsync.errors import SyncTimeoutError
from pipeline.weightsync.load import WeightLoadError, load_failed
from pipeline.weightsync.receiver import WeightReceiver

__all__ = ["load_shadow", "swap_into_vllm", "read_served"]


async def _rpc(engine, method: str, *args):
    """One worker call (the engine has one worker per tensor-parallel rank); rank 0's answer."""
    return (await engine.collective_rpc(method, args=args))[0]


async def load_shadow(engine, receiver: WeightReceiver, version: int, timeout_s: float) -> float:
    """Load the staged `version` into the worker's shadow copy; returns the load's seconds (worker side).
    The served weights are not touched: on failure the engine still serves its version."""
    segment = receiver.staged_segment(version)
    info = {"segment": segment, "version": version, "plan": receiver.plan.to_wire()}
    path = os.path.join(tempfile.gettempdir(), f"mrl-shadow-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.mkfifo(path, 0o600)
    # read-write: the FIFO always has a writer (us), so it never reads as closed before the worker writes
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    buf = bytearray()
    workers = 0  # one line per worker (tensor-parallel rank); known once begin answered

    def check() -> None:
        lines = bytes(buf).split(b"\n")[:-1]
        if workers and len(lines) >= workers and not done.done():
            done.set_result([json.loads(line) for line in lines])

    def readable() -> None:
        try:
            buf.extend(os.read(fd, 65536))
        except BlockingIOError:
            return
        check()

    loop.add_reader(fd, readable)
    try:
        workers = len(await asyncio.wait_for(engine.collective_rpc("mrl_shadow_begin", args=(info, path)), timeout_s))
        check()  # the lines that came before `workers` was known
        msgs = await asyncio.wait_for(done, timeout_s)
    except asyncio.TimeoutError:
        raise SyncTimeoutError(f"version {version}: loading the shadow copy (segment {segment}) did not finish "
                               f"within {timeout_s:.1f}s (weight_sync.timeout_s)") from None
    except Exception as e:
        raise WeightLoadError(f"version {version}: loading the shadow copy (segment {segment}) failed: "
                              f"{type(e).__name__}: {e}") from e
    finally:
        loop.remove_reader(fd)
        os.close(fd)
        os.unlink(path)
    for msg in msgs:
        if not msg.get("ok") or msg.get("version") != version:
            raise WeightLoadError(f"version {version}: loading the shadow copy (segment {segment}) failed: "
                                  f"{msg.get('error', msg)}; the engine still serves its previous version")
    return max(float(m["load_s"]) for m in msgs)


async def swap_into_vllm(engine, receiver: WeightReceiver, version: int, timeout_s: float) -> float:
    """Serve the shadow copy holding `version` and label the engine with it; returns the swap's
    seconds in the worker. Call with the engine paused (the update gate does)."""
    try:
        swap_s = await asyncio.wait_for(_rpc(engine, "mrl_shadow_swap", version), timeout_s)
        await asyncio.wait_for(engine.update_weight_version(str(version)), timeout_s)
    except BaseException as e:
        await load_failed(engine, version, e, "swapping in the shadow copy", timeout_s)
    served = await engine.get_weight_version()
    if served != str(version):
        raise WeightLoadError(f"version {version}: engine reports weight version {served!r} after the swap")
    receiver.loaded_version = version
    return float(swap_s)


async def read_served(engine, names: list[str]) -> dict[str, torch.Tensor]:
    """Copies of the tensors the engine serves, by vLLM name (what a swap, or a load, put in place)."""
    raw = await _rpc(engine, "mrl_read_served", list(names))
    return {n: torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).view(shape)
            for n, (dtype, shape, data) in raw.items()}
