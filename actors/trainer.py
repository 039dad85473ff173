"""Trainer mesh: N Monarch actors, one torchtitan/FSDP2 rank each, plus the driver-side handle.

    trainer = await Trainer.start(cfg, host_mesh)      # cfg.trainer.num_ranks procs, split evenly over hosts
    metrics = await trainer.train_step(batch)          # dict[str, float], rank 0's (all ranks agree)
    handle = await trainer.sync_handle(num_receivers)  # once: every rank builds its WeightSender
    wv = await trainer.push_weights(full=False)        # WeightVersion; returns once every rank packed
                                                       # (pipeline.weightsync.sync.WeightSync drives it)
    ref = await trainer.weight_checksums(wv.version)   # weight_sync.verify: every rank's shares, added
    await trainer.save(path, data_state) / await trainer.load(path) -> data_state
    v = await trainer.export_hf(out_dir)               # vLLM-loadable HF directory of version v
    await trainer.close()

Rendezvous: rank 0 alone opens a listening socket where the others reach it (`rendezvous_point`:
127.0.0.1 on one host, so a single-host run listens on loopback only; else its host's address, the one
Monarch's TCP channels advertise) and reports (addr, port). Then every rank runs `setup(addr, port)`:
global rank = host index * ranks per host + local index, world = trainer.num_ranks (each rank first
takes its placement, pipeline/placement.py: its share of trainer.cpus, its GPU); rank 0 serves the
TCPStore on that socket, the others connect, and `init_process_group` spans every host (FSDP2).
Every endpoint is called on all ranks (FSDP forward/backward, gathers and checkpoints are
collectives); rank 0's answer is returned. Every call is bounded by `trainer.step_timeout_s`
(`init_timeout_s` for setup) and a failure on any rank is raised with that rank's error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from datetime import timedelta

import torch
from monarch.actor import concurrent_endpoint, current_rank, current_size, endpoint, this_host

from actors.base import PipelineActor
from pipeline.config import Config, ConfigError, WeightSyncConfig
from pipeline.placement import apply, describe, trainer_placement
from pipeline.trainer.step import TrainCore
from pipeline.types import Batch, WeightVersion
from pipeline.weightsync.checksum import Checksum, combine
from pipeline.weightsync.transport import merge_handles

log = logging.getLogger(__name__)


class TrainerActor(PipelineActor):
    """One trainer rank. Endpoints read as the protocol; all logic lives in TrainCore."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg.run.log_level)
        self.cfg = cfg
        self.listener: socket.socket | None = None  # rank 0: the rendezvous store's socket
        self.core: TrainCore | None = None
        self.sender = None  # this rank's pipeline.weightsync.WeightSender after sync_handle

    def _c(self) -> TrainCore:
        if self.core is None:
            raise RuntimeError("trainer: setup() has not run on this rank")
        return self.core

    @endpoint
    async def rendezvous_point(self, multi_host: bool) -> tuple[str, int]:
        """Called on rank 0 only, before setup: listen where the other ranks reach this host (bound
        now, so no other process can take the port before setup) and report (addr, port)."""
        addr = socket.gethostbyname(socket.getfqdn()) if multi_host else "127.0.0.1"
        self.listener = socket.create_server((addr, 0), backlog=1024)
        return addr, self.listener.getsockname()[1]

    @endpoint
    async def setup(self, addr: str, port: int) -> dict:
        sizes, rank, world = current_size(), current_rank().rank, self.cfg.trainer.num_ranks
        per_host = sizes["procs"]
        host = rank // per_host  # row-major over ('hosts', 'procs'): host * per_host + local index
        if sizes.get("hosts", 1) * per_host != world:
            raise RuntimeError(f"trainer mesh {sizes} does not hold trainer.num_ranks={world} ranks")
        tcfg = self.cfg.trainer
        placement = apply(trainer_placement(self.cfg, rank, per_host, len(os.sched_getaffinity(0))))
        if tcfg.device == "cuda":
            torch.cuda.set_device(0)  # its placement left this rank one visible GPU (CUDA_VISIBLE_DEVICES)
        if ipaddress.ip_address(addr).is_loopback:  # one host: gloo's pairs listen on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch.distributed as dist

        if rank == 0 and self.listener is None:
            raise RuntimeError("trainer: setup on rank 0 before rendezvous_point")
        timeout = timedelta(seconds=tcfg.init_timeout_s)
        # A store given the listening socket serves on its address only (a plain TCPStore binds every interface).
        store = dist.TCPStore(addr, port, is_master=rank == 0, timeout=timeout, use_libuv=True,
                              master_listen_fd=self.listener.fileno() if rank == 0 else None)
        dist.init_process_group(tcfg.backend, store=store, rank=rank, world_size=world, timeout=timeout)
        self.core = TrainCore.from_config(self.cfg, rank, world)
        return {"rank": rank, "world": world, "host": host, "pid": os.getpid(), "version": self.core.version,
                "placement": placement}

    @endpoint
    async def train_step(self, batch: Batch) -> dict[str, float]:
        return self._c().train_step(batch)

    @endpoint
    async def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, lr: float | None = None) -> dict[str, float]:
        return self._c().sft_step(input_ids, loss_mask, lr)

    @endpoint
    async def version(self) -> int:
        return self._c().version

    @endpoint
    async def set_reference(self) -> bool:
        """The current weights become the KL reference (False: trainer.kl_coef = 0, no reference)."""
        return self._c().state.set_reference()

    @endpoint
    async def reset_optimizer(self) -> None:
        """AdamW's moments and step counts dropped (the warm start's hand-over to RL)."""
        self._c().state.reset_optimizer()

    @endpoint
    async def save(self, path: str, data_state: dict | None = None) -> str:
        return self._c().save(path, data_state)

    @endpoint
    async def load(self, path: str) -> dict:
        return self._c().load(path)

    @endpoint
    async def export_hf(self, path: str, merged: bool = False) -> int:
        """Write a vLLM-loadable HF directory (with LoRA: base + adapter/, or `merged`); returns the
        version of the weights written."""
        self._c().state.export_hf(path, merged)
        return self._c().version

    @endpoint
    async def sync_handle(self, num_receivers: int, host: str = "127.0.0.1", ws_cfg: WeightSyncConfig | None = None):
        """Every rank builds its WeightSender for its own shards (HF-named boxes, in model.dtype, what
        the engines load; pipeline/weightsync/shard_plan.py) and returns its handle (Trainer merges
        them). `host`: the address receivers reach rank 0's host at (collective: each rank hosts its
        own group's store, on its own host's address when that is not loopback); `ws_cfg`: the
        transport (default: this trainer's weight_sync). A second call replaces the sender.
        Collective over the ranks: the boxes are exchanged so every rank builds the same plan."""
        core = self._c()
        meta = core.state.hf_meta()
        holdings = core.par.all_gather_object([box for box, _ in core.state.push_boxes()])
        if core.par.rank and not ipaddress.ip_address(host).is_loopback:
            host = socket.gethostbyname(socket.getfqdn())
        from pipeline.weightsync.sender import WeightSender

        if self.sender is not None:
            self.sender.close()
        self.sender = WeightSender(ws_cfg or self.cfg.weight_sync, meta, num_receivers, host, self.cfg.trainer.backend,
                                   holdings=holdings, rank=core.par.rank)
        return self.sender.handle()

    @endpoint
    async def push_weights(self, full: bool = False) -> WeightVersion:
        """Every rank packs its own shards as the current version (cast to model.dtype as they are
        copied, nothing gathered) and starts its transfer. Returns once this rank's snapshot is
        packed: the next train_step may run while receivers read. `full`: no delta this time
        (weight_sync.delta; WeightSync asks when a collective member lacks the previous version)."""
        core = self._c()
        if self.sender is None:
            raise RuntimeError("trainer: push_weights before sync_handle(num_receivers)")
        tensors = [t for _, t in core.state.push_boxes()]
        return await self.sender.publish(tensors, core.version, full)

    @concurrent_endpoint  # beside the next train_step: it reads the packed slot, not the live weights
    async def weight_checksums(self, version: int) -> dict[str, str]:
        """This rank's share (wire form, pipeline/weightsync/checksum.py `of_box`) of the checksum of
        each HF tensor it sends, from its packed snapshot of `version`: the driver's
        `Trainer.weight_checksums` adds every rank's shares into the checksums of the weights the
        engines must serve. No collective, so it may run beside the next train_step. Call it before
        the push of version + 1 starts (WeightSync does): that push's pack reuses no slot of
        `version`, but the one after it does."""
        if self.sender is None:
            raise RuntimeError("trainer: weight_checksums before sync_handle(num_receivers)")
        sums = await asyncio.to_thread(self.sender.checksums, version)
        return {k: v.to_wire() for k, v in sums.items()}


