"""SIGKILL the controller of a run.launcher=monarch run at step 2 and report how long its hosts and role
procs outlive it: python tools/cluster_kill9.py process | slurm (slurm: through tools/slurm_standin)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
job_kind = sys.argv[1]
out = REPO / f"outputs/cluster_kill9_{job_kind}"
shutil.rmtree(out, ignore_errors=True)
shutil.rmtree("/tmp/ssd9", ignore_errors=True)
env = {**os.environ, "PATH": f"{REPO}/tools/slurm_standin:{os.environ['PATH']}", "SLURM_STANDIN_DIR": "/tmp/ssd9"}
args = [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", "run.launcher=monarch",
        f"launcher.job={job_kind}", "launcher.generator_hosts=1", "weight_sync.transport=rdma", "run.steps=50",
        "run.eval_every=0", "run.warm_start_steps=0", f"run.out_dir={out}"]
p = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(f"{out}.log", "w"), stderr=subprocess.STDOUT,
                     start_new_session=True)
def steps():
    m = out / "metrics.jsonl"
    return sum(1 for l in m.read_text().splitlines() if '"step": ' in l) if m.exists() else 0
t0 = time.time()
while steps() < 2:
    assert p.poll() is None and time.time() - t0 < 500, open(f"{out}.log").read()[-2000:]
    time.sleep(0.5)
job = json.loads((out / "cluster/job.json").read_text())
placement = json.loads((out / "placement.json").read_text())
roles = [v["pid"] for v in placement.values() if isinstance(v, dict) and "pid" in v]
os.kill(p.pid, signal.SIGKILL)
p.wait()
t1 = time.time()
def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
if job_kind == "process":
    watch = list(job["pids"].values()) + roles
else:
    st = json.loads(Path(f"/tmp/ssd9/{job['job_id']}.json").read_text())
    watch = [st["pid"]] + roles
while any(alive(x) for x in watch) and time.time() - t1 < 240:
    time.sleep(0.5)
left = [x for x in watch if alive(x)]
print(f"{job_kind}: controller killed at step {steps()}; hosts and role procs {watch} gone after "
      f"{time.time() - t1:.1f}s; left: {left}")
for x in left:
    os.kill(x, signal.SIGKILL)
