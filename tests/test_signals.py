"""Stopping a run leaves nothing behind: SIGTERM, SIGHUP and Ctrl-C run the controller's shutdown, a
second signal kills the whole tree, torchrun's SIGTERM reaches the driver, nothing listens beyond
loopback, and the sweep removes dead runs' shared-memory segments but never a live one's.

What is left is judged on the run's own processes (every pid its tree held while it ran, with its
start time, so a reused pid is not blamed) and on the segments those processes created or mapped.
"""

from __future__ import annotations

import ipaddress
import json
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline import cleanup
from pipeline.cleanup import SHM_DIR, creator_pid
from pipeline.procs import alive, cmdline, descendants

from .conftest import REPO

SHORT = ["run.steps=1000", "run.eval_every=0", "run.progress=false", "run.warm_start_steps=0",
         "buffer.batch_groups=2", "buffer.group_size=2", "generator.concurrency=4", "generator.max_new_tokens=6",
         # what these tests count and signal is the run's process tree: a false hang alarm (an engine starved
         # for 6 s by the suite's other worker on the same 2 cores) restarted one of two engines right before
         # the torchrun case counted them (1 of 2, a full `make test`). Liveness: test_liveness, test_generator.
         "generator.hang_timeout_s=60"]


class Watched:
    """A command in a session of its own, and everything its tree held while it ran."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.tree: set[tuple[int, int]] = set()
        self.segments: set[str] = set()

    def look(self) -> None:
        self.tree |= set(descendants(self.proc.pid))
        pids = self.pids()
        self.segments |= {n for n, users in cleanup.segment_users().items() if users & pids}
        self.segments |= {n for n in os.listdir(SHM_DIR) if creator_pid(n) in pids}

    def pids(self) -> set[int]:
        return {self.proc.pid} | {p for p, _ in self.tree}

    def wait_for_training(self, out: Path, timeout_s: float = 420, steps: int = 1) -> None:
        """Until `steps` optimizer steps are logged (mid-run), looking at the tree every second."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.look()
            mj = out / "metrics.jsonl"
            if mj.exists() and mj.read_text().count('"version/trainer"') >= steps:
                self.look()
                return
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}):\n{self.text()[-4000:]}"
            time.sleep(1)
        pytest.fail(f"no training step within {timeout_s:.0f}s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout_s:.0f}s after the signal:\n{self.text()[-4000:]}")

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 15  # the exit itself reaps; allow for a loaded machine
        while time.monotonic() < deadline and any(alive(p) for p in self.tree):
            time.sleep(0.2)
        left = [p for p in self.tree if alive(p)]
        assert not left, f"processes left behind: {[(p, cmdline(p[0])) for p in left]}"
        segs = sorted(n for n in self.segments if os.path.exists(os.path.join(SHM_DIR, n)))
        assert not segs, f"segments left behind: {segs}"

    def kill(self) -> None:
        """Test teardown: nothing of it survives a failed test either."""
        if self.proc.poll() is None:
            self.look()
            self.proc.kill()
        for p in self.tree:
            if alive(p):
                os.kill(p[0], signal.SIGKILL)
        self.proc.wait(30)
        cleanup.sweep_segments(min_age_s=0, names=self.segments)


def _listeners(pids: set[int]) -> list[tuple[str, str, int, int]]:
    """(proto, address, port, pid) of every listening TCP socket and bound UDP socket of `pids`."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            f = line.split()
            (addr_hex, port_hex), state, inode = f[1].split(":"), f[3], f[9]
            if inode not in owner or (proto.startswith("tcp") and state != "0A"):  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            # /proc/net prints each 32-bit word of the address in host (little-endian) order
            raw = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
            addr = socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)
            out.append((proto, addr, int(port_hex, 16), owner[inode]))
    return out


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


# ---------------------------------------------------------------------- the real job


def test_ctrl_c_to_the_process_group_runs_the_shutdown_and_leaves_no_process_segment_or_public_listener(tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group mid-run; the procs (each in a
    group of its own, the engine core in its proc's) must not die under the shutdown. The shutdown
    runs (engines, then every proc mesh), exit 130, and not one process or /dev/shm segment of the run
    is left. Mid-run, the run's own processes listen on loopback only (a default single-host run: shm
    weight sync, unix-socket Monarch). SIGTERM to the controller takes the same path (exit 143): the
    torchrun case below, and the stand-ins after it. The engine runs vLLM's worker as a process of its
    own (generator.cpu_executor=mp, vLLM's CPU default; every other run here has it in the engine core),
    so the shared-memory queues between core and worker (psm_*) are among what must not be left."""
    out = tmp_path / "run"
    run = Watched([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", *SHORT,
                   "generator.cpu_executor=mp", f"run.out_dir={out}"], tmp_path / "run.log")
    try:
        run.wait_for_training(out)
        socks = _listeners(run.pids())
        assert socks, "found no listening socket at all: the check would prove nothing"
        public = [s + (cmdline(s[3]),) for s in socks if not _loopback(s[1])]
        assert not public, f"listening beyond loopback: {public}"
        assert any("EngineCore" in cmdline(p) for p in run.pids()), "the engine core is part of the check"
        assert any("VLLM::Worker" in cmdline(p) for p in run.pids()), "generator.cpu_executor=mp: a worker process"
        assert any(n.startswith("psm_") for n in run.segments) and any(n.startswith("mrl-ws-") for n in run.segments)
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.wait(240) == 130, run.text()[-4000:]
        assert "SIGINT: shutting down" in run.text()
        assert "killing the run's processes" not in run.text()  # the graceful path, not the hard one
        run.assert_nothing_left()
    finally:
        run.kill()


