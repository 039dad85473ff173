"""Load a staged version (or an HF export: `load_export`) into a running vLLM AsyncLLM through the
`monarch_rl` weight-transfer backend."""

from __future__ import annotations

import asyncio

from pipeline.weightsync.errors import SyncTimeoutError, WeightSyncError
from pipeline.weightsync.receiver import WeightReceiver
from pipeline.weightsync.vllm_plugin import BACKEND


def vllm_engine_kwargs() -> dict:
    """Extra `AsyncEngineArgs` / `LLM` kwargs that enable this backend in the engine, and the worker
    extension (pipeline/weightsync/worker.py: served.py's read-back for weight_sync.verify and
    shadow.py's second copy for generator.shadow_weights, which allocates nothing until first used)."""
    return {"weight_transfer_config": {"backend": BACKEND},
            "worker_extension_cls": "pipeline.weightsync.worker.MonarchRLWorker"}


async def pause_keep(engine) -> None:
    """Freeze the engine's requests in place (KV caches kept) until `engine.resume_generation()`.

    `AsyncLLM.pause_generation(mode="keep", clear_cache=False)` minus its 20 ms courtesy sleep, which
    only lets the last outputs of in-flight requests reach their callers before it returns; frozen
    requests deliver those when they resume, so in keep mode the sleep would only lengthen every
    update's stall. Returns once the scheduler is paused: the step in progress has finished, and no
    other step runs until resume."""
    pause = getattr(getattr(engine, "engine_core", None), "pause_scheduler_async", None)
    if pause is None:  # not an AsyncLLM (another engine class): its own pause
        await engine.pause_generation(mode="keep", clear_cache=False)
    else:
        await pause(mode="keep", clear_cache=False)


INVALID_PREFIX = "invalid-partial-load-of-"
"""Weight version an engine reports after a failed load: it no longer claims any whole version."""


class WeightLoadError(WeightSyncError):
    """The engine did not finish loading a version; its weights may be partly new. Do not serve."""


async def load_into_vllm(engine, receiver: WeightReceiver, version: int, timeout_s: float) -> None:
    """start_weight_update -> update_weights (views of the staged buckets) -> finish_weight_update.

    Pause generation around this call (the generator's `on_update` strategy; its abort and drain
    pauses empty the prefix cache, clear_cache=True, and keep engines run without one). On return the
    engine serves `version`, and labels the tokens of its later steps with it (finish sets the
    label; checked with `get_weight_version`), and `receiver.loaded_version` is set. On any failure it raises WeightLoadError / SyncTimeoutError naming the version and
    sets the engine's weight version to `INVALID_PREFIX + str(version)`: the engine may hold a mix
    of old and new weights, so the caller must not resume serving until a later load succeeds.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    segment = receiver.staged_segment(version)
    info = {"segment": segment, "version": version, "plan": receiver.plan.to_wire()}

    async def run() -> None:
        await engine.start_weight_update()
        # On failure the worker closes the session itself; finish is never called on a partial load.
        await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        await engine.finish_weight_update(weight_version=str(version))

    try:
        await asyncio.wait_for(run(), timeout_s)
    except BaseException as e:
        await load_failed(engine, version, e, f"loading into vLLM (segment {segment})", timeout_s)
    served = await engine.get_weight_version()
    if served != str(version):
        raise WeightLoadError(f"version {version}: engine reports weight version {served!r} after loading")
    receiver.loaded_version = version


async def load_export(engine, hf_dir: str, version: int, timeout_s: float) -> None:
    """The weights of an HF export of the served model (`hf_dir`: its safetensors files) into a
    running engine through the same backend and layerwise reload as a push (a tied lm_head reloaded
    too), labelled `version` (the caller's current one: the warm start reloads under version 0),
    then the engine's prefix cache emptied. No generation may run meanwhile. Failures as
    load_into_vllm's: the engine stops claiming a version.

    Why the reset: nothing pauses the engine around this reload, so nothing else clears the prefix
    cache (a push's abort / drain pause does, with clear_cache=True; keep runs without prefix
    caching), and the version label does not change: every later request sharing a cached prefix
    (a chat template's system prompt, a probe's prompt) would reuse KV of the old weights. A reset
    that vLLM refuses (a request still holds blocks) fails the load; an engine without prefix
    caching has nothing to reset."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    async def run() -> None:
        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(
            update_info={"segment": "", "version": version, "hf_dir": str(hf_dir)}))
        await engine.finish_weight_update(weight_version=str(version))
        if engine.vllm_config.cache_config.enable_prefix_caching and not await engine.reset_prefix_cache():
            raise WeightLoadError(f"version {version}: the prefix cache still holds KV of the old weights after "
                                  f"loading {hf_dir} (vLLM refused the reset: a request is still running)")

    try:
        await asyncio.wait_for(run(), timeout_s)
    except BaseException as e:
        await load_failed(engine, version, e, f"loading the export {hf_dir} into vLLM", timeout_s)


