"""Trainer mesh: N Monarch actors, one torchtitan/FSDP2 rank each, plus the driver-side handle.

    trainer = await Trainer.start(cfg)                 # spawns cfg.trainer.num_ranks procs
    metrics = await trainer.train_step(batch)          # dict[str, float], rank 0's (all ranks agree)
    handle = await trainer.sync_handle(num_receivers)  # once: rank 0 builds the WeightSender
    wv = await trainer.push_weights()                  # WeightVersion; returns once the snapshot is packed
    await trainer.save(path, data_state) / await trainer.load(path) -> data_state
    await trainer.export_hf(out_dir)                   # vLLM-loadable HF directory
    await trainer.close()

Rendezvous: the driver picks a free TCP port; each rank learns (rank, world) from Monarch
(`current_rank()` / `current_size()`) in `setup` and joins `init_process_group` over tcp://.
Every endpoint is called on all ranks (FSDP forward/backward, gathers and checkpoints are
collectives); rank 0's answer is returned. Every call is bounded by `trainer.step_timeout_s`
(`init_timeout_s` for setup) and a failure on any rank is raised with that rank's error.
"""

from __future__ import annotations

import asyncio
import os
import socket
from datetime import timedelta

import torch
from monarch.actor import Actor, current_rank, current_size, endpoint, this_host

from pipeline.config import Config
from pipeline.train_core import TrainCore
from pipeline.types import Batch, WeightVersion


class TrainerActor(Actor):
    """One trainer rank. Endpoints read as the protocol; all logic lives in TrainCore."""

    def __init__(self, cfg: Config, master_addr: str, master_port: int) -> None:
        self.cfg = cfg
        self.addr, self.port = master_addr, master_port
        self.core: TrainCore | None = None
        self.sender = None  # pipeline.weightsync.WeightSender on rank 0 after sync_handle

    def _c(self) -> TrainCore:
        if self.core is None:
            raise RuntimeError("trainer: setup() has not run on this rank")
        return self.core

    @endpoint
    async def setup(self) -> dict:
        rank, world = current_rank().rank, current_size()["procs"]
        tcfg = self.cfg.trainer
        torch.set_num_threads(tcfg.cpu_threads or max(1, (os.cpu_count() or 1) // world))
        if tcfg.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        import torch.distributed as dist

        dist.init_process_group(tcfg.backend, init_method=f"tcp://{self.addr}:{self.port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=tcfg.init_timeout_s))
        self.core = TrainCore(self.cfg, rank, world)
        return {"rank": rank, "world": world, "version": self.core.version}

    @endpoint
    async def train_step(self, batch: Batch) -> dict[str, float]:
        return self._c().train_step(batch)

    @endpoint
    async def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        return self._c().sft_step(input_ids, loss_mask)

    @endpoint
    async def version(self) -> int:
        return self._c().version

    @endpoint
    async def save(self, path: str, data_state: dict | None = None) -> str:
        return self._c().save(path, data_state)

    @endpoint
    async def load(self, path: str) -> dict:
        return self._c().load(path)

    @endpoint
    async def export_hf(self, path: str) -> str:
        return self._c().export_hf(path)

    @endpoint
    async def sync_handle(self, num_receivers: int):
        """Rank 0 builds the WeightSender from HF-named metadata; returns its handle (None elsewhere).
        Every rank must take part: torchtitan's fused-QKV state-dict hook gathers DTensors."""
        meta = self._c().hf_meta()
        if self._c().rank != 0:
            return None
        from pipeline.weightsync.sender import WeightSender

        if self.sender is not None:
            self.sender.close()
        self.sender = WeightSender(self.cfg.weight_sync, meta, num_receivers)
        return self.sender.handle()

    @endpoint
    async def push_weights(self) -> WeightVersion | None:
        """Gather full HF tensors (every rank), rank 0 packs and publishes them as the current version."""
        core = self._c()
        sd = core.hf_state_dict()
        if core.rank != 0:
            return None
        if self.sender is None:
            raise RuntimeError("trainer: push_weights before sync_handle(num_receivers)")
        return await self.sender.push(sd, core.version)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """Driver-side handle on the trainer mesh: calls every rank, returns rank 0's answer."""

    def __init__(self, cfg: Config, procs, mesh) -> None:
        self.cfg, self.procs, self.mesh = cfg, procs, mesh

    @classmethod
    async def start(cls, cfg: Config, host=None, name: str = "trainer") -> "Trainer":
        n = cfg.trainer.num_ranks
        procs = (host or this_host()).spawn_procs(per_host={"procs": n})
        mesh = procs.spawn(name, TrainerActor, cfg, "127.0.0.1", free_port())
        self = cls(cfg, procs, mesh)
        try:
            await self.call_all("setup", timeout=cfg.trainer.init_timeout_s)
        except BaseException:
            await procs.stop()
            raise
        return self

    async def call_all(self, ep: str, *args, timeout: float | None = None):
        """Call endpoint `ep` on every rank (they are collectives); rank 0's answer."""
        t = timeout or self.cfg.trainer.step_timeout_s
        try:
            vm = await asyncio.wait_for(getattr(self.mesh, ep).call(*args), t)
        except asyncio.TimeoutError:
            raise TimeoutError(f"trainer.{ep}: no answer from {self.cfg.trainer.num_ranks} rank(s) "
                               f"within {t:.0f}s") from None
        return next(iter(vm.items()))[1]  # rank 0, whatever the mesh's dims (an attached host mesh adds 'hosts')

    async def train_step(self, batch: Batch) -> dict[str, float]:
        return await self.call_all("train_step", batch)

    async def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
        return await self.call_all("sft_step", input_ids, loss_mask)

    async def version(self) -> int:
        return await self.call_all("version")

    async def save(self, path: str, data_state: dict | None = None) -> str:
        return await self.call_all("save", str(path), data_state)

    async def load(self, path: str) -> dict:
        return await self.call_all("load", str(path))

    async def export_hf(self, path: str) -> str:
        return await self.call_all("export_hf", str(path))

    async def sync_handle(self, num_receivers: int):
        return await self.call_all("sync_handle", num_receivers)

    async def push_weights(self) -> WeightVersion:
        return await self.call_all("push_weights", timeout=self.cfg.weight_sync.timeout_s)

    async def close(self) -> None:
        await self.procs.stop()