def test_torchrun_job_with_two_generators_trains_and_its_launchers_sigterm_leaves_nothing(tmp_path):
    """`torchrun --standalone --nproc-per-node 2` (rank 0 drives one Monarch job, rank 1 joins) with
    two generators updated one at a time trains: versions advance, `version/generator` (the oldest
    any generator serves) follows, no sample is staler than allowed. Then torchrun forwards SIGTERM
    to each rank's process group; rank 0 shuts the job down within torchrun's 30 s grace and rank 1
    exits: no process of the run (Monarch worker, procs, engine cores) and no segment is left. (A
    torchrun job that runs to its end: tests/test_multinode.py.)"""
    out = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    run = Watched([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pipeline.run",
                   "--config", "configs/tiny.yaml", *SHORT, "generator.num_generators=2", "generator.rolling=true",
                   "buffer.max_staleness=1", f"run.out_dir={out}"], tmp_path / "run.log")
    try:
        run.wait_for_training(out, steps=3)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "version/trainer" in r]
        assert [r["version/trainer"] for r in rows] == list(range(1, len(rows) + 1))
        gen = [r["version/generator"] for r in rows]
        assert gen == sorted(gen) and gen[-1] >= len(rows) - 2, gen
        assert max(r["staleness/max"] for r in rows) <= 1
        cores = [p for p in run.pids() if "EngineCore" in cmdline(p)]
        assert len(cores) == 2, [cmdline(p) for p in run.pids()]  # one vLLM engine per generator
        socks = _listeners(run.pids() - {run.proc.pid})  # the ranks' trees; torchrun's own store aside
        public = [s + (cmdline(s[3]),) for s in socks if not _loopback(s[1])]
        assert not public, f"listening beyond loopback: {public}"
        run.proc.send_signal(signal.SIGTERM)
        run.wait(120)
        assert "SIGTERM: shutting down" in run.text()
        run.assert_nothing_left()
    finally:
        run.kill()


# ---------------------------------------------------------------------- the signal path, no engine


