"""run.launcher=monarch: this process is the controller. It asks a scheduler for hosts per role
through Monarch's job API, places the roles on them, drives the run, and releases the job at the end,
on Ctrl-C or SIGTERM, on any error, and (through cleanup.AT_HARD_EXIT) on a forced exit.

    python -m pipeline.run --config configs/tiny.yaml run.launcher=monarch launcher.job=process \\
        launcher.generator_hosts=1 weight_sync.transport=rdma

What it leaves in out_dir/cluster/: job.json (the scheduler, its job id or host pids, hosts per role,
the controller's pid, and "released" once it is released), for Slurm heartbeat (touched every
HEARTBEAT_S; a node's worker stops itself once it goes stale), each process host's log, and for Slurm the
submitted script (sbatch.sh) and the job's output (slurm-<id>.out).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from pipeline import cleanup
from pipeline.cluster.jobs import HEARTBEAT_S, ProcessHosts, SlurmHosts, check_satisfiable, cluster_dir, make_job
from pipeline.cluster.manifest import mesh_name
from pipeline.cluster.roles import Roles
from pipeline.driver.calls import RunError

log = logging.getLogger(__name__)


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while True:
        path.touch()
        if stop.wait(HEARTBEAT_S):
            return


def describe(job: Any) -> dict:
    if isinstance(job, ProcessHosts):
        return {"scheduler": "process", "pids": job.pids()}
    if isinstance(job, SlurmHosts):
        return {"scheduler": "slurm", "job_id": job._slurm_job_id}
    return {"scheduler": "kubernetes", "namespace": job._namespace, "meshes": list(job._meshes)}


def run_under_monarch(cfg: Any, drive: Callable[..., int]) -> int:
    """Submit the job, wait for its hosts (launcher.start_timeout_s), call `drive(roles=...)` and
    return its exit code; the job is released on every exit path."""
    from monarch.config import ChannelTransport, configure

    lc = cfg.launcher
    job = make_job(cfg)  # a ConfigError (exit 2) for what cannot be asked here, before anything is submitted
    if lc.job == "process" or ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback:
        # every host is this machine (process hosts, or a scheduler stand-in on a host whose name is
        # loopback only): Monarch's TCP stays on loopback
        configure(default_transport=ChannelTransport.TcpWithLocalhost)
    check_satisfiable(cfg, job)
    cdir = cluster_dir(cfg)
    cdir.mkdir(parents=True, exist_ok=True)
    record = {"launcher": lc.job, "hosts": lc.hosts(), "controller_pid": os.getpid(), "released": False}
    stop = threading.Event()
    done = threading.Lock()
    released: list[bool] = []

    def release() -> None:
        with done:
            if released:
                return
            released.append(True)
            stop.set()
            t0 = time.monotonic()
            try:
                job.kill()
            except Exception as e:  # noqa: BLE001 - report, and still record the attempt
                log.error("releasing the %s job failed: %s", lc.job, e)
            record["released"] = True
            _write(cdir / "job.json", record)
            log.info("released the %s job (%.1fs)", lc.job, time.monotonic() - t0)

    cleanup.AT_HARD_EXIT.append(release)
    if lc.job == "slurm":  # what a node's worker reads to stop itself once this controller is gone
        threading.Thread(target=_heartbeat, args=(cdir / "heartbeat", stop), daemon=True,
                         name="cluster-heartbeat").start()
    try:
        t0 = time.monotonic()
        log.info("asking %s for hosts: %s", lc.job, ", ".join(f"{k} x{v}" for k, v in lc.hosts().items()))
        job.apply()
        record.update(describe(job))
        _write(cdir / "job.json", record)
        try:
            state = job.state(cached_path=None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # Monarch's attach panics as a BaseException
            raise RunError(f"the {lc.job} job's hosts did not come up: {' '.join(str(e).split())}") from e
        meshes = SimpleNamespace(**{role: getattr(state, mesh_name(cfg, role)) for role in lc.hosts()})
        roles = Roles.from_job(cfg, meshes, local=lc.job == "process")
        log.info("%d hosts up in %.1fs (%s); generators on %s", sum(lc.hosts().values()), time.monotonic() - t0,
                 lc.job, "hosts of their own" if roles.apart else "the trainer's hosts")
        return drive(roles=roles)
    finally:
        release()
        cleanup.AT_HARD_EXIT.remove(release)
