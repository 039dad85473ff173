"""SIGKILL the controller of a run.launcher=monarch run at step 2 and report how long its hosts and role
procs outlive it (slurm: through tools/slurm_standin). Prints one line; about a minute.

    python -m tools.probe.cluster_kill9 process | slurm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import time
from pathlib import Path

from tools.lib.cli import REPO, start_cli, wait_for
from tools.lib.metrics import read_rows

STANDIN_STATE = Path("/tmp/ssd9")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("job", choices=("process", "slurm"), help="launcher.job")
    job_kind = ap.parse_args().job
    out = REPO / f"outputs/cluster_kill9_{job_kind}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(STANDIN_STATE, ignore_errors=True)
    env = {**os.environ, "PATH": f"{REPO}/tools/slurm_standin:{os.environ['PATH']}",
           "SLURM_STANDIN_DIR": str(STANDIN_STATE)}
    overrides = ["run.launcher=monarch", f"launcher.job={job_kind}", "launcher.generator_hosts=1",
                 "weight_sync.transport=rdma", "run.steps=50", "run.eval_every=0", "run.warm_start_steps=0",
                 f"run.out_dir={out}"]
    p = start_cli("configs/tiny.yaml", overrides, Path(f"{out}.log"), env=env, new_session=True)

    def steps() -> int:
        return sum(1 for r in read_rows(out / "metrics.jsonl") if "step" in r)

    wait_for(lambda: steps() >= 2, 500, "step 2", p)
    job = json.loads((out / "cluster/job.json").read_text())
    placement = json.loads((out / "placement.json").read_text())
    roles = [v["pid"] for v in placement.values() if isinstance(v, dict) and "pid" in v]
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t1 = time.time()
    if job_kind == "process":
        watch = list(job["pids"].values()) + roles
    else:
        st = json.loads((STANDIN_STATE / f"{job['job_id']}.json").read_text())
        watch = [st["pid"]] + roles
    while any(alive(x) for x in watch) and time.time() - t1 < 240:
        time.sleep(0.5)
    left = [x for x in watch if alive(x)]
    print(f"{job_kind}: controller killed at step {steps()}; hosts and role procs {watch} gone after "
          f"{time.time() - t1:.1f}s; left: {left}")
    for x in left:
        os.kill(x, signal.SIGKILL)


if __name__ == "__main__":
    main()