class Trainer:
    """Driver-side handle on the trainer mesh: calls every rank, returns rank 0's answer."""

    def __init__(self, cfg: Config, procs, mesh) -> None:
        self.cfg, self.procs, self.mesh = cfg, procs, mesh
        self.addr = "127.0.0.1"  # rank 0's host as the other hosts reach it (set by start's rendezvous)
        self.placements: list[dict] = []  # apply()'s report per rank, in rank order (set by start)

    @classmethod
    async def start(cls, cfg: Config, host=None, name: str = "trainer") -> "Trainer":
        """Spawn trainer.num_ranks ranks split evenly over the hosts of `host` (this host if None),
        rendezvous them at rank 0's host and build the model. `self.addr` is that host's address."""
        host = host or this_host()
        hosts, n = host.sizes.get("hosts", 1), cfg.trainer.num_ranks
        if n % hosts:
            raise ConfigError(f"config: trainer.num_ranks={n} is invalid; allowed: a multiple of the job's "
                              f"{hosts} hosts (the trainer runs num_ranks / hosts ranks on every host)")
        for rank in range(n // hosts):  # cores or GPUs too few for a host's ranks: ConfigError before spawning
            trainer_placement(cfg, rank, n // hosts, 1)
        procs = host.spawn_procs(per_host={"procs": n // hosts})
        mesh = procs.spawn(name, TrainerActor, cfg)
        self = cls(cfg, procs, mesh)
        try:
            rank0 = mesh.slice(**dict.fromkeys(mesh.sizes, 0))
            self.addr, port = await asyncio.wait_for(rank0.rendezvous_point.call_one(hosts > 1),
                                                     cfg.trainer.init_timeout_s)
            ranks = await self.call_all("setup", self.addr, port, timeout=cfg.trainer.init_timeout_s, every=True)
        except BaseException:
            await procs.stop()
            raise
        self.placements = [r["placement"] for r in ranks]
        for r in ranks:
            log.info("trainer rank %d/%d on host %d (pid %d), rendezvous %s:%d; placement: %s", r["rank"],
                     r["world"], r["host"], r["pid"], self.addr, port, describe(r["placement"]))
        return self

    async def call_all(self, ep: str, *args, timeout: float | None = None, every: bool = False):
        """Call endpoint `ep` on every rank (they are collectives); rank 0's answer, or every rank's
        answer in rank order (hosts outer, local ranks inner) when `every`."""
        t = timeout or self.cfg.trainer.step_timeout_s
        try:
            vm = await asyncio.wait_for(getattr(self.mesh, ep).call(*args), t)
        except asyncio.TimeoutError:
            raise TimeoutError(f"trainer.{ep}: no answer from {self.cfg.trainer.num_ranks} rank(s) "
                               f"within {t:.0f}s") from None
        values = list(vm.values())  # row-major over ('hosts', 'procs') or ('procs',): global rank order
        return values if every else values[0]

    async def train_step(self, batch: Batch) -> dict[str, float]:
        return await self.call_all("train_step", batch)

    async def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, lr: float | None = None) -> dict[str, float]:
        return await self.call_all("sft_step", input_ids, loss_mask, lr)

    async def version(self) -> int:
        return await self.call_all("version")

    async def set_reference(self) -> bool:
        return await self.call_all("set_reference")

    async def reset_optimizer(self) -> None:
        await self.call_all("reset_optimizer")

    async def save(self, path: str, data_state: dict | None = None) -> str:
        return await self.call_all("save", str(path), data_state)

    async def load(self, path: str) -> dict:
        return await self.call_all("load", str(path))

    async def export_hf(self, path: str, merged: bool = False) -> int:
        return await self.call_all("export_hf", str(path), merged)

    async def sync_handle(self, num_receivers: int, host: str = "127.0.0.1", ws_cfg: WeightSyncConfig | None = None):
        """Every rank's sender handle, merged: what each receiver needs (it reads from every rank)."""
        return merge_handles(await self.call_all("sync_handle", num_receivers, host, ws_cfg, every=True))

    async def push_weights(self, full: bool = False) -> WeightVersion:
        return await self.call_all("push_weights", full, timeout=self.cfg.weight_sync.timeout_s)

    async def weight_checksums(self, version: int) -> dict[str, str]:
        """HF name -> checksum (wire form) of the whole tensor of `version` the trainer pushed, added
        from every rank's share of it (each rank checksums its own shards only)."""
        shares = await self.call_all("weight_checksums", version, timeout=self.cfg.weight_sync.timeout_s, every=True)
        whole = combine([{k: Checksum.from_wire(v) for k, v in s.items()} for s in shares])
        return {k: v.to_wire() for k, v in whole.items()}

    async def close(self) -> None:
        await self.procs.stop()
