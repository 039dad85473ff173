"""The same job on an existing launcher, on one node or several.

    torchrun --nproc-per-node K -m pipeline.run --config ...                       # one host
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr A --master-port P \\
        -m pipeline.run --config ... trainer.num_ranks=2 weight_sync.transport=rdma   # on each node R

Every rank calls `StoreJob.from_store` on torchrun's rendezvous store: each node's local rank 0
starts one Monarch worker and publishes its address; global rank 0 attaches to all of them as one
host mesh (a 'hosts' dim, node 0 first) and drives the job on it. On one node the workers listen on
a unix socket; on several they listen on TCP (unix sockets do not cross hosts), and so do the procs
they spawn, since the client's transport is pushed to the workers when it attaches. Monarch's TCP
binds the address the host name resolves to; when torchrun's store is on a loopback address every
node is this machine (several launchers simulating nodes), so the job's TCP stays on loopback.

The other ranks wait on the store for rank 0's exit code, so the launcher sees one exit code
everywhere. The wait is bounded by rank 0's liveness: rank 0 bumps a heartbeat key every
HEARTBEAT_S, and a rank whose store stops answering, or that sees no beat for STALL_S, exits 1.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from pipeline.config import Config, ConfigError

log = logging.getLogger(__name__)

DONE_KEY = "pipeline/run/exit_code"
HEARTBEAT_KEY = "pipeline/run/rank0_heartbeat"
HEARTBEAT_S = 5.0
STALL_S = 120.0  # generous: rank 0's process is busy and this machine is shared
STORE_TIMEOUT = timedelta(seconds=300)
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def _store(addr: str, port: int):
    """A client of torchrun's TCP store (MASTER_ADDR/MASTER_PORT)."""
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=True)


def _free_port() -> int:
    """A TCP port free on every interface of this host, for its Monarch worker to listen on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _heartbeat(addr: str, port: int, stop: threading.Event) -> None:
    """Rank 0: bump HEARTBEAT_KEY until `stop` (own store client: the main thread's is not shared)."""
    store = _store(addr, port)
    while not stop.wait(HEARTBEAT_S):
        store.add(HEARTBEAT_KEY, 1)


def _wait_for_rank0(store) -> int:
    """Rank 0's exit code, or 1 once its store stops answering or its heartbeat stalls for STALL_S."""
    from torch.distributed import DistError, DistStoreError

    last, seen = -1, time.monotonic()
    while True:
        try:
            try:
                store.wait([DONE_KEY], timedelta(seconds=HEARTBEAT_S))
                return int(store.get(DONE_KEY).decode())
            except DistStoreError:  # the wait timed out: is rank 0 still alive?
                beat = store.add(HEARTBEAT_KEY, 0)
        except DistError as e:  # DistNetworkError: the store's host (rank 0's launcher) is gone
            log.error("rank 0's store stopped answering (%s); exiting", str(e).splitlines()[0])
            return 1
        if beat != last:
            last, seen = beat, time.monotonic()
        elif time.monotonic() - seen > STALL_S:
            log.error("no heartbeat from rank 0 for %.0fs; exiting", STALL_S)
            return 1


def run_under_torchrun(cfg: Config, drive: Callable[[Any], int]) -> int:
    """Join the Monarch job; on global rank 0 call `drive(host_mesh)`. Returns rank 0's exit code.
    A signal (torchrun forwards SIGINT, SIGTERM and SIGHUP to every rank's process group) stops
    rank 0's run through its shutdown, and the other ranks at once; all exit 128 + signum."""
    from monarch.job.spmd import StoreJob
    from torch.distributed import DistError

    from pipeline.cleanup import exit_code

    topology = {k: int(os.environ[v]) for k, v in (("rank", "RANK"), ("local_rank", "LOCAL_RANK"),
                ("world_size", "WORLD_SIZE"), ("local_world_size", "LOCAL_WORLD_SIZE"))}
    rank, hosts = topology["rank"], topology["world_size"] // topology["local_world_size"]
    if cfg.trainer.num_ranks % hosts:  # every rank sees the same config and topology: all exit 2
        raise ConfigError(f"config: trainer.num_ranks={cfg.trainer.num_ranks} is invalid; allowed: a multiple of "
                          f"the {hosts} nodes of this torchrun job (the trainer runs num_ranks / nodes ranks on each)")
    where = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = _store(*where)
    stop = threading.Event()
    if rank == 0:
        threading.Thread(target=_heartbeat, args=(*where, stop), name="rank0-heartbeat", daemon=True).start()
    # The Monarch worker (and every proc it spawns) inherits this environment. torchrun's variables
    # would hijack the job's own process groups (TORCHELASTIC_USE_AGENT_STORE makes rank 0 of the
    # trainer's rendezvous wait for an agent store that is not there), so they stop here.
    for k in [k for k in os.environ if k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))] + list(_LAUNCHER_ENV):
        os.environ.pop(k, None)
    transport = {"transport": "tcp", "monarch_port": _free_port()} if hosts > 1 else {"transport": "ipc"}
    job = StoreJob.from_store(store, name="pipeline_worker", **transport, **topology)
    if job is not None and hosts > 1 and ipaddress.ip_address(socket.gethostbyname(where[0])).is_loopback:
        from monarch.config import ChannelTransport, configure

        configure(default_transport=ChannelTransport.TcpWithLocalhost)  # before the attach pushes it
    if job is None:
        log.info("rank %d: joined the Monarch job (%d node(s), %s); rank 0 drives it", rank, hosts, transport["transport"])
        return _wait_for_rank0(store)
    code = 1
    try:
        code = drive(job.state().pipeline_worker)
    except KeyboardInterrupt as e:  # a signal stopped the run (its shutdown ran): the others exit alike
        code = exit_code(e)
        raise
    finally:
        stop.set()
        try:
            store.set(DONE_KEY, str(code))
        except DistError as e:  # torchrun's store went first (it is shutting down): nobody is waiting
            log.warning("could not publish exit code %d: %s", code, str(e).splitlines()[0])
    return code
