"""Placement: the cores and GPUs each proc of the job runs on (issue #13).

    check_host(cfg)    # at start-up: every core a *.cpus key names is one this process may run on
    p = trainer_placement(cfg, rank=1, per_host=2, host_cores=8)   # pure: trainer rank 1, 2 ranks a host
    ps = generator_placements(cfg, generator_hosts=[0, 1, 0], trainer_per_host=2)
    info = apply(p)    # in the proc, first thing in its actor's setup; what the proc ended up with

Rules (pure functions, unit-tested in tests/test_placement.py):
- A mesh's core set (trainer.cpus, generator.cpus, buffer.cpus) holds on every host: the mesh's
  procs on a host split it evenly into contiguous shares, the first len % n one core larger. A
  proc runs one torch thread per core of its share (trainer.cpu_threads overrides the trainer's).
  A generator's share is split again over its engine's tensor-parallel ranks for vLLM's CPU worker
  threads (VLLM_CPU_OMP_THREADS_BIND, "0-1|2-3"). An empty set pins nothing.
- GPUs: trainer local rank i takes trainer.devices[i]; generator k of its host takes the next
  generator.tensor_parallel_size ids of generator.devices. Unset: the trainer's local ranks take
  the host's GPUs 0..T-1 and the generators the next ones, wrapping around (sharing a GPU) on a
  host with fewer. Ids index the GPUs the proc inherits (an inherited CUDA_VISIBLE_DEVICES holds).

`apply` pins every thread of the proc, so whatever it starts later (vLLM's engine core and its
workers) inherits the mask; it sets torch's thread count, and CUDA_VISIBLE_DEVICES before CUDA
starts. GPU ids are checked against torch.cuda.device_count() there, the only place they can be.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from pipeline.config import Config
from pipeline.config.errors import check
from pipeline.config.ids import format_ids, parse_ids


class PlacementError(RuntimeError):
    """A placement this host cannot give (cores it does not have, GPUs it does not see)."""


def check_host(cfg: Config) -> None:
    """ConfigError naming the first *.cpus key with a core this host does not give this process
    (os.sched_getaffinity): at start-up, before any proc, so a typo exits 2 instead of failing in
    a proc's placement. Core sets are the same on every host, so this host speaks for all."""
    allowed = os.sched_getaffinity(0)
    for key, spec in (("trainer.cpus", cfg.trainer.cpus), ("generator.cpus", cfg.generator.cpus),
                      ("buffer.cpus", cfg.buffer.cpus), ("reward_model.cpus", cfg.reward_model.cpus),
                      ("teacher.cpus", cfg.teacher.cpus)):
        cores = set(parse_ids(spec))
        check(cores <= allowed, key, spec, f"cores of this host ({format_ids(allowed)}); "
              f"{format_ids(cores - allowed)} is not one")


def split_even(ids: Sequence[int], n: int, k: int) -> tuple[int, ...]:
    """Share k of `ids` split into n contiguous parts whose sizes differ by at most one."""
    q, r = divmod(len(ids), n)
    start = k * q + min(k, r)
    return tuple(ids[start:start + q + (k < r)])


@dataclass(frozen=True)
class Placement:
    """Where one proc runs. Nothing set: the proc is not placed (every core it was started with)."""

    role: str
    cpus: tuple[int, ...] = ()
    cpus_key: str = ""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    omp_env: bool = True
    """Also export OMP_NUM_THREADS=threads to the proc's children."""
    vllm_cpu_bind: str = ""
    """VLLM_CPU_OMP_THREADS_BIND for the engine's CPU workers ('' leaves vLLM's 'auto')."""
    gpus: tuple[int, ...] = ()
    gpus_key: str = ""
    """The config key of explicit GPU ids; '' for the default assignment, which wraps around."""


def _share(spec: str, key: str, n: int, k: int, per: int, who: str) -> tuple[int, ...]:
    """Proc k's share of the sorted core set `spec` among n procs needing `per` cores each."""
    cpus = tuple(sorted(parse_ids(spec)))
    if not cpus:
        return ()
    check(len(cpus) >= n * per, key, spec, f"a set of at least {n * per} cores: {who}")
    return split_even(cpus, n, k)


