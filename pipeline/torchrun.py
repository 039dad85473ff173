"""The same job on an existing launcher: `torchrun --nproc-per-node K -m pipeline.run --config ...`.

Every rank calls `StoreJob.from_store` on torchrun's rendezvous store: each host's local rank 0
starts one Monarch worker and publishes its address; global rank 0 attaches to all of them as one
host mesh and drives the job on it (the controller spawns the proc meshes there). The other ranks
wait on the store until rank 0 reports the result, so the launcher sees one exit code everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta

from pipeline.config import Config

log = logging.getLogger(__name__)

DONE_KEY = "pipeline/run/exit_code"
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _store():
    """torchrun's TCP store (MASTER_ADDR/MASTER_PORT); a client on every rank but 0's host server."""
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                    world_size=int(os.environ["WORLD_SIZE"]), is_master=False,
                    timeout=timedelta(hours=24), use_libuv=True)


def run_under_torchrun(cfg: Config) -> int:
    from monarch.job.spmd import StoreJob

    from pipeline.controller import print_summary, run

    rank = int(os.environ["RANK"])
    store = _store()
    topology = {k: int(os.environ[v]) for k, v in (("rank", "RANK"), ("local_rank", "LOCAL_RANK"),
                ("world_size", "WORLD_SIZE"), ("local_world_size", "LOCAL_WORLD_SIZE"))}
    # The Monarch worker (and every proc it spawns) inherits this environment. torchrun's variables
    # would hijack the job's own process groups (TORCHELASTIC_USE_AGENT_STORE makes rank 0 of the
    # trainer's rendezvous wait for an agent store that is not there), so they stop here.
    for k in [k for k in os.environ if k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))] + list(_LAUNCHER_ENV):
        os.environ.pop(k, None)
    job = StoreJob.from_store(store, name="pipeline_worker", **topology)
    if job is None:
        log.info("rank %d: joined the Monarch job; rank 0 drives it", rank)
        return int(store.get(DONE_KEY).decode())
    code = 1
    try:
        host = job.state().pipeline_worker
        summary = asyncio.run(run(cfg, host=host))
        print_summary(cfg, summary)
        code = 0
    finally:
        store.set(DONE_KEY, str(code))
    return code
