"""Two-node torchrun, simulated on this machine: two launchers (--nnodes 2, node-rank 0 and 1) on
127.0.0.1. Real Monarch workers over TCP, a trainer rank on each node (FSDP2 over gloo across them),
one buffer, generators spread over both nodes, weights pushed over RDMA (TCP fallback). Plus the
bounded wait of the non-driving ranks against a real TCPStore."""

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

from .conftest import REPO
from .test_pipeline import _alive, _descendants

TINY = ["run.steps=2", "run.eval_every=0", "run.progress=false", "run.warm_start_steps=0", "buffer.batch_groups=2",
        "buffer.group_size=2", "generator.concurrency=4", "generator.max_new_tokens=6", "trainer.num_ranks=2",
        "weight_sync.transport=rdma", "run.log_level=info"]  # info: the tests read the driver's placement lines
TIMEOUT_S = 900


class TwoNodes:
    """Two torchrun launchers (node-rank 0 and 1) of one job on 127.0.0.1. Remembers every process
    either tree ever held (a Monarch worker outlives a killed rank, reparented) and kills them all."""

    def __init__(self, tmp_path: Path, args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = Path(sys.executable).with_name("torchrun")
        self.logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
        self.nodes: list[subprocess.Popen] = []
        for rank, log in enumerate(self.logs):
            with log.open("w") as f:
                self.nodes.append(subprocess.Popen(
                    [str(torchrun), "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                     "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "pipeline.run",
                     "--config", "configs/tiny.yaml", *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT))
        self.seen: list[set[int]] = [set(), set()]

    def poll(self) -> None:
        for r, n in enumerate(self.nodes):
            self.seen[r] |= _descendants(n.pid)

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes once both launchers exit (None for one still running at the timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(n.poll() is None for n in self.nodes):
            self.poll()
            time.sleep(1)
        return [n.poll() for n in self.nodes]

    def text(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def kill(self) -> None:
        self.poll()
        for p in [*self.seen[0], *self.seen[1], *(n.pid for n in self.nodes)]:
            if _alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
        for n in self.nodes:
            n.wait(timeout=30)


def test_two_node_torchrun_trains_with_a_trainer_rank_on_each_node(tmp_path):
    out = tmp_path / "run"
    job = TwoNodes(tmp_path, [*TINY, "generator.num_generators=2", "generator.placement=spread", f"run.out_dir={out}"])
    try:
        codes = job.wait(TIMEOUT_S)
        text = [job.text(0), job.text(1)]
        assert codes == [0, 0], f"exit codes {codes}\n--- node 0\n{text[0][-6000:]}\n--- node 1\n{text[1][-3000:]}"
    finally:
        job.kill()

    assert text[0].count("== done: 2 steps") == 1 and "== done" not in text[1]  # node 0's rank 0 drove
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "version/trainer" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["version/trainer"] for r in rows] == [1, 2]
    gen = [r["version/generator"] for r in rows]
    assert gen == sorted(gen) and gen[-1] >= 1, gen
    # One trainer rank per node: each rank's process lives under its own node's launcher.
    ranks = {int(m[1]): (int(m[2]), int(m[3])) for m in
             re.finditer(r"trainer rank (\d+)/2 on host (\d+) \(pid (\d+)\)", text[0])}
    assert sorted(ranks) == [0, 1], text[0][-4000:]
    for rank, (host, pid) in ranks.items():
        assert host == rank and pid in job.seen[host] and pid not in job.seen[1 - host], (rank, host, pid)
    assert "2 generator(s) on hosts [0, 1]" in text[0]


def test_trainer_ranks_not_divisible_by_nodes_is_a_config_error_on_every_node(tmp_path):
    job = TwoNodes(tmp_path, [*TINY, "trainer.num_ranks=3", f"run.out_dir={tmp_path / 'run'}"])
    try:
        codes = job.wait(300)
    finally:
        job.kill()
    for rank in (0, 1):
        assert "trainer.num_ranks=3" in job.text(rank), job.text(rank)[-3000:]
    assert all(c not in (0, None) for c in codes), codes


def test_shm_with_a_generator_on_another_node_fails_before_any_mesh_starts(tmp_path):
    job = TwoNodes(tmp_path, [*TINY, "weight_sync.transport=shm", "generator.num_generators=2",
                              "generator.placement=spread", f"run.out_dir={tmp_path / 'run'}"])
    try:
        codes = job.wait(600)
    finally:
        job.kill()
    text = job.text(0)
    assert codes == [1, 1], text[-3000:]
    assert "weight_sync.transport='shm'" in text and "use weight_sync.transport=rdma" in text, text[-3000:]
    assert "starting trainer mesh" not in text  # it failed before any mesh was spawned


def test_other_nodes_exit_when_rank_0_dies(tmp_path):
    """SIGKILL rank 0 (the driver) mid-run: node 1's rank notices (its store stops answering, or rank 0's
    heartbeat stalls) and exits non-zero instead of waiting forever for an exit code."""
    job = TwoNodes(tmp_path, [*TINY, "run.steps=1000", f"run.out_dir={tmp_path / 'run'}"])
    try:
        deadline = time.monotonic() + 600
        while "trainer rank 1/2" not in job.text(0):
            assert time.monotonic() < deadline and all(n.poll() is None for n in job.nodes), job.text(0)[-3000:]
            job.poll()
            time.sleep(1)
        job.poll()
        rank0 = [p for p in job.seen[0] if "pipeline.run" in _cmdline(p)]
        assert len(rank0) == 1, rank0  # the launcher's child; its Monarch worker and procs run other modules
        os.kill(rank0[0], signal.SIGKILL)
        t0 = time.monotonic()
        codes = job.wait(300)
        assert codes[1] not in (0, None) and time.monotonic() - t0 < 300, codes
        assert "rank 0's store stopped answering" in job.text(1) or "no heartbeat from rank 0" in job.text(1)
    finally:
        job.kill()


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_text(errors="replace")
    except OSError:
        return ""


def _stores():
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    return server, TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)


def test_waiting_rank_returns_rank_0s_exit_code():
    from pipeline.driver import torchrun

    server, client = _stores()
    server.set(torchrun.DONE_KEY, "0")
    assert torchrun._wait_for_rank0(client) == 0


def test_waiting_rank_gives_up_when_rank_0s_heartbeat_stalls(monkeypatch, caplog):
    """The store stays up (torchrun's agent hosts it) but rank 0 stopped beating: exit 1 after STALL_S."""
    from pipeline.driver import torchrun

    monkeypatch.setattr(torchrun, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(torchrun, "STALL_S", 1.0)
    server, client = _stores()
    t0 = time.monotonic()
    assert torchrun._wait_for_rank0(client) == 1
    assert time.monotonic() - t0 >= 1.0 and "no heartbeat from rank 0" in caplog.text  # not before STALL_S


def test_waiting_rank_gives_up_when_the_store_goes_away(monkeypatch, caplog):
    from pipeline.driver import torchrun

    monkeypatch.setattr(torchrun, "HEARTBEAT_S", 0.2)
    server, client = _stores()
    del server  # the store's host is gone
    assert torchrun._wait_for_rank0(client) == 1 and "store stopped answering" in caplog.text
