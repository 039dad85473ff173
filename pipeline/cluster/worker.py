"""One host of a run.launcher=monarch job: a Monarch worker that the controller attaches to and spawns
the run's procs on (pipeline/cluster/jobs.py starts it; so does the Slurm batch script, once per node).

    python -m pipeline.cluster.worker --address tcp://127.0.0.1:PORT,PROCID --parent-pid P   # a process host
    python -m pipeline.cluster.worker --slurm --port 22222 --heartbeat OUT/cluster/heartbeat  # under srun

A worker never outlives its run: a process host exits when its controller (--parent-pid) is gone;
a Slurm node's worker exits once the controller's heartbeat file (written every few seconds by
pipeline/cluster/launch.py on the shared filesystem) is older than --orphan-s, having seen it once.
Either way the worker first kills the procs it spawned (its session: the worker starts one).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import time


def _kill_session_and_exit(why: str) -> None:
    print(f"pipeline.cluster.worker {os.getpid()}: {why}; stopping this host", flush=True)
    me, sid = os.getpid(), os.getsid(0)
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                if os.getsid(int(d)) == sid:
                    os.kill(int(d), signal.SIGKILL)
            except OSError:
                pass
    os._exit(1)


def _watch_parent(pid: int) -> None:
    while os.getppid() == pid:  # a dead parent's children are re-parented
        time.sleep(0.5)
    _kill_session_and_exit(f"its controller (pid {pid}) is gone")


def _watch_heartbeat(path: str, orphan_s: float) -> None:
    seen = False
    while True:
        try:
            age = time.time() - os.stat(path).st_mtime
            seen = True
        except OSError:
            age = None
        if seen and (age is None or age > orphan_s):
            _kill_session_and_exit(f"no heartbeat from the controller in {path} for {orphan_s:.0f}s")
        time.sleep(2.0)


def slurm_address(port: int) -> str:
    """This node's worker address under srun: its host name, port + SLURM_NODEID (so stand-in nodes
    on one machine do not collide), and its service proc id."""
    from monarch._src.job.service_identity import ranked_service_proc_id_from_env, service_proc_addr

    node = int(os.environ["SLURM_NODEID"])
    return service_proc_addr(f"tcp://{socket.gethostname()}:{port + node}",
                             ranked_service_proc_id_from_env(rank_env="SLURM_NODEID"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.cluster.worker")
    ap.add_argument("--address", help="the Monarch address to serve on (a process host)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process (the controller) is gone")
    ap.add_argument("--slurm", action="store_true", help="under srun: the address from the node's name and id")
    ap.add_argument("--port", type=int, default=22222, help="--slurm: node i listens on port + i")
    ap.add_argument("--heartbeat", default="", help="the controller's heartbeat file (shared filesystem)")
    ap.add_argument("--orphan-s", type=float, default=300.0, help="exit once the heartbeat is this old")
    args = ap.parse_args(argv)
    if os.getpid() != os.getsid(0):
        try:
            os.setsid()  # its procs join this session, so one sweep stops them all
        except OSError:
            pass
    address = slurm_address(args.port) if args.slurm else args.address
    if not address:
        ap.error("--address or --slurm is required")
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True, name="parent-watch").start()
    if args.heartbeat:
        threading.Thread(target=_watch_heartbeat, args=(args.heartbeat, args.orphan_s), daemon=True,
                         name="heartbeat-watch").start()
    signal.signal(signal.SIGTERM, lambda *_: _kill_session_and_exit("SIGTERM"))
    print(f"pipeline.cluster.worker {os.getpid()}: serving on {address}", flush=True)
    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(address=address, ca="trust_all_connections")


if __name__ == "__main__":
    main()
