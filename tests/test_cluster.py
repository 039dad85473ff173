"""run.launcher=monarch: hosts per role from Monarch's job API, for real on this machine.

- a process job (every host a process reached over TCP) runs the default job with the generator on a
  host of its own, weight sync over rdma, every push verified, and leaves no host behind;
- a Slurm job through the stand-in sbatch/squeue/scancel/srun (tools/slurm_standin) is handed the
  batch script launcher.* asks for, runs with weight sync over collective, and a SIGTERM mid-run
  cancels it and leaves nothing of it running;
- requests that cannot be met exit 2 with one line before anything is submitted;
- Kubernetes: the MonarchMesh manifests are rendered and checked (there is no cluster here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tools" / "slurm_standin"
SHORT = ["--config", "configs/tiny.yaml", "run.launcher=monarch", "run.steps=3", "run.eval_every=0",
         "run.warm_start_steps=0", "weight_sync.verify=every"]


def cli(args: list[str], env: dict | None = None, timeout: float = 480) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def standin_env(state: Path, **extra: str) -> dict:
    return {"PATH": f"{STANDIN}:{os.environ['PATH']}", "SLURM_STANDIN_DIR": str(state), **extra}


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def session_alive(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid and alive(int(d)):
                    out.append(int(d))
            except OSError:
                pass
    return out


def steps_in(out: Path) -> int:
    m = out / "metrics.jsonl"
    return sum(1 for line in m.read_text().splitlines() if '"step": ' in line) if m.exists() else 0


def test_a_process_job_runs_the_generator_on_a_host_of_its_own_over_rdma(tmp_path):
    out = tmp_path / "run"
    r = cli([*SHORT, "launcher.job=process", "launcher.generator_hosts=1", "weight_sync.transport=rdma",
             f"run.out_dir={out}"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    job = json.loads((out / "cluster" / "job.json").read_text())
    placement = json.loads((out / "placement.json").read_text())
    assert job["scheduler"] == "process" and job["released"] is True
    hosts = job["pids"]
    assert set(hosts) == {"trainer_0", "generators_0"}
    # each role's proc was spawned by its own host's worker: the generator on a host of its own
    assert placement["generator0"]["ppid"] == hosts["generators_0"]
    assert placement["trainer rank 0"]["ppid"] == hosts["trainer_0"]
    assert placement["buffer"]["ppid"] == hosts["trainer_0"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"step": ' in line]
    assert max(m.get("sync/verified_pushes", 0) for m in metrics) >= 2  # every push but the last step's verified
    assert not any(m.get("sync/verify_failures", 0) for m in metrics)
    assert not [p for p in hosts.values() if alive(p)], "a host process outlived its run"


def test_a_slurm_job_gets_its_script_runs_and_a_sigterm_cancels_it(tmp_path):
    state, out = tmp_path / "slurm", tmp_path / "run"
    args = [*SHORT, "run.steps=40", "launcher.job=slurm", "launcher.generator_hosts=1", "launcher.slurm.partition=debug",
            "launcher.slurm.time=00:30:00", "launcher.slurm.account=rl", "launcher.slurm.sbatch=[--constraint=cpu]",
            "weight_sync.transport=collective", f"run.out_dir={out}"]
    log = open(tmp_path / "run.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, **standin_env(state, SLURM_STANDIN_PARTITIONS="debug,gpu")})
    try:
        deadline = time.monotonic() + 420
        while steps_in(out) < 2:
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
        log.close()
    text = (tmp_path / "run.log").read_text()
    assert code == 143, text[-3000:]
    # the script it was handed: what launcher.* asked for, one worker per node under srun
    (script_file,) = state.glob("*.sh")
    script = script_file.read_text()
    assert script == (out / "cluster" / "sbatch.sh").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=debug",
                 "#SBATCH --account=rl", "#SBATCH --time=00:30:00", "#SBATCH --exclusive", "#SBATCH --constraint=cpu"):
        assert line in script.splitlines(), script
    assert re.search(r"^srun --ntasks-per-node=1 \S+ -m pipeline\.cluster\.worker --slurm --port 22222 ", script, re.M)
    # the cancel released everything: the job is cancelled and nothing of its session runs
    job_state = json.loads(next(state.glob("*.json")).read_text())
    assert job_state["state"] == "CANCELLED"
    assert not session_alive(job_state["pid"]), "a process of the Slurm job outlived the cancel"
    job = json.loads((out / "cluster" / "job.json").read_text())
    assert job["released"] is True and job["job_id"] == script_file.stem
    placement = json.loads((out / "placement.json").read_text())
    assert not alive(placement["generator0"]["pid"]) and not alive(placement["trainer rank 0"]["pid"])


@pytest.mark.parametrize("overrides,env,expect", [
    (["launcher.job=slurm", "launcher.generator_hosts=1", "weight_sync.transport=rdma"], {"SLURM_STANDIN_NODES": "1"},
     "Requested node configuration is not available"),
    (["launcher.job=slurm", "launcher.generator_hosts=1", "weight_sync.transport=rdma",
      "launcher.slurm.partition=h100"], {"SLURM_STANDIN_PARTITIONS": "debug"}, "invalid partition specified"),
    (["launcher.generator_hosts=1"], {}, "weight_sync.transport='shm'"),
    (["launcher.job=kubernetes", "weight_sync.transport=rdma"], {}, "launcher.kubernetes.image"),
])
def test_a_request_that_cannot_be_met_exits_2_before_anything_is_submitted(tmp_path, overrides, env, expect):
    state = tmp_path / "slurm"
    r = cli([*SHORT, *overrides, f"run.out_dir={tmp_path / 'run'}"], env=standin_env(state, **env), timeout=120)
    assert r.returncode == 2, (r.stdout + r.stderr)[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: config: ") and expect in lines[0], r.stderr
    assert not list(state.glob("*.sh")), "a job was submitted"


def test_torchrun_launcher_outside_torchrun_is_refused(tmp_path):
    r = cli(["--config", "configs/tiny.yaml", "run.launcher=torchrun", f"run.out_dir={tmp_path}"], timeout=120)
    assert r.returncode == 2 and "run.launcher='torchrun'" in r.stderr, r.stderr


K8S_NAME = re.compile(r"^[a-z][a-z0-9]{0,62}$")
QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")


def test_the_kubernetes_manifests_are_rendered_and_valid():
    r = subprocess.run([sys.executable, "-m", "pipeline.cluster.manifest", "--config", "configs/tiny.yaml",
                        "launcher.name=rl-job", "launcher.kubernetes.image=registry.example/rl:1",
                        "launcher.kubernetes.namespace=team-rl", "launcher.trainer_hosts=2", "trainer.num_ranks=4",
                        "launcher.generator_hosts=4", "generator.num_generators=8", "launcher.side_hosts=1",
                        "teacher.hf_dir=self", "launcher.devices_per_host=8", "launcher.kubernetes.cpu=64",
                        "launcher.kubernetes.memory=512Gi", "launcher.kubernetes.shm=32Gi", "weight_sync.transport=rdma"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    assert [d["metadata"]["name"] for d in docs] == ["rljobtrainer", "rljobgenerators", "rljobsides"]
    assert [d["spec"]["replicas"] for d in docs] == [2, 4, 1]
    for d in docs:
        assert d["apiVersion"] == "monarch.pytorch.org/v1alpha1" and d["kind"] == "MonarchMesh"
        assert K8S_NAME.match(d["metadata"]["name"]) and d["metadata"]["namespace"] == "team-rl"
        assert d["spec"]["port"] == 26600
        pod = d["spec"]["podTemplate"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == "registry.example/rl:1" and c["command"][:3] == ["python", "-u", "-c"]
        assert "run_worker_loop_forever" in c["command"][3]
        res = c["resources"]
        assert res["requests"] == res["limits"] == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}
        assert all(QUANTITY.match(v) for v in res["limits"].values())
        env = {e["name"]: e for e in c["env"]}
        assert env["MONARCH_PORT"]["value"] == "26600"
        ids = json.loads(env["MONARCH_SERVICE_PROC_IDS"]["value"])
        assert len(ids) == d["spec"]["replicas"] and len(set(ids)) == len(ids)
        assert {v["name"] for v in pod["volumes"]} == {m["name"] for m in c["volumeMounts"]} == {"dev-shm"}
        assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_a_slurm_time_and_an_empty_value_on_the_command_line_stay_text():
    from pipeline.config import ConfigError, load_config

    cfg = load_config("configs/tiny.yaml", ["launcher.slurm.time=12:00:00", "trainer.cpus=", "launcher.slurm.partition="])
    assert (cfg.launcher.slurm.time, cfg.trainer.cpus, cfg.launcher.slurm.partition) == ("12:00:00", "", "")
    with pytest.raises(ConfigError, match="launcher.slurm.time"):
        load_config("configs/tiny.yaml", ["launcher.slurm.time=soon"])


def test_a_joining_generator_goes_to_the_generator_host_with_the_fewest_in_the_pool_now():
    from types import SimpleNamespace

    from pipeline.cluster.roles import Roles

    mesh = SimpleNamespace(sizes={"hosts": 2}, slice=lambda hosts: SimpleNamespace(sizes={}))
    roles = Roles(trainer=mesh, generators=mesh, sides=mesh, generator_host=[0, 1, 0], apart=True, local=True)
    assert roles.add_generator() == 1  # host 1 holds one of the three placed so far
    # generators 0 and 2 (host 0) left the pool: host 0 is the emptier one now
    assert roles.add_generator(active=[1, 1]) == 0
    assert roles.generator_host == [0, 1, 0, 1, 0]