async def load_failed(engine, version: int, e: BaseException, what: str, timeout_s: float) -> None:
    """Raise the error of a failed load, after making the engine stop claiming any version: it may hold
    a mix of old and new weights."""
    await _mark_invalid(engine, version)
    if isinstance(e, asyncio.TimeoutError):
        raise SyncTimeoutError(f"version {version}: {what} did not finish within {timeout_s:.1f}s; engine "
                               "state unknown, do not serve") from None
    if isinstance(e, Exception) and not isinstance(e, WeightSyncError):
        raise WeightLoadError(f"version {version}: {what} failed: {type(e).__name__}: {e}") from e
    raise e


async def _mark_invalid(engine, version: int) -> None:
    try:
        await asyncio.wait_for(engine.update_weight_version(f"{INVALID_PREFIX}{version}"), 30)
    except Exception:  # the engine may be dead; the raised load error already says do not serve
        pass


def read_staged(receiver: WeightReceiver, version: int) -> dict:
    """The staged `version` as tensors (copies), checked against its segment header before and after."""
    from pipeline.weightsync import segment as segmod

    plan = receiver.plan
    name = receiver.staged_segment(version)
    seg = segmod.Segment(name, plan.total_bytes, create=False)
    try:
        segmod.check_header(seg.header, version, plan.hash_int, f"segment {name}")
        out = {k: v.clone() for k, v in plan.unpack(seg.data, version)}
        segmod.check_header(seg.header, version, plan.hash_int, f"segment {name}", after_read=True)
    finally:
        seg.close()
    return out


async def load_lora_into_vllm(engine, receiver: WeightReceiver, version: int, timeout_s: float, lora_dir: str,
                              lcfg, previous=None):
    """A pushed LoRA version (PEFT-named adapters, pipeline/lora.py) as a new adapter of `engine`:
    written as a PEFT directory under `lora_dir`, added (LoRARequest id version + 1), the engine
    labelled with `version`, and `previous` (the adapter it replaces) removed from the engine (its
    directory is the caller's to delete, once no request can name it). Returns the new
    LoRARequest, which every later request must carry. On failure the engine stops claiming a
    version, as load_into_vllm does."""
    from pathlib import Path

    from vllm.lora.request import LoRARequest

    from pipeline.lora import remove_dir, write_peft

    path = Path(lora_dir) / f"v{version}"

    async def run():
        sd = await asyncio.to_thread(read_staged, receiver, version)
        await asyncio.to_thread(write_peft, path, sd, lcfg)
        req = LoRARequest(f"v{version}", version + 1, str(path))
        if not await engine.add_lora(req):
            raise WeightLoadError(f"version {version}: vLLM refused the adapter in {path}")
        await engine.update_weight_version(str(version))
        return req

    try:
        req = await asyncio.wait_for(run(), timeout_s)
    except BaseException as e:
        remove_dir(path)
        await load_failed(engine, version, e, f"adding the LoRA adapter in {path}", timeout_s)
    if previous is not None:  # its directory stays: a request still naming it reloads it from there
        await asyncio.wait_for(engine.remove_lora(previous.lora_int_id), timeout_s)
    receiver.loaded_version = version
    return req
