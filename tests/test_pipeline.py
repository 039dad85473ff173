"""The whole job through every real component: Monarch meshes, vLLM engine, torchtitan trainer,
replay buffer, weight sync; launched from the CLI (the session: tests/test_notebook.py; torchrun:
tests/test_multinode.py and tests/test_signals.py)."""

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

from pipeline import procs

from .conftest import REPO

SMALL = ["run.steps=3", "run.eval_every=0", "run.progress=false", "run.warm_start_steps=15",  # a fixed count
         "buffer.batch_groups=2", "buffer.group_size=2",
         "generator.concurrency=4", "generator.max_new_tokens=6", "buffer.max_staleness=1"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_run_outputs(out: Path, steps: int, max_staleness: int) -> None:
    rows = [r for r in _metrics(out) if "version/trainer" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["version/trainer"] for r in rows] == list(range(1, steps + 1))
    # the generator's served version advances with the trainer's (a push overlaps the next step)
    gen = [r["version/generator"] for r in rows]
    assert gen == sorted(gen) and gen[-1] >= steps - 1, gen
    assert max(r["staleness/max"] for r in rows) <= max_staleness
    assert (out / "summary.png").stat().st_size > 0
    assert list((out / "tensorboard").glob("events.*"))
    assert (out / "hf_checkpoint" / "model.safetensors").is_file()


def test_sync_mode_run_trains_every_sample_it_generates(tmp_path):
    """The synchronous baseline through the CLI: B groups on version v, train, push, and only then
    admit for v+1, so every generator serves the trainer's version at each step and nothing is dropped.
    The trainer runs tensor-parallel (2 ranks, trainer.tensor_parallel=2): each rank pushes its own
    DTensor shards over the collective transport (a group per rank) and the generators assemble them,
    and since every sample is on-policy the sampler's probabilities of its tokens equal the trainer's
    (mismatch_max) after every sync. Every push is verified (weight_sync.verify=every): each rank
    checksums only its own packed shards, and the driver adds their shares into the reference the
    served tensors are checked against."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", *SMALL,
                        "run.mode=sync", "trainer.num_ranks=2", "trainer.tensor_parallel=2",
                        "weight_sync.transport=collective", "weight_sync.verify=every", "run.log_level=info",
                        f"run.out_dir={out}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "== done: 3 steps" in p.stdout
    pushes = json.loads((out / "summary.json").read_text())["pushes"]
    assert pushes["started"] == pushes["verified"] >= 3, pushes
    counts = re.findall(r"verified bit for bit on 1 generator\(s\): (\d+) tensors", p.stderr)
    assert "trainer rank 1/2" in p.stderr and len(counts) == pushes["verified"], counts
    assert len(set(counts)) == 1 and int(counts[0]) >= 10, counts
    _check_run_outputs(out, steps=3, max_staleness=0)
    rows = [r for r in _metrics(out) if "version/trainer" in r]
    assert [r["version/generator"] for r in rows] == [1, 2, 3]
    assert all(r["buffer/dropped_samples"] == 0 and r["buffer/wasted_tokens"] == 0 for r in rows), rows
    assert all(0 <= r["mismatch_max"] < 1e-4 for r in rows), [r["mismatch_max"] for r in rows]


def _descendants(pid: int) -> set[int]:
    return {p for p, _ in procs.descendants(pid)}


def _alive(pid: int) -> bool:
    return procs.parent(pid) is not None


def test_checkpoint_then_resume_continues_versions_and_prompt_position(tmp_path):
    """Run 1 checkpoints every 2 steps (keeping one) and is interrupted mid-run, which writes a last
    checkpoint. Run 2 (`run.resume=latest`, same out_dir) continues from the newest complete one:
    steps and versions go on, every step is in metrics.jsonl once (rows a dead run logged after its
    checkpoint are replaced), a half-written save is swept, the held complete groups are trained
    (nothing is dropped as "restored") and the eval curve goes on from step 0."""
    from pipeline.checkpoint import complete_checkpoints, latest, load_controller_state, read_marker

    out = tmp_path / "run"
    root = out / "checkpoints"
    base = [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", *SMALL, "run.warm_start_steps=0",
            "run.checkpoint_every=2", "run.keep_checkpoints=1", "run.eval_every=2", "task.eval_prompts=4",
            "run.log_level=info", f"run.out_dir={out}"]  # info: the resume's own line is checked below
    with open(tmp_path / "run1.log", "w") as log1:
        proc = subprocess.Popen([*base, "run.steps=1000"], cwd=REPO, stdout=log1, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 400
        mj = out / "metrics.jsonl"
        while not mj.exists() or mj.read_text().count('"version/trainer"') < 3:
            seen |= _descendants(proc.pid)
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "run 1 did not reach step 3 in 400s"
            time.sleep(0.5)
        seen |= _descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=240) in (130, 1, -signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in seen | _descendants(proc.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    text1 = (tmp_path / "run1.log").read_text()
    logged = max(r["step"] for r in _metrics(out) if "version/trainer" in r)
    ckpt = latest(root)
    k = read_marker(ckpt)["step"]
    assert complete_checkpoints(root) == [ckpt]  # run.keep_checkpoints=1
    # the last checkpoint caught up with the interrupt, unless it found a step cut short (and said so)
    assert k >= logged or "no last checkpoint: trainer at version" in text1, text1[-4000:]
    state = load_controller_state(ckpt)
    assert state["version"] == k and state["buffer"]["buffer"]["batches"] == k
    held = state["buffer"]["buffer"]
    (root / "step_999.tmp-1-1").mkdir()  # a save killed before its rename
    with open(out / "metrics.jsonl", "a") as f:  # a row logged after the checkpoint by a run that died
        f.write(json.dumps({"step": k + 1, "version/trainer": k + 1, "stale_row": True}) + "\n")

    p = subprocess.run([*base, f"run.steps={k + 2}", "run.resume=latest"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    n = len(held["complete"])
    assert f"resumed from {ckpt} at step {k} (version {k}): {n} complete groups to train" in p.stderr
    assert not (root / "step_999.tmp-1-1").exists()
    rows = _metrics(out)
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)) and not any(r.get("stale_row") for r in rows), steps
    train = [(r["step"], r["version/trainer"]) for r in rows if "version/trainer" in r]
    # run 1's rows up to the checkpoint (a step it trained after its last row has none), then run 2's
    want = [s for s in range(1, k + 3) if s <= min(logged, k) or s > k]
    assert train[-2:] == [(k + 1, k + 1), (k + 2, k + 2)] and [s for s, _ in train] == want, train
    assert rows[-1]["version/generator"] >= k  # generators were given the checkpoint's weights (not version 0)
    assert "(step 0) -> " in p.stdout and f"(step {k + 2})" in p.stdout, p.stdout  # the eval curve went on
    buf = json.loads((out / "summary.json").read_text())["stats"]["buffer"]
    assert "restored" not in buf["dropped_groups"]
    assert buf["trained_samples"] == (k + 2) * 2 * 2, buf  # SMALL: 2 groups of 2 per step
    assert buf["admitted_samples"] == buf["trained_samples"] + buf["dropped_samples"] + buf["held_samples"]


def test_resume_from_a_missing_checkpoint_is_a_config_error(tmp_path):
    for resume in (tmp_path / "nothing", "latest"):  # no such directory; no checkpoint under run.out_dir
        p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
                            f"run.out_dir={tmp_path}", f"run.resume={resume}"], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and "run.resume" in p.stderr, p.stderr[-2000:]
