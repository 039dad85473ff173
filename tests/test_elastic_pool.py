"""The elastic generator pool (pipeline/driver/pool.py, pipeline/control.py): generators join and
leave a running job, and nothing is lost or trained twice.

    .venv/bin/python -m pytest -q tests/test_elastic_pool.py -m "not slow"   # the command's input checks, seconds
    .venv/bin/python -m pytest -q tests/test_elastic_pool.py                 # + a CLI run 1 -> 2 -> 1 and a Session
                                                                             #   (~2-5 min each on 2 shared cores)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from .conftest import REPO


def control(out: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.control", str(out), *args, "--timeout", str(timeout)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout + 60)


@pytest.mark.parametrize("arg, needle", [("generators=0", "at least 1"), ("generators=two", "not an integer"),
                                         ("grow", "unknown command")])
def test_control_refuses_bad_input_with_exit_2_and_one_line(tmp_path, arg, needle):
    p = control(tmp_path, arg)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_control_without_a_running_run_exits_1_naming_it(tmp_path):
    p = control(tmp_path, "status")
    assert p.returncode == 1 and "no run is running" in p.stderr, p.stderr


def test_a_joining_generator_takes_a_free_share_of_the_pinned_cores_and_none_past_them():
    """Pinned generator.cpus: the joiner gets the share a removed generator freed, and never a core a
    member holds: with every core held the join is refused (ConfigError: the add fails, the run goes on)."""
    from pipeline.config import ConfigError, load_config
    from pipeline.driver.fleet import Fleet
    from pipeline.driver.pool import join_placement
    from pipeline.placement import generator_placements

    cfg = load_config(None, ["generator.num_generators=2", "generator.cpus=0-3"])
    fleet = Fleet(cfg)
    fleet.placements = generator_placements(cfg, [0, 0], 0)
    assert [p.cpus for p in fleet.placements] == [(0, 1), (2, 3)]
    fleet.generators[1].membership = "removed"
    p = join_placement(cfg, fleet, 2, 0)
    assert p.role == "generator2" and p.cpus == (2, 3)
    fleet.new_generator(0, p)
    fleet.generators[2].membership = "member"
    with pytest.raises(ConfigError, match="generator3 cannot join host 0: no share of generator.cpus='0-3'"):
        join_placement(cfg, fleet, 3, 0)  # every core is held: a share of 3 or more would overlap one
    fleet.generators[0].membership = "removed"
    assert join_placement(cfg, fleet, 3, 0).cpus == (0, 1)


def test_the_supervisor_restarts_members_only_and_an_added_generator_like_the_first(tmp_path):
    """A failure of a generator the pool is adding or removing is the pool's (no restart, no budget);
    an added generator, once a member, is restarted by the same algorithm (here with a stand-in for
    the wiring, which needs real meshes, as tests/test_faults.py does)."""
    import asyncio

    from pipeline.config import Config, GeneratorConfig, RunConfig
    from pipeline.driver.fleet import Fleet
    from pipeline.driver.supervisor import Supervisor
    from pipeline.placement import Placement

    cfg = Config(generator=GeneratorConfig(num_generators=2), run=RunConfig(out_dir=str(tmp_path)))
    fleet = Fleet(cfg)
    fleet.placements = [Placement("generator0"), Placement("generator1")]
    brought = []

    class Wiring:
        async def take_out(self, slot):
            return {"requeued_groups": 0}

        async def bring_back(self, slot):
            brought.append(slot.mesh_name)
            return {"version": 0}

    sup = Supervisor(cfg, fleet, Wiring())
    sup.watch = lambda slot: None  # no actor to hold a watch call on

    async def go():
        run = asyncio.create_task(sup.run())
        assert fleet.new_generator(0, Placement("generator2")) == 2
        fleet.generators[1].membership = "leaving"
        sup.report(1, "died while it left")
        sup.report(2, "died while it joined")
        await asyncio.sleep(0.2)
        fleet.generators[2].membership = "member"
        sup.report(2, "died once it served")
        await asyncio.sleep(0.2)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    asyncio.run(go())
    assert brought == ["generator2r1"]
    assert [e["generator"] for e in
            (json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines())] == [2]


def steps(out: Path) -> int:
    m = out / "metrics.jsonl"
    return sum(1 for line in m.read_text().splitlines() if '"step": ' in line) if m.exists() else 0


def wait_steps(p: subprocess.Popen, out: Path, n: int, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while steps(out) < n:
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_cli_run_grows_to_two_generators_and_back_losing_and_duplicating_nothing(tmp_path):
    """A tiny run goes 1 -> 2 -> 1 generators through pipeline.control while it trains (verify=every),
    then `pipeline.control stop` ends it: it ends 0 as at run.steps (summary, export), after the step in
    flight; each trained group is trained once, whole; the accounting identity holds and no group was
    dropped for the change; staleness stays within buffer.max_staleness; every push was verified; the
    joining generator was verified and its first tokens carry the version it was spawned with."""
    out, log_path = tmp_path / "run", tmp_path / "log.txt"
    G, B, eta = 8, 8, 1
    # far more steps than the test takes: the run is still training however long the joiner's engine
    # takes to start on 2 loaded cores, and the stop below ends it
    STEPS = 5000
    cmd = [sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", f"run.steps={STEPS}", "run.eval_every=0",
           "run.warm_start_steps=15", f"run.out_dir={out}", "run.progress=false", "weight_sync.verify=every",
           f"run.log_rollouts={G * B}", "run.checkpoint_every=0", f"buffer.max_staleness={eta}",
           "generator.hang_timeout_s=120"]  # an engine starting beside them starves the others on 2 shared cores
    log = open(log_path, "w")
    p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_steps(p, out, 1, log_path)
        grow = control(out, "generators=2")
        assert grow.returncode == 0, grow.stderr + log_path.read_text()[-3000:]
        assert json.loads(grow.stdout)["added"] == [1]
        status = json.loads(control(out, "status").stdout)["status"]
        assert status["members"] == 2 and status["generators"]["generator1"]["state"] == "member"
        wait_steps(p, out, steps(out) + 2, log_path)
        shrink = control(out, "generators=1")
        assert shrink.returncode == 0, shrink.stderr
        assert json.loads(shrink.stdout)["removed"] == [1]
        last = control(out, "generators=0")
        assert last.returncode == 2
        wait_steps(p, out, steps(out) + 1, log_path)  # a step on the one generator left
        stop = control(out, "stop")
        assert stop.returncode == 0 and json.loads(stop.stdout)["stopping"] is True, stop.stderr
        rc = p.wait(timeout=400)
    finally:
        if p.poll() is None:
            p.kill()
        log.close()
    text = log_path.read_text()
    assert rc == 0, text[-4000:]
    assert "stopped by pipeline.control at trainer version" in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    n = summary["steps"]
    assert summary["ended"] == "control" and 3 <= n < STEPS and summary["generators"] == [0]
    assert summary["pushes"]["started"] == summary["pushes"]["verified"] == n
    assert (out / "hf_checkpoint").is_dir()

    events = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["added", "removed"], events
    added, removed = events
    assert added["generator"] == removed["generator"] == 1 and added["verified"] is True
    assert added["first_token_version"] == added["version"] and removed["tokens"] > 0, events
    assert removed["mode"] == "keep" and removed["drained"] is True

    buf = summary["stats"]["buffer"]
    assert buf["admitted_samples"] == buf["trained_samples"] + buf["dropped_samples"] + buf["held_samples"]
    assert set(buf["dropped_groups"]) <= {"stale", "zero_signal"}, buf["dropped_groups"]  # none "failed"
    assert buf["requeued_groups"] == removed["requeued_groups"]

    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    by_group = defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r["step"])
    assert len(rows) == n * G * B
    assert all(len(s) == G and len(set(s)) == 1 for s in by_group.values())  # each group once, whole
    assert max(r["staleness"] for r in rows) <= eta
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    live = [m["generators/live"] for m in metrics]
    assert 2.0 in live and live[-1] == 1.0, live


@pytest.mark.slow
def test_session_adds_a_generator_and_removes_the_first_under_abort(tmp_path):
    """Session.add_generators / remove_generator: refused while the trainer's version is not pushed;
    then generator1 joins serving it (verified); generator0 leaves at once (on_update=abort), its groups
    requeued, and training goes on on generator1 alone; the last generator cannot be removed."""
    from pipeline.driver.pool import PoolError
    from pipeline.session import Session

    s = Session.start("configs/tiny.yaml", [f"run.out_dir={tmp_path}", "run.warm_start_steps=0",
                                            "generator.on_update=abort", "weight_sync.verify=every",
                                            "generator.hang_timeout_s=120"])
    try:
        s.train_step()
        with pytest.raises(PoolError, match="version 1 is not pushed yet"):
            s.add_generators(1)
        s.sync()
        assert s.add_generators(1) == [1]
        assert s.versions() == {"trainer": 1, "generator0": 1, "generator1": 1}
        out = s.remove_generator(0)
        assert out["generator"] == 0 and out["mode"] == "abort" and out["drained"] is None and out["members"] == 1
        s.train_step()
        s.sync()
        assert s.versions() == {"trainer": 2, "generator1": 2}
        assert s.pipe.sync.verified_pushes == 2  # and generator1 at its join
        with pytest.raises(PoolError, match="last generator"):
            s.remove_generator(1)
        buf = s.buffer_stats()
        assert buf["requeued_groups"] == out["requeued_groups"]
        assert buf["admitted_samples"] == buf["trained_samples"] + buf["dropped_samples"] + buf["held_samples"]
    finally:
        s.stop()
    events = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["generator"]) for e in events] == [("added", 1), ("removed", 0)]
    assert events[0]["verified"] is True and events[0]["version"] == 1
