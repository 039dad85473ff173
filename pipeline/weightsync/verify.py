"""weight_sync.verify, the engine-client side: ask a vLLM engine for the checksums of what it
serves, corrupt what it serves, and check a served set against the trainer's.

The worker side is `pipeline/weightsync/served.py` (vLLM worker extension); the trainer's side is
`WeightSender.checksums` (each trainer rank's share of every tensor's checksum, from its packed
snapshot of a version: the master cast to the engine's dtype), added up by `checksum.combine`;
`pipeline/weightsync/sync.py` decides which pushes are verified and fails a push on a mismatch.

Example:
    ref = combine([s.checksums(v) for s in senders])           # trainer: every rank's shares, added
    served = await served_checksums(llm, timeout_s=60)          # generator, after the load of v
    check(ref, served, generator=0, version=v)                  # raises VerifyError naming the tensor
    await corrupt_served(llm, timeout_s=60)                     # start-up: every served byte now wrong
"""

from __future__ import annotations

import asyncio

from pipeline.weightsync.checksum import Checksum, compare
from pipeline.weightsync.errors import WeightSyncError

Served = tuple[dict[str, Checksum], dict[str, list[str]]]
"""(vLLM name -> checksum of what is served, vLLM name -> the HF names it concatenates)."""


class VerifyError(WeightSyncError):
    """What a generator serves after a push is not the trainer's version (the tensors named)."""


async def served_checksums(llm, timeout_s: float) -> Served:
    """The checksums of every tensor `llm` (a vLLM AsyncLLM built with vllm_engine_kwargs()) serves."""
    out = await asyncio.wait_for(llm.collective_rpc("monarch_rl_checksums"), timeout_s)
    got = out[0]  # tensor_parallel_size 1: one worker
    return {k: Checksum.from_wire(v) for k, v in got["tensors"].items()}, got["parts"]


async def corrupt_served(llm, timeout_s: float) -> None:
    """Flip the lowest bit of every element `llm` serves (generation must be paused); raises
    VerifyError naming any served tensor the corruption did not reach."""
    unchanged = (await asyncio.wait_for(llm.collective_rpc("monarch_rl_corrupt"), timeout_s))[0]
    if unchanged:
        raise VerifyError(f"start-up check: corrupting the served weights left {len(unchanged)} tensor(s) "
                          f"unchanged: {unchanged[:5]}")


def check(reference: dict[str, Checksum], served: Served, generator: int, version: int) -> int:
    """Raise VerifyError naming the generator, the version and the first tensors that differ;
    returns the number of served tensors checked."""
    tensors, parts = served
    bad = compare(reference, tensors, parts)
    if bad:
        shown = "; ".join(str(m) for m in bad[:3])
        raise VerifyError(f"generator{generator} does not serve weight version {version} bit for bit: "
                          f"{len(bad)} tensor(s) differ from the trainer's: {shown}"
                          + (f"; and {len(bad) - 3} more" if len(bad) > 3 else ""))
    return len(tensors)
