"""The Monarch job of a run.launcher=monarch run: one host mesh per role (trainer, generators,
sides), asked of a scheduler through Monarch's job API (`monarch.job`).

    job = make_job(cfg)           # ProcessHosts | SlurmHosts | a monarch KubernetesJob; nothing submitted yet
    check_satisfiable(job)        # Slurm: sbatch --test-only; a refusal is a ConfigError (exit 2)
    job.apply()                   # submit / start the hosts
    state = job.state(cached_path=None)   # state.trainer, state.generators, state.sides: HostMeshes
    job.kill()                    # release every host (scancel, pods deleted, processes killed)

- ProcessHosts: Monarch's ProcessJob with each host a process of this machine reached over TCP on
  loopback (Monarch's own uses unix sockets), its output in out_dir/cluster/<role>_<i>.log, and
  exiting with its controller (pipeline/cluster/worker.py --parent-pid).
- SlurmHosts: Monarch's SlurmJob with this project's batch script (`batch_script`): one worker per
  node under srun, node i on port + i, stopping itself once the controller's heartbeat file goes
  stale (a controller killed with SIGKILL leaves no allocation behind for long).
- Kubernetes: Monarch's KubernetesJob provisioning one MonarchMesh per role (`manifests` renders
  what it submits, without a cluster: python -m pipeline.cluster.manifest).
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from monarch._src.actor.bootstrap import attach_to_workers
from monarch._src.job.job import JobState, ProcessState
from monarch._src.job.process import ProcessJob
from monarch._src.job.service_identity import (SERVICE_PROC_IDS_ENV, allocate_service_proc_ids,
                                               serialize_service_proc_ids, service_proc_addr, service_proc_addrs)
from monarch._src.job.slurm import SlurmJob

from pipeline.config import ConfigError

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""How often the controller touches out_dir/cluster/heartbeat (pipeline/cluster/launch.py)."""