@pytest.mark.parametrize("how", ["second signal", "grace period"])
def test_a_hung_shutdown_ends_by_killing_the_tree_and_its_segments(tmp_path, how):
    """A second signal during a hung shutdown, or the grace period running out, kills the process
    tree (an orphan re-parented to the subreaper included) and unlinks its segments at once."""
    grace, sig = (600, signal.SIGTERM) if how == "second signal" else (2, signal.SIGHUP)
    proc = subprocess.Popen([sys.executable, "-m", "tests.signal_standins", str(grace)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
    info = {"segments": []}
    try:
        info = json.loads(_line(proc))
        tree = set(descendants(proc.pid))
        assert _line(proc) == "running"
        orphan = info["pids"][1]
        assert int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid, \
            "the orphan did not re-parent to the subreaper"
        assert all(os.path.exists(os.path.join(SHM_DIR, n)) for n in info["segments"])
        proc.send_signal(sig)
        assert _line(proc) == "shutdown"
        if how == "second signal":
            proc.send_signal(sig)
        code = proc.wait(60)
        assert code == 128 + sig, proc.stderr.read().decode()[-3000:]
        assert not [p for p in tree if alive(p)]
        assert not [n for n in info["segments"] if os.path.exists(os.path.join(SHM_DIR, n))]
    finally:
        for p in descendants(proc.pid):  # before the root: they would re-parent out of reach
            os.kill(p[0], signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        cleanup.sweep_segments(min_age_s=0, names=info["segments"])


def _line(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    """The next line of an unbuffered stdout, or fail after timeout_s."""
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        pytest.fail(f"no output within {timeout_s:.0f}s")
    return proc.stdout.readline().decode().strip()


# ---------------------------------------------------------------------- the sweep


def _segment(name: str) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096)
        return mmap.mmap(fd, 4096)
    finally:
        os.close(fd)


def test_sweep_keeps_a_live_named_semaphore():
    """A multiprocessing lock of a live process (vLLM's engine core passes one to its worker by name):
    glibc maps it under its temporary name, so only its inode tells that it is in use."""
    import multiprocessing

    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")
    assert os.getpid() in cleanup.segment_users().get(name, set())
    assert cleanup.sweep_segments(min_age_s=0, names=[name]) == []
    assert os.path.exists(os.path.join(SHM_DIR, name))
    del lock  # its finalizer unlinks it


def test_sweep_removes_a_dead_runs_segments_and_keeps_a_live_ones(tmp_path):
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid.wait()
    dead, live = dead_pid.pid, os.getpid()
    tag = uuid.uuid4().hex[:6]
    names = {
        "dead creator": f"mrl-ws-{tag}-r1-{dead}-{uuid.uuid4().hex[:8]}",
        "live creator": f"mrl-ws-{tag}-{live}-{uuid.uuid4().hex[:8]}",
        "dead creator, mapped by a live process": f"mrl-ws-{tag}-{dead}-{uuid.uuid4().hex[:8]}",
        "anonymous, unused": f"psm_{tag}a",
        "anonymous, mapped by a live process": f"psm_{tag}b",
        "anonymous, held open by a live process": f"psm_{tag}c",
        "anonymous, unused, too young": f"sem.mp-{tag}d",
    }
    assert creator_pid(names["dead creator"]) == dead and creator_pid(names["anonymous, unused"]) is None
    maps = {k: _segment(n) for k, n in names.items()}
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "print(fd, flush=True); time.sleep(600)",
                               os.path.join(SHM_DIR, names["anonymous, held open by a live process"])],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        for k in ("dead creator", "live creator", "anonymous, unused", "anonymous, held open by a live process",
                  "anonymous, unused, too young"):
            maps.pop(k).close()  # unmapped here; the held one stays open in `holder`
        removed = cleanup.sweep_segments(min_age_s=0, names=[n for k, n in names.items() if "young" not in k])
        removed += cleanup.sweep_segments(min_age_s=3600, names=[names["anonymous, unused, too young"]])
        assert sorted(removed) == sorted([names["dead creator"], names["anonymous, unused"]])
        left = {k for k, n in names.items() if os.path.exists(os.path.join(SHM_DIR, n))}
        assert left == set(names) - {"dead creator", "anonymous, unused"}
    finally:
        holder.kill()
        holder.wait()
        for m in maps.values():
            m.close()
        for n in names.values():
            if os.path.exists(os.path.join(SHM_DIR, n)):
                os.unlink(os.path.join(SHM_DIR, n))


# ---------------------------------------------------------------------- the shutdown's bound


def test_shutdown_steps_run_concurrently_within_one_deadline_and_never_raise(caplog):
    """shut_down's steps (pipeline/driver/shutdown.py, settle): concurrent, cut at one deadline, a failure
    logged rather than raised over the error that caused the shutdown; the caller's cancel still
    propagates."""
    import asyncio

    from pipeline.driver.shutdown import settle as _settle

    ended = []

    async def step(name: str, s: float, fail: bool = False) -> None:
        await asyncio.sleep(s)
        if fail:
            raise RuntimeError(f"{name} broke")
        ended.append(name)

    async def go() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ok = await _settle({"a": step("a", 0.5), "b": step("b", 0.5), "bad": step("bad", 0.1, fail=True),
                            "hung": step("hung", 3600)}, t0 + 1.5)
        return loop.time() - t0, ok

    took, ok = asyncio.run(go())
    assert took >= 1.45 and sorted(ended) == ["a", "b"]  # a and b together, hung cut at the deadline
    assert ok == {"a": True, "b": True, "bad": False, "hung": False}
    assert "bad failed: RuntimeError: bad broke" in caplog.text and "hung still running" in caplog.text

    async def cancelled() -> None:
        t = asyncio.ensure_future(_settle({"x": step("x", 3600)}, asyncio.get_running_loop().time() + 3600))
        await asyncio.sleep(0.1)
        t.cancel()
        await t

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())


def test_an_engine_core_dies_with_the_process_that_started_it():
    """vLLM's engine core does not watch its parent; with cleanup.exit_with_parent (called from the
    vLLM plugin) it dies when its parent is SIGKILLed, instead of running on as an orphan."""
    starter = ("import multiprocessing as mp, sys, time; from tests.signal_standins import engine_core\n"
               "p = mp.get_context('spawn').Process(target=engine_core, name='EngineCore'); p.start()\n"
               "print(p.pid, flush=True); time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", starter], cwd=REPO, stdout=subprocess.PIPE, bufsize=0)
    try:
        core = descendants(proc.pid)
        core_pid = int(_line(proc))
        assert _line(proc) == "engine core up"
        core = [p for p in descendants(proc.pid) if p[0] == core_pid]
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and alive(core[0]):
            time.sleep(0.1)
        assert not alive(core[0]), "the engine core outlived its parent"
    finally:
        for p in core:
            if alive(p):
                os.kill(p[0], signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