def trainer_placement(cfg: Config, rank: int, per_host: int, host_cores: int) -> Placement:
    """Trainer rank `rank` with `per_host` ranks on each host; `host_cores`: cores the proc may use
    before placement (the thread default of an unpinned rank is its even part of them)."""
    t, local = cfg.trainer, rank % per_host
    cpus = _share(t.cpus, "trainer.cpus", per_host, local, 1,
                  f"one per trainer rank of a host ({per_host} = trainer.num_ranks / hosts)")
    threads = t.cpu_threads or len(cpus) or max(1, host_cores // per_host)
    gpus, key = (), ""
    if t.device == "cuda":
        ids = parse_ids(t.devices, "GPU")
        if ids:
            check(len(ids) >= per_host, "trainer.devices", t.devices,
                  f"one GPU per trainer rank of a host ({per_host} = trainer.num_ranks / hosts)")
            gpus, key = (ids[local],), "trainer.devices"
        else:
            gpus = (local,)
    return Placement(f"trainer rank {rank}", cpus, "trainer.cpus", threads, gpus=gpus, gpus_key=key)


def generator_placements(cfg: Config, generator_hosts: Sequence[int], trainer_per_host: int) -> list[Placement]:
    """Placement of generator i, which runs on host generator_hosts[i]; `trainer_per_host` trainer
    ranks run on every host (their GPUs come first in the default assignment)."""
    g, tp = cfg.generator, cfg.generator.tensor_parallel_size
    count, seen, out = Counter(generator_hosts), Counter(), []
    gpu_ids = parse_ids(g.devices, "GPU")
    first_gpu = trainer_per_host if cfg.trainer.device == "cuda" else 0
    for i, h in enumerate(generator_hosts):
        k, n = seen[h], count[h]
        seen[h] += 1
        who = f"{n} generator(s) on host {h} x generator.tensor_parallel_size={tp}"
        cpus = _share(g.cpus, "generator.cpus", n, k, tp, who)
        bind = ("|".join(format_ids(split_even(cpus, tp, r)) for r in range(tp))
                if cpus and g.engine == "vllm-cpu" else "")
        gpus, key = (), ""
        if g.engine == "vllm":
            if gpu_ids:
                check(len(gpu_ids) >= n * tp, "generator.devices", g.devices, f"at least {n * tp} GPUs: {who}")
                gpus, key = gpu_ids[k * tp:(k + 1) * tp], "generator.devices"
            else:
                gpus = tuple(range(first_gpu + k * tp, first_gpu + (k + 1) * tp))
        # No OMP_NUM_THREADS: the model's thread count comes from the bind, set by vLLM for a worker
        # process of its own or by pipeline/generator/llm.py for a worker in the engine core; with a
        # separate worker the core would otherwise keep that many torch threads for its scheduler loop.
        out.append(Placement(f"generator{i}", cpus, "generator.cpus", len(cpus), omp_env=False,
                             vllm_cpu_bind=bind, gpus=gpus, gpus_key=key))
    return out


def buffer_placement(cfg: Config) -> Placement:
    cpus = tuple(sorted(parse_ids(cfg.buffer.cpus)))
    return Placement("buffer", cpus, "buffer.cpus", len(cpus))


def reward_model_placement(cfg: Config) -> Placement:
    cpus = tuple(sorted(parse_ids(cfg.reward_model.cpus)))
    return Placement("reward_model", cpus, "reward_model.cpus", len(cpus))


def teacher_placement(cfg: Config) -> Placement:
    cpus = tuple(sorted(parse_ids(cfg.teacher.cpus)))
    gpus = tuple(parse_ids(cfg.teacher.devices)) if cfg.teacher.device == "cuda" else ()
    return Placement("teacher", cpus, "teacher.cpus", len(cpus), gpus=gpus,
                     gpus_key="teacher.devices" if gpus else "")


def resolve_gpus(p: Placement, visible: int) -> tuple[int, ...]:
    """The GPU indices `p` runs on, on a host where the proc sees `visible` GPUs."""
    key = p.gpus_key or "the default GPU assignment (trainer.devices / generator.devices unset)"
    if visible == 0:
        raise PlacementError(f"{p.role}: no GPU visible on this host (torch.cuda.device_count() == 0) for {key}")
    if p.gpus_key:
        bad = [i for i in p.gpus if i >= visible]
        if bad:
            raise PlacementError(f"{p.role}: {p.gpus_key} names GPU {format_ids(bad)}, but this host has "
                                 f"{visible} visible GPU(s): 0..{visible - 1}")
        return p.gpus
    ids = tuple(i % visible for i in p.gpus)
    if len(set(ids)) < len(ids):
        raise PlacementError(f"{p.role}: needs {len(ids)} GPUs (generator.tensor_parallel_size) but this host "
                             f"has {visible} visible")
    return ids


def _pin_threads(cpus: set[int]) -> None:
    """sched_setaffinity acts on one thread: pin every thread of this process, until a listing finds
    none new (a thread started meanwhile by an unpinned one is caught by the next listing)."""
    done: set[int] = set()
    while new := {int(t) for t in os.listdir("/proc/self/task")} - done:
        for tid in new:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= new


def apply(p: Placement) -> dict:
    """Place this proc; call first in its actor's setup, before any model, engine or CUDA context.
    Returns what the proc ended up with, read back from the kernel and torch."""
    import torch

    if p.cpus:
        allowed = os.sched_getaffinity(0)
        if not set(p.cpus) <= allowed:
            raise PlacementError(f"{p.role}: {p.cpus_key} names cores {format_ids(set(p.cpus) - allowed)} that "
                                 f"this host does not give it (it may use {format_ids(allowed)})")
        _pin_threads(set(p.cpus))
    if p.threads:
        torch.set_num_threads(p.threads)
        if p.omp_env:
            os.environ["OMP_NUM_THREADS"] = str(p.threads)
    if p.vllm_cpu_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = p.vllm_cpu_bind
    if p.gpus:
        if torch.cuda.is_initialized():
            raise PlacementError(f"{p.role}: CUDA started in this proc before its placement, so "
                                 "CUDA_VISIBLE_DEVICES would be ignored")
        visible = torch.cuda.device_count()  # NVML: does not start CUDA; honours an inherited CUDA_VISIBLE_DEVICES
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        names = [s.strip() for s in inherited.split(",")] if inherited else [str(i) for i in range(visible)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] for i in resolve_gpus(p, visible))
    return {"role": p.role, "pid": os.getpid(), "ppid": os.getppid(), "hostname": socket.gethostname(),
            "cpus": format_ids(os.sched_getaffinity(0)), "pinned": bool(p.cpus),
            "threads": torch.get_num_threads(), "gpus": os.environ["CUDA_VISIBLE_DEVICES"] if p.gpus else "",
            "vllm_cpu_bind": p.vllm_cpu_bind}


def describe(info: dict) -> str:
    """apply()'s report for a log line (without its role and pid)."""
    s = f"cores {info['cpus']} ({'pinned' if info['pinned'] else 'not pinned'}), {info['threads']} torch threads"
    if info["vllm_cpu_bind"]:
        s += f", vLLM CPU worker threads on {info['vllm_cpu_bind']}"
    if info["gpus"]:
        s += f", CUDA_VISIBLE_DEVICES={info['gpus']}"
    return s