def cluster_dir(cfg: Any) -> Path:
    return Path(cfg.run.out_dir).resolve() / "cluster"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessHosts(ProcessJob):
    """Every host a worker process of this machine, on its own loopback TCP port."""

    def __init__(self, meshes: dict[str, int], log_dir: Path):
        super().__init__(meshes)
        self._log_dir = log_dir

    def _create(self, client_script: str | None) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for mesh, count in self._meshes.items():
                ids = allocate_service_proc_ids(count)
                for i in range(count):
                    key = f"{mesh}_{i}"
                    addr = service_proc_addr(f"tcp://127.0.0.1:{_free_port()}", ids[i])
                    with open(self._log_dir / f"{key}.log", "ab") as out:
                        proc = subprocess.Popen(
                            [sys.executable, "-m", "pipeline.cluster.worker", "--address", addr,
                             "--parent-pid", str(os.getpid())],
                            env={**os.environ, "HYPERACTOR_PROCESS_NAME": key}, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
                    self._host_to_pid[key] = ProcessState(proc.pid, addr)
                    log.info("host %s: pid %d on %s", key, proc.pid, addr.split(",")[0])
        except BaseException:
            self._kill()
            raise

    def pids(self) -> dict[str, int]:
        return {k: v.pid for k, v in self._host_to_pid.items()}


def batch_script(cfg: Any, meshes: dict[str, int], proc_ids: list, job_name: str) -> str:
    """The sbatch script SlurmHosts submits: the directives launcher.* asks for, then one worker per node."""
    lc, sc = cfg.launcher, cfg.launcher.slurm
    logs = cluster_dir(cfg)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={sum(meshes.values())}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={logs}/slurm-%j.out"]
    for flag, value in (("partition", sc.partition), ("account", sc.account), ("qos", sc.qos), ("time", sc.time),
                        ("mem", sc.mem), ("cpus-per-task", sc.cpus_per_task or ""),
                        ("gpus-per-node", lc.devices_per_host or "")):
        if value != "":
            lines.append(f"#SBATCH --{flag}={value}")
    if sc.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += [f"#SBATCH {extra}" for extra in sc.sbatch]
    python = sc.python or sys.executable
    worker = [python, "-m", "pipeline.cluster.worker", "--slurm", "--port", str(sc.port),
              "--heartbeat", str(logs / "heartbeat"), "--orphan-s", str(max(60.0, 12 * HEARTBEAT_S))]
    lines += [f"# roles, in node order: {', '.join(f'{k} x{v}' for k, v in meshes.items())}",
              f"export {SERVICE_PROC_IDS_ENV}={shlex.quote(serialize_service_proc_ids(proc_ids))}",
              f"cd {shlex.quote(os.getcwd())}",
              f"srun --ntasks-per-node=1 {shlex.join(worker)}", ""]
    return "\n".join(lines)


class SlurmHosts(SlurmJob):
    """Monarch's SlurmJob, submitting `batch_script` and attaching to node i on port + i."""

    def __init__(self, cfg: Any, meshes: dict[str, int]):
        lc, sc = cfg.launcher, cfg.launcher.slurm
        super().__init__(meshes, python_exe=sc.python or sys.executable, monarch_port=sc.port,
                         job_name=lc.name, time_limit=sc.time or None, partition=sc.partition or None,
                         log_dir=str(cluster_dir(cfg)), exclusive=sc.exclusive, account=sc.account or None,
                         qos=sc.qos or None, job_start_timeout=int(lc.start_timeout_s))
        self._cfg = cfg

    def script(self) -> str:
        self._ensure_service_proc_ids(sum(self._meshes.values()))
        return batch_script(self._cfg, self._meshes, self._service_proc_ids, f"{self._job_name}_{os.getpid()}")

    def test_only(self) -> str | None:
        """sbatch --test-only on the script: None if the scheduler could run it, else its refusal."""
        r = subprocess.run(["sbatch", "--test-only"], input=self.script(), capture_output=True, text=True,
                           timeout=120)
        if r.returncode == 0:
            return None
        return " ".join((r.stderr or r.stdout).split()) or f"sbatch --test-only exited {r.returncode}"

    def _submit_slurm_job(self, num_nodes: int, client_script: str | None = None) -> str:
        if client_script is not None:
            raise RuntimeError("SlurmHosts: the controller runs where the command is run, not in a batch job")
        cluster_dir(self._cfg).mkdir(parents=True, exist_ok=True)
        script = self.script()
        (cluster_dir(self._cfg) / "sbatch.sh").write_text(script)
        r = subprocess.run(["sbatch"], input=script, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch refused the job: {' '.join((r.stderr or r.stdout).split())}")
        job_id = next((ln.split()[-1] for ln in r.stdout.splitlines() if "Submitted batch job" in ln), None)
        if job_id is None:
            raise RuntimeError(f"sbatch printed no job id: {r.stdout.strip()!r}")
        log.info("Slurm job %s submitted (%d nodes); its output: %s/slurm-%s.out", job_id, num_nodes,
                 cluster_dir(self._cfg), job_id)
        return job_id

    def _state(self) -> JobState:
        if not self._jobs_active():
            raise RuntimeError("the Slurm job is no longer active")
        if not self._all_hostnames:
            self._all_hostnames = self._wait_for_job_start(self._slurm_job_id, sum(self._meshes.values()),
                                                           timeout=self._job_start_timeout)
        meshes, k = {}, 0
        for name, n in self._meshes.items():
            workers = [f"tcp://{h}:{self._port + k + j}" for j, h in enumerate(self._all_hostnames[k:k + n])]
            meshes[name] = attach_to_workers(name=name, ca="trust_all_connections",
                                             workers=service_proc_addrs(workers, self._service_proc_ids[k:k + n]))
            k += n
        return JobState(meshes)


def make_job(cfg: Any) -> Any:
    """The job launcher.job names, with launcher.*'s hosts per role; nothing is submitted yet."""
    lc = cfg.launcher
    meshes = lc.hosts()
    if lc.job == "process":
        return ProcessHosts(meshes, cluster_dir(cfg))
    if lc.job == "slurm":
        return SlurmHosts(cfg, meshes)
    from pipeline.cluster.manifest import kubernetes_job

    return kubernetes_job(cfg, meshes)


def check_satisfiable(cfg: Any, job: Any) -> None:
    """Before anything is submitted: a request the scheduler cannot meet is a ConfigError (exit 2)."""
    if isinstance(job, SlurmHosts):
        try:
            why = job.test_only()
        except FileNotFoundError:
            raise ConfigError("config: launcher.job='slurm' is invalid; allowed: where sbatch, squeue and scancel "
                              "are on PATH (they are not here)") from None
        if why is not None:
            raise ConfigError(f"config: launcher.* asks Slurm for what it refuses ({sum(job._meshes.values())} "
                              f"nodes: {', '.join(f'{k} x{v}' for k, v in job._meshes.items())}): {why}")
