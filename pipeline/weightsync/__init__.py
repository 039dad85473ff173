"""Weight sync: trainer -> generators, packed into fixed-size buckets, over rdma / collective / shm.

    sender = WeightSender(cfg.weight_sync, hf_state_dict, num_receivers=G)   # one process, whole tensors
    handle = sender.handle()                                                 # send once to generators
    # or one sender per trainer rank r, each sending its own shards (shard_plan.py):
    #   senders: WeightSender(cfg.weight_sync, hf_meta, G, holdings=boxes_of_every_rank, rank=r)
    #   handle = merge_handles([every rank's sender.handle()]); sender.publish(tensors_of_rank_r_boxes, v)
    receiver = WeightReceiver(handle, rank=g)                                # each generator
    await asyncio.gather(sender.push(hf_sd, v), receiver.pull(v))            # per version
    await load_into_vllm(async_llm, receiver, v, timeout_s)                  # engine serves v
    req = await load_lora_into_vllm(async_llm, receiver, v, timeout_s, dir, lcfg, req)   # LoRA: adapters only
    await load_export(async_llm, hf_dir, v, timeout_s)                       # an HF export, still labelled v
    await load_shadow(async_llm, receiver, v, timeout_s)                     # shadow weights: while generating,
    await swap_into_vllm(async_llm, receiver, v, timeout_s)                  # then swapped in (engine paused)

See sender.py for the ordering contract, plan.py for the bucket layout, shard_plan.py for which
rank sends which piece and how a receiver assembles them, transport.py for the
transport interface, vllm_engine.py for the receiving vLLM backend, shadow.py / shadow_load.py for
shadow weights (generator.shadow_weights), worker.py for the engine worker's extension (served.py's
read-back and shadow.py's copy in one class). `load_into_vllm` and
`vllm_engine_kwargs` import vLLM lazily, so trainer processes never load it.
"""

from pipeline.weightsync.errors import (PlanMismatchError, ShortBufferError, SyncTimeoutError, TornReadError,
                                        TransportError, VersionRegressionError, WeightSyncError)
from pipeline.weightsync.load import (WeightLoadError, load_export, load_into_vllm, load_lora_into_vllm,
                                      vllm_engine_kwargs)
from pipeline.weightsync.plan import BucketPlan, PlanEntry
from pipeline.weightsync.receiver import WeightReceiver
from pipeline.weightsync.sender import WeightSender
from pipeline.weightsync.shadow_load import load_shadow, read_served, swap_into_vllm
from pipeline.weightsync.shard_plan import ShardPlan
from pipeline.weightsync.transport import SyncHandle, merge_handles
from pipeline.weightsync.vllm_plugin import BACKEND as VLLM_BACKEND

__all__ = [
    "BucketPlan", "PlanEntry", "ShardPlan", "merge_handles", "WeightSender", "load_export", "load_lora_into_vllm",
    "WeightReceiver", "SyncHandle", "load_into_vllm", "load_shadow", "swap_into_vllm", "read_served",
    "vllm_engine_kwargs", "VLLM_BACKEND", "WeightSyncError", "PlanMismatchError", "ShortBufferError",
    "SyncTimeoutError", "TornReadError", "TransportError", "VersionRegressionError", "WeightLoadError",
]
