"""Load a staged version into a running vLLM AsyncLLM through the `monarch_rl` weight-transfer backend."""

from __future__ import annotations

import asyncio

from pipeline.weightsync.errors import SyncTimeoutError, WeightSyncError
from pipeline.weightsync.receiver import WeightReceiver
from pipeline.weightsync.vllm_plugin import BACKEND


def vllm_engine_kwargs() -> dict:
    """Extra `AsyncEngineArgs` / `LLM` kwargs that enable this backend in the engine."""
    return {"weight_transfer_config": {"backend": BACKEND}}


class WeightLoadError(WeightSyncError):
    """The engine did not finish loading a version; its weights may be partly new. Do not serve."""


async def load_into_vllm(engine, receiver: WeightReceiver, version: int, timeout_s: float) -> None:
    """start_weight_update -> update_weights (views of the staged buckets) -> finish_weight_update.

    Pause generation around this call (the generator's `on_update` strategy). On return the
    engine serves `version` (checked with `get_weight_version`) and `receiver.loaded_version`
    is set. On any failure it raises WeightLoadError / SyncTimeoutError naming the version; the
    engine may then hold a mix of old and new weights, so the caller must not resume serving
    until a later load succeeds.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    segment = receiver.staged_segment(version)
    info = {"segment": segment, "version": version, "plan": receiver.plan.to_wire()}

    async def run() -> None:
        await engine.start_weight_update()
        try:
            await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        except BaseException:
            # The worker already closed the update session; finalize is not safe on a partial load.
            raise
        await engine.finish_weight_update(weight_version=str(version))

    try:
        await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        raise SyncTimeoutError(f"version {version}: loading into vLLM (segment {segment}) did not finish "
                               f"within {timeout_s:.1f}s; engine state unknown, do not serve") from None
    except WeightSyncError:
        raise
    except Exception as e:
        raise WeightLoadError(f"version {version}: vLLM failed to load segment {segment}: "
                              f"{type(e).__name__}: {e}") from e
    served = await engine.get_weight_version()
    if served != str(version):
        raise WeightLoadError(f"version {version}: engine reports weight version {served!r} after loading")
    receiver.loaded_version = version
