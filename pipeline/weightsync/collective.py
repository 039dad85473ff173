"""torch.distributed transport: every trainer rank broadcasts its own header, then its own buckets.

Gather-free: trainer rank t has a dedicated process group of `1 + num_receivers` ranks (its sender =
0, receiver r = r + 1), built from a TCPStore that rank hosts, never the trainer's default group.
The N trainer ranks' groups run concurrently, each moving only its own shard's bytes; a receiver is
in all N groups (one thread each) and assembles the pieces (shard_plan.py). One group spanning the
trainer ranks and the receivers was rejected: a broadcast delivers to every member, so each trainer
rank would receive every other rank's shard, and the N broadcasts would run one after another. Store and gloo sockets listen
only on the address given to the sender (127.0.0.1 on one host; the trainer host's address when
generators live on other hosts). The backend is the trainer's (trainer.backend): `gloo` on CPU, `nccl` on GPU
(same code; with nccl the slots and the receive bucket live on cuda and each received bucket is
copied to the host staging segment). The group forms lazily on the first push/pull, which must run
concurrently (see WeightSender). Every collective runs on one worker thread per side, so the
actor's event loop stays free, and waits at most `timeout_s`. A failed or timed-out collective
leaves the group unusable: the run must fail (it does: the error propagates). With weight_sync.delta
a rank whose slot offers a delta broadcasts it (its header, then the delta buckets, delta.py) instead
of the buckets; the sender decides (WeightSync asks for the full version when any generator does not
hold the previous one), and a receiver whose copy is not the delta's base fails after the broadcast.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from pipeline.weightsync import segment as seg
from pipeline.weightsync.errors import TransportError
from pipeline.weightsync.shard_plan import ShardPlan
from pipeline.weightsync.transport import NUM_SLOTS, ReceiverTransport, SenderTransport, Slot, SyncHandle


def _local_addr(host: str, port: int) -> str:
    """The local address this host uses to reach host:port (gloo binds it: loopback for 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP connect: picks the route, sends nothing
        return s.getsockname()[0]


class _Group:
    """The process group plus the thread that drives it."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float,
                 bind: str) -> None:
        self.backend, self.host, self.port, self.rank, self.world = backend, host, port, rank, world
        self.bind = bind
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"weightsync-pg{rank}")

    def _init(self) -> None:
        store = dist.TCPStore(self.host, self.port, self.world, is_master=False, timeout=self.timeout)
        prefix = dist.PrefixStore("monarch_rl_weightsync", store)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefix, self.rank, self.world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            # gloo binds the interface of this name; the hostname's default can be a public address.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind)]
            self.pg = dist.ProcessGroupGloo(prefix, self.rank, self.world, opts)

    def _broadcast(self, tensors: list[torch.Tensor], what: str, first_bucket: int, after) -> None:
        step = "group init"
        try:
            if self.pg is None:
                self._init()
            for i, t in enumerate(tensors):
                step = "header" if i < first_bucket else f"bucket {i - first_bucket}"
                self.pg.broadcast(t, 0).wait(self.timeout)
                if after is not None:
                    after(i, t)
        except Exception as e:
            raise TransportError(f"{what}: {self.backend} broadcast of {step} (rank {self.rank}/{self.world}) "
                                 f"failed: {type(e).__name__}: {e}") from e

    async def broadcast(self, tensors: list[torch.Tensor], what: str, first_bucket: int = 0, after=None) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._broadcast, tensors, what,
                                                         first_bucket, after)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.pg = None


class CollectiveSender(SenderTransport):
    kind = "collective"

    def __init__(self, shards: ShardPlan, rank: int, num_receivers: int, cfg, host: str, backend: str) -> None:
        super().__init__(shards, rank, num_receivers, cfg)
        self.backend = backend  # the trainer's (trainer.backend): slots live where its tensors do
        device = "cuda" if backend == "nccl" else "cpu"
        world = num_receivers + 1
        self._host = cfg.collective_host or host
        # A socket we bound ourselves (TCPStore's own listener would take every interface); the
        # store owns its descriptor from here on and closes it.
        sock = socket.create_server((self._host, 0))
        port = sock.getsockname()[1]
        self._store = dist.TCPStore(self._host, port, world, is_master=True, wait_for_workers=False,
                                    master_listen_fd=sock.detach(), timeout=datetime.timedelta(seconds=cfg.timeout_s))
        self._group = _Group(backend, self._host, self._store.port, 0, world, cfg.timeout_s, self._host)
        self.slots = [Slot(torch.zeros(seg.HEADER_WORDS, dtype=torch.int64, device=device),
                           torch.empty(self.nbytes, dtype=torch.uint8, device=device), **self.delta_buffers(device))
                      for _ in range(NUM_SLOTS)]
        for s in self.slots:
            s.header[seg.H_VERSION] = s.header[seg.H_BASE] = seg.EMPTY

    def handle_info(self) -> dict[str, Any]:
        info = {"host": self._host, "port": self._store.port, "backend": self.backend}
        if self.geometry is not None:
            info["delta"] = True
        return info

    async def send(self, slot: int, version: int, timeout_s: float) -> None:
        """The header, then the delta (its header and buckets) when the slot offers one, else the buckets."""
        s = self.slots[slot]
        base, nbytes = (int(x) for x in s.header[[seg.H_BASE, seg.H_DELTA]].tolist())
        body = self.shards.buckets(self.rank, s.data) if base == seg.EMPTY else \
            [s.dheader, *self.geometry.buckets(s.delta, nbytes)]
        await self._group.broadcast([s.header, *body], f"version {version} push of trainer rank {self.rank}", 1)

    def close(self) -> None:
        self._group.close()
        self.slots = []
        self._store = None


class CollectiveReceiver(ReceiverTransport):
    def __init__(self, handle: SyncHandle, rank: int) -> None:
        super().__init__(handle, rank)
        self._groups = [_Group(info["backend"], info["host"], info["port"], rank + 1, handle.num_receivers + 1,
                               handle.timeout_s, _local_addr(info["host"], info["port"])) for info in self.infos]
        self._stage = seg.Segment(seg.new_name(f"coll-r{rank}"), self.plan.total_bytes, create=True)
        self._cuda = self.infos[0]["backend"] == "nccl"
        dev = "cuda" if self._cuda else "cpu"
        self._headers = [torch.zeros(seg.HEADER_WORDS, dtype=torch.int64, device=dev) for _ in self.infos]
        # where each rank's buckets land: the stage itself when its bytes are the full layout
        self._flats = None if self.direct else [torch.empty(n, dtype=torch.uint8) for n in self.shards.totals]
        # weight_sync.delta: where each rank's delta header and buckets land
        self._dhead = [None if g is None else torch.zeros(g.header_words, dtype=torch.int64) for g in self.geometry]
        self._dflat = [None if g is None else torch.zeros(g.capacity, dtype=torch.uint8) for g in self.geometry]

    async def _pull_rank(self, r: int, version: int) -> int | None:
        """Receive trainer rank r's part of `version`; returns the delta's length when it sent one."""
        group, what = self._groups[r], f"version {version} pull from trainer rank {r}"
        await group.broadcast([self._headers[r]], what, 1)
        # A mismatch here leaves the sender blocked on the buckets until its timeout: the run fails
        # on both sides, with this message being the cause.
        header = self._headers[r].cpu()
        seg.check_header(header, version, self.expect, f"collective push from trainer rank {r} at {group.host}")
        nbytes = None if int(header[seg.H_BASE]) == seg.EMPTY else int(header[seg.H_DELTA])
        if nbytes is not None and self.geometry[r] is None:
            raise TransportError(f"{what}: the sender pushes a delta to a receiver built without one")
        # A delta is received whole even when this receiver cannot apply it (another base): the
        # broadcast must complete for every member; apply_delta raises afterwards.
        host_buckets = self._host_buckets(r, nbytes)
        if self._cuda:  # receive on device, copy each bucket to its place on the host
            dev = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, device="cuda")
            views = [dev[:b.numel()] for b in host_buckets]
            after = lambda i, t: host_buckets[i].copy_(t)  # noqa: E731
        else:
            views, after = host_buckets, None
        await group.broadcast(views, what, 0, after)
        return nbytes

    def _host_buckets(self, r: int, nbytes: int | None) -> list[torch.Tensor]:
        if nbytes is None:
            return self.plan.buckets(self._stage.data) if self.direct else self.shards.buckets(r, self._flats[r])
        g = self.geometry[r]
        if nbytes > g.capacity:
            raise TransportError(f"collective push from trainer rank {r}: a delta of {nbytes} bytes, more than "
                                 f"its {g.capacity}-byte buffer")
        return [self._dhead[r].view(torch.uint8), *g.buckets(self._dflat[r], nbytes)]

    async def fetch(self, version: int, timeout_s: float) -> str:
        held, self.held = self.held, None  # a fetch that fails leaves no valid copy: the next one is full
        seg.begin_write(self._stage.header)
        world = range(len(self.infos))
        deltas = await asyncio.gather(*[self._pull_rank(r, version) for r in world])
        await self.publish_staged(self._stage, self._flats, deltas, self._dhead, self._dflat, version, held)
        moved = sum(self.shards.totals[r] if d is None else 8 * self.geometry[r].header_words + d
                    for r, d in enumerate(deltas))
        self.last = {"bytes": float(moved), "delta_ranks": float(sum(d is not None for d in deltas))}
        return self._stage.name

    def close(self) -> None:
        for g in self._groups:
            g.close()
        self._stage.close()
