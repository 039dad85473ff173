"""examples/session.ipynb runs top to bottom on a real Jupyter kernel of this interpreter: it shows
what its markdown says it shows, and its last cell (`s.stop()`) leaves no process or /dev/shm
segment of the session behind. A failing cell still stops the session (then the kernel, then
whatever survived both), so a failed test leaves nothing either.

What is left is judged as in tests/test_signals.py: on every pid the kernel's tree held between
cells (with its start time, so a reused pid is not blamed) and on the segments those made or mapped.
"""

from __future__ import annotations

import ast
import os
import signal
import sys
import time
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell

from pipeline import cleanup
from pipeline.cleanup import SHM_DIR, creator_pid
from pipeline.procs import alive, cmdline, descendants, start_time
from tests.test_placement import assert_pinned, pinned_overrides

from .conftest import REPO

NOTEBOOK = REPO / "examples" / "session.ipynb"
KERNEL = "monarch-rl-test"
CELL_TIMEOUT_S = 300  # the start cell starts a vLLM engine: 15-45 s alone, more on a loaded machine
GONE_WAIT_S = 15  # the last cell returns once the meshes are stopped; allow a loaded machine to reap


class KernelTree:
    """The kernel process, everything below it and every segment those made or mapped, as seen so far."""

    def __init__(self, pid: int):
        self.kernel = (pid, start_time(pid))
        self.tree: set[tuple[int, int]] = set()
        self.cmdlines: dict[tuple[int, int], str] = {}  # as first seen: what each process was
        self.segments: set[str] = set()

    def look(self) -> None:
        for p in descendants(self.kernel[0]):
            self.tree.add(p)
            self.cmdlines.setdefault(p, cmdline(p[0]))
        pids = {self.kernel[0]} | {p for p, _ in self.tree}
        self.segments |= {n for n, users in cleanup.segment_users().items() if users & pids}
        self.segments |= {n for n in os.listdir(SHM_DIR) if creator_pid(n) in pids}

    def assert_gone(self, procs: set[tuple[int, int]]) -> None:
        deadline = time.monotonic() + GONE_WAIT_S
        while time.monotonic() < deadline and any(alive(p) for p in procs):
            time.sleep(0.2)
        left = [(p, cmdline(p)) for p, t in procs if alive((p, t))]
        assert not left, f"processes left behind: {left}"
        segs = sorted(n for n in self.segments if os.path.exists(os.path.join(SHM_DIR, n)))
        assert not segs, f"segments left behind: {segs}"

    def kill(self) -> None:
        """Test teardown: nothing of it survives a failed test either."""
        for p in [self.kernel, *self.tree]:
            if alive(p):
                os.kill(p[0], signal.SIGKILL)
        cleanup.sweep_segments(min_age_s=0, names=self.segments)


def _notebook(out_dir: Path, overrides: list[str]) -> nbformat.NotebookNode:
    """The notebook with its parameters set the way papermill sets them (a cell after theirs), and a
    cell before its last (`s.stop()`) that shows where the session's procs run and what calling an
    endpoint an actor lacks says."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = new_code_cell(f"out_dir = {str(out_dir)!r}\noverrides = {overrides!r}",
                             metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(at + 1, injected)
    stop = next(i for i, c in enumerate(nb.cells) if c.get("id") == "stop")
    placement = new_code_cell("try:\n    s.call('buffer', 'no_such_endpoint')\n    missing = None\n"
                              "except ValueError as e:\n    missing = str(e)\n"
                              "{'placement': s.pipe.placement, 'missing': missing}")
    placement["id"] = "placement"
    nb.cells.insert(stop, placement)
    return nb


def _result(nb: nbformat.NotebookNode, cell_id: str):
    """The value a cell displayed last (its execute_result), read back from its text."""
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    results = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert results, f"cell {cell_id!r} displayed nothing: {cell.outputs}"
    return ast.literal_eval(results[-1].data["text/plain"])


def _printed(nb: nbformat.NotebookNode, cell_id: str, prefix: str) -> list:
    cell = next(c for c in nb.cells if c.get("id") == cell_id)
    text = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one for the trainer, one for the rest")
def test_session_notebook_steps_inspects_and_stops_on_a_real_kernel(tmp_path, monkeypatch):
    """Its procs pinned (trainer.cpus=a, generator.cpus=buffer.cpus=b, as the notebook's `overrides`):
    while the session runs, every proc and the generator's vLLM engine processes run on their cores
    (tests/test_placement.py's assert_pinned, read from /proc)."""
    # A kernelspec of this interpreter (not whatever "python3" resolves to), found through JUPYTER_PATH.
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / KERNEL)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    nb = _notebook(tmp_path / "session", pinned_overrides())
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL, resources={"metadata": {"path": str(REPO)}})
    tree = None
    try:
        with client.setup_kernel(env=env):
            assert client.km.kernel_spec.argv[0] == sys.executable
            tree = KernelTree(client.km.provisioner.pid)
            try:
                for i, cell in enumerate(nb.cells):
                    if cell.cell_type == "code":
                        client.execute_cell(cell, i)
                        tree.look()
                        if cell.get("id") == "placement":  # while the procs live
                            shown = _result(nb, "placement")
                            assert_pinned(shown["placement"])
                            assert "no endpoint" in (shown["missing"] or ""), shown["missing"]
                assert tree.tree, "the session started no process: the check below would prove nothing"
                assert any("EngineCore" in c for c in tree.cmdlines.values()), "the engine core is part of the check"
                assert any(n.startswith(cleanup.WS_PREFIX) for n in tree.segments), "weight-sync segments too"
                tree.assert_gone(tree.tree)  # by s.stop() alone, with the kernel still up
            except BaseException:
                stop = new_code_cell("if 's' in globals():\n    s.stop()")
                nb.cells.append(stop)
                client.execute_cell(stop, len(nb.cells) - 1)
                raise
        tree.assert_gone({tree.kernel})
    finally:
        nbformat.write(nb, tmp_path / "session.ipynb")  # as executed, to read when an assertion fails
        if tree is not None:
            tree.kill()

    assert _result(nb, "start") == {"trainer": 0, "generator0": 0}
    steps = _printed(nb, "steps", "{'version/trainer'")
    assert [m["version/trainer"] for m in steps] == [1, 2], steps
    assert _result(nb, "steps") == {"trainer": 2, "generator0": 0}  # the generator waits for a push
    assert _result(nb, "sync") == {"trainer": 2, "generator0": 2}
    b = _result(nb, "buffer")
    assert b["trained_samples"] == 2 * 2 * 4, b  # two batches of 2 groups of 4 (the notebook's overrides)
    assert b["admitted_samples"] == b["trained_samples"] + b["dropped_samples"] + b["held_samples"], b
    assert sum(b["dropped_samples_by_reason"].values()) == b["dropped_samples"], b
    assert sum(b["staleness_hist"].values()) == b["trained_samples"] and max(b["staleness_hist"]) <= 1, b
    g = _result(nb, "generator")
    assert g["version"] == 2 and g["updates"] >= 1 and g["tokens"] > 0, g
    e = _result(nb, "evaluate")
    assert 0.0 <= e["eval/reward"] <= 1.0 and 0.0 <= e["eval/reward_greedy"] <= 1.0, e
