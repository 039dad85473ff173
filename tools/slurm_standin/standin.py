"""A stand-in for Slurm's sbatch, squeue, scancel and srun on one machine: every node of a job is this
machine, so a run.launcher=monarch launcher.job=slurm run can be tried (and tested) without a cluster.

    PATH=$PWD/tools/slurm_standin:$PATH python -m pipeline.run ... run.launcher=monarch launcher.job=slurm

sbatch reads the script (stdin or a file), checks it against this "cluster" (SLURM_STANDIN_NODES nodes,
default 4; partitions SLURM_STANDIN_PARTITIONS, default any), and with --test-only only answers;
otherwise it starts the script in a session of its own with SLURM_JOB_ID, SLURM_NNODES and
SLURM_JOB_NODELIST set, and prints "Submitted batch job <id>". srun starts its command once per node
(SLURM_NODEID 0..N-1). squeue --job <id> --json reports the job as Slurm 20.02+ does (RUNNING with one
allocation entry per node, all named after this host). scancel <id> SIGTERMs the job's session, then
SIGKILLs what is left after 3 s. State lives in SLURM_STANDIN_DIR (default /tmp/slurm-standin-<uid>):
<id>.sh (the script as submitted), <id>.json (its state).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("SLURM_STANDIN_DIR") or f"/tmp/slurm-standin-{os.getuid()}")


def _directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        m = re.match(r"#SBATCH\s+--([a-z-]+)(?:=(\S+))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def _session(sid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid and Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def sbatch(args: list[str]) -> int:
    test_only = "--test-only" in args
    files = [a for a in args if not a.startswith("-")]
    script = Path(files[0]).read_text() if files else sys.stdin.read()
    d = _directives(script)
    nodes, limit = int(d.get("nodes", "1")), int(os.environ.get("SLURM_STANDIN_NODES", "4"))
    parts = [p for p in os.environ.get("SLURM_STANDIN_PARTITIONS", "").split(",") if p]
    if "partition" in d and parts and d["partition"] not in parts:
        print("sbatch: error: invalid partition specified: " + d["partition"], file=sys.stderr)
        return 1
    if nodes > limit:
        print(f"sbatch: error: Batch job submission failed: Requested node configuration is not available "
              f"({nodes} nodes asked, {limit} in the partition)", file=sys.stderr)
        return 1
    if test_only:
        print(f"sbatch: Job 0 to start at now using {nodes} processors on nodes {socket.gethostname()}",
              file=sys.stderr)
        return 0
    STATE.mkdir(parents=True, exist_ok=True)
    job_id = 1000 + len(list(STATE.glob("*.sh")))
    path = STATE / f"{job_id}.sh"
    path.write_text(script)
    out = d.get("output", f"slurm-{job_id}.out").replace("%j", str(job_id))
    env = {**os.environ, "SLURM_JOB_ID": str(job_id), "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NODELIST": socket.gethostname(), "SLURM_JOB_NAME": d.get("job-name", "")}
    with open(out, "ab") as f:
        proc = subprocess.Popen(["bash", str(path)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (STATE / f"{job_id}.json").write_text(json.dumps({"pid": proc.pid, "nodes": nodes, "state": "RUNNING"}))
    print(f"Submitted batch job {job_id}")
    return 0


def _state(job_id: str) -> dict | None:
    f = STATE / f"{job_id}.json"
    if not f.is_file():
        return None
    st = json.loads(f.read_text())
    if st["state"] == "RUNNING" and not _session(st["pid"]):
        st["state"] = "COMPLETED"
        f.write_text(json.dumps(st))
    return st


def squeue(args: list[str]) -> int:
    job_id = args[args.index("--job") + 1] if "--job" in args else None
    st = _state(job_id) if job_id else None
    if st is None:
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        return 1
    alloc = [{"name": socket.gethostname()} for _ in range(st["nodes"])]
    print(json.dumps({"jobs": [{"job_id": int(job_id), "job_state": [st["state"]],
                                "job_resources": {"nodes": {"allocation": alloc}}}]}))
    return 0


def scancel(args: list[str]) -> int:
    for job_id in [a for a in args if not a.startswith("-")]:
        st = _state(job_id)
        if st is None:
            print(f"scancel: error: Invalid job id {job_id}", file=sys.stderr)
            return 1
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
            for pid in _session(st["pid"]):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait
            while _session(st["pid"]) and time.monotonic() < deadline:
                time.sleep(0.1)
        if st["state"] == "RUNNING":
            st["state"] = "CANCELLED"
        (STATE / f"{job_id}.json").write_text(json.dumps(st))
    return 0


def srun(args: list[str]) -> int:
    cmd = [a for a in args if not (a.startswith("--") and "=" in a)]
    n = int(os.environ.get("SLURM_NNODES", "1"))
    procs = [subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i),
                                        "SLURM_LOCALID": "0", "SLURMD_NODENAME": socket.gethostname()})
             for i in range(n)]

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit({"sbatch": sbatch, "squeue": squeue, "scancel": scancel, "srun": srun}[sys.argv[1]](sys.argv[2:]))
