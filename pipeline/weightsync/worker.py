"""The vLLM worker extension of this project's engines: vLLM takes one `worker_extension_cls`
(set by weightsync.load.vllm_engine_kwargs), so this class composes the two roles that run in the
engine's worker process, each a mixin of collective_rpc targets with its own method prefix:

    ServedWeights  (served.py)  read back what the engine serves, and corrupt it: weight_sync.verify
    ShadowWorker   (shadow.py)  the second copy a push loads into while generating: generator.shadow_weights

Where they meet is the start-up check of weight_sync.verify: it corrupts the served weights and
requires the first push to restore them bit for bit. With shadow weights a push does not write the
served tensors, it loads a copy and swaps it in, and a copy cloned before the corruption would hold
clean bytes that no push wrote. So the corruption drops the copy as well: the next shadow load
clones the corrupted served model and the push must overwrite every byte of it before the swap
serves it; a tensor the push missed is served corrupted and verify names it. (The generator runs
that load under the same pause, after the corruption: actors/generator.py apply_weights.)

Example (in the engine's client process):
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., **vllm_engine_kwargs()))
    await llm.collective_rpc("monarch_rl_corrupt")              # served corrupted, copy dropped
    await load_shadow(llm, receiver, v, 60)                      # a fresh copy of the corrupted model, loaded
    await swap_into_vllm(llm, receiver, v, 60)                   # served: only what the push wrote
"""

from __future__ import annotations

from pipeline.weightsync.served import ServedWeights
from pipeline.weightsync.shadow import ShadowWorker

__all__ = ["MonarchRLWorker"]


class MonarchRLWorker(ServedWeights, ShadowWorker):
    """Both worker roles in one vLLM worker extension (see the module docstring)."""

    def monarch_rl_corrupt(self) -> list[str]:
        """ServedWeights.monarch_rl_corrupt, and the shadow copy (if any) dropped: rebuilt from the
        corrupted served model at the next shadow load."""
        unchanged = super().monarch_rl_corrupt()
        sw = getattr(self, "_mrl_shadow_weights", None)
        if sw is not None:
            sw.drop()
        return unchanged

    def monarch_rl_threads(self) -> dict:
        """The cores this worker may run on and its torch (OpenMP) threads: the engine's placement, as
        the generator reports it (placement.json's `engine_core`)."""
        import os

        import torch

        from pipeline.config.ids import format_ids

        return {"cpus": format_ids(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}
