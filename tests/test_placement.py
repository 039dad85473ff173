"""Placement (pipeline/placement.py): the pure rules on simulated hosts, the start-time check through
the CLI, and the check of a real job's pinned procs, whose cores are read back from /proc (run in
tests/test_notebook.py's session, on real Monarch procs and a vLLM engine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import procs
from pipeline.config import ConfigError, load_config
from pipeline.config.ids import format_ids, parse_ids
from pipeline.placement import (PlacementError, check_host, generator_placements, resolve_gpus, split_even,
                                trainer_placement)

from .conftest import REPO

GPU = ["trainer.device=cuda", "trainer.backend=nccl", "generator.engine=vllm"]


def test_parse_ids_reads_cpuset_syntax_and_refuses_bad_sets():
    assert parse_ids("") == () and parse_ids("3") == (3,) and parse_ids("0-3") == (0, 1, 2, 3)
    assert parse_ids(" 6 , 0,2-3") == (6, 0, 2, 3)  # the order written: trainer.devices[i] is local rank i's
    assert format_ids(parse_ids("0,2,4-7,1")) == "0-2,4-7"
    for bad, why in [("a", "not a core id"), ("1,", "not a core id"), ("-1", "not a core id"), ("3-1", "empty"),
                     ("1,0-2", "listed twice"), ("0-70000", "past 65535")]:
        with pytest.raises(ValueError, match=why):
            parse_ids(bad)


def test_split_even_gives_contiguous_shares_differing_by_at_most_one():
    for size in range(1, 10):
        ids = tuple(range(10, 10 + size))
        for n in range(1, size + 1):
            shares = [split_even(ids, n, k) for k in range(n)]
            assert sum(shares, ()) == ids and max(map(len, shares)) - min(map(len, shares)) <= 1
            assert all(shares)


def test_trainer_ranks_split_their_hosts_cores_and_threads_follow():
    cfg = load_config(None, ["trainer.num_ranks=4", "trainer.cpus=0-4"])
    ranks = [trainer_placement(cfg, r, per_host=2, host_cores=64) for r in range(4)]  # 2 hosts of 2 ranks
    assert [p.cpus for p in ranks] == [(0, 1, 2), (3, 4), (0, 1, 2), (3, 4)]
    assert [p.threads for p in ranks] == [3, 2, 3, 2] and all(p.omp_env and not p.gpus for p in ranks)
    assert trainer_placement(load_config(None, ["trainer.cpus=0-4", "trainer.cpu_threads=1"]), 0, 1, 64).threads == 1
    unpinned = trainer_placement(load_config(None, ["trainer.num_ranks=2"]), 1, 2, host_cores=9)
    assert unpinned.cpus == () and unpinned.threads == 4  # the host's cores // its ranks, as before placement
    with pytest.raises(ConfigError, match=r"trainer\.cpus='0-2' is invalid; allowed: a set of at least 4 cores"):
        trainer_placement(load_config(None, ["trainer.num_ranks=4", "trainer.cpus=0-2"]), 0, 4, 64)


def test_generators_split_their_hosts_cores_and_bind_vllm_worker_threads():
    cfg = load_config(None, ["generator.num_generators=3", "generator.cpus=0-7", "generator.tensor_parallel_size=2",
                             "trainer.cpus=8", "buffer.cpus=9"])
    g0, g1, g2 = generator_placements(cfg, [0, 1, 0], trainer_per_host=1)  # two on host 0, one on host 1
    assert (g0.cpus, g2.cpus, g1.cpus) == ((0, 1, 2, 3), (4, 5, 6, 7), tuple(range(8)))
    assert (g0.vllm_cpu_bind, g2.vllm_cpu_bind, g1.vllm_cpu_bind) == ("0-1|2-3", "4-5|6-7", "0-3|4-7")
    assert (g0.threads, g1.threads) == (4, 8) and not g0.omp_env  # the engine core would inherit OMP_NUM_THREADS
    assert generator_placements(load_config(None), [0], 1)[0].vllm_cpu_bind == ""  # unpinned: vLLM's own 'auto'
    with pytest.raises(ConfigError, match=r"generator\.cpus='0-2' is invalid; allowed: a set of at least 4 cores: "
                                          r"2 generator\(s\) on host 0 x generator\.tensor_parallel_size=2"):
        generator_placements(load_config(None, ["generator.cpus=0-2", "generator.tensor_parallel_size=2"]), [0, 0], 1)


def test_a_forked_engine_core_reads_its_cores_from_each_openmp_binding_vllm_writes():
    """The forked engine core binds itself (pipeline/generator/llm.py), since its OpenMP was loaded before
    vLLM's executor wrote the binding: GNU OpenMP's list and ranges, OMP_PLACES, Intel's proclist."""
    from pipeline.generator.llm import omp_cpus

    assert omp_cpus({"GOMP_CPU_AFFINITY": "0 1 4-6"}) == {0, 1, 4, 5, 6}
    assert omp_cpus({"OMP_PLACES": "{2,3}", "OMP_PROC_BIND": "true"}) == {2, 3}
    assert omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,5]"}) == {0, 5}
    assert omp_cpus({"OMP_NUM_THREADS": "4"}) == set()  # no binding: the core keeps its parent's cores


def test_default_gpu_assignment_gives_each_rank_and_generator_its_own_gpu():
    cfg = load_config(None, [*GPU, "trainer.num_ranks=4", "generator.num_generators=2",
                             "generator.tensor_parallel_size=2"])
    trainer = [trainer_placement(cfg, r, 4, 64) for r in range(4)]
    gens = generator_placements(cfg, [0, 0], trainer_per_host=4)
    assert [resolve_gpus(p, 8) for p in trainer + gens] == [(0,), (1,), (2,), (3,), (4, 5), (6, 7)]
    # a host with fewer GPUs: the default wraps around (shares), as a 1-GPU trainer + generator box needs
    assert [resolve_gpus(p, 2) for p in trainer + gens] == [(0,), (1,), (0,), (1,), (0, 1), (0, 1)]
    with pytest.raises(PlacementError, match=r"generator0: needs 2 GPUs .* has 1 visible"):
        resolve_gpus(gens[0], 1)
    with pytest.raises(PlacementError, match="no GPU visible"):
        resolve_gpus(trainer[0], 0)
    cpu_trainer = load_config(None, ["generator.engine=vllm", "generator.num_generators=2"])  # generators alone on GPUs
    assert [p.gpus for p in generator_placements(cpu_trainer, [0, 0], 1)] == [(0,), (1,)]


def test_explicit_gpu_ids_are_taken_in_order_and_checked_against_the_host():
    cfg = load_config(None, [*GPU, "trainer.num_ranks=2", "trainer.devices=6,7", "generator.num_generators=2",
                             "generator.devices=0-3", "generator.tensor_parallel_size=2"])
    assert [trainer_placement(cfg, r, 2, 64).gpus for r in range(2)] == [(6,), (7,)]
    assert [p.gpus for p in generator_placements(cfg, [0, 0], 2)] == [(0, 1), (2, 3)]
    with pytest.raises(PlacementError, match=r"trainer rank 1: trainer\.devices names GPU 7, but this host has 4"):
        resolve_gpus(trainer_placement(cfg, 1, 2, 64), 4)
    with pytest.raises(ConfigError, match=r"trainer\.devices='6,7' is invalid; allowed: one GPU per trainer rank"):
        trainer_placement(cfg, 0, 4, 64)


@pytest.mark.parametrize("overrides, must_name", [
    (["trainer.cpus=0-99999"], "trainer.cpus"),  # past MAX_ID
    (["generator.cpus=x"], "generator.cpus"),
    (["buffer.cpus=0,0"], "buffer.cpus"),
    (["trainer.cpus=0", "buffer.cpus=0"], "buffer.cpus"),  # overlap without run.allow_shared_cpus
    (["generator.devices=0"], "generator.devices"),  # vllm-cpu takes no GPU ids
    (["trainer.devices=0"], "trainer.devices"),  # neither does a CPU trainer
    ([*GPU, "trainer.devices=0"], "generator.devices"),  # both on GPUs: both explicit or neither
    ([*GPU, "trainer.devices=0,1", "generator.devices=1"], "generator.devices"),  # shared without allow_shared_devices
])
def test_bad_placement_names_the_key(overrides, must_name):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert f"config: {must_name}=" in str(e.value)


def test_cores_this_host_lacks_are_refused_and_sharing_is_allowed_when_asked():
    with pytest.raises(ConfigError, match=r"trainer\.cpus='0-4095' is invalid; allowed: cores of this host"):
        check_host(load_config(None, ["trainer.cpus=0-4095"]))
    core = min(os.sched_getaffinity(0))
    cfg = load_config(None, [f"trainer.cpus={core}", f"buffer.cpus={core}", "run.allow_shared_cpus=true"])
    check_host(cfg)
    assert cfg.trainer.cpus == cfg.buffer.cpus == str(core)
    cfg = load_config(None, [*GPU, "trainer.devices=0", "generator.devices=0", "run.allow_shared_devices=true"])
    assert cfg.generator.devices == "0"


def test_too_few_cores_for_a_hosts_generators_exits_2_naming_the_key(tmp_path):
    """Set sizes are checked at start, once the host count is known, before any proc is spawned."""
    core = min(os.sched_getaffinity(0))
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml", f"run.out_dir={tmp_path}",
                        "generator.num_generators=2", f"generator.cpus={core}"],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-4000:]
    assert f"generator.cpus='{core}' is invalid; allowed: a set of at least 2 cores" in p.stderr, p.stderr[-4000:]


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid` (sched_setaffinity is per thread)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.add(line.split(":", 1)[1].strip())
    return out


def pinned_overrides() -> list[str]:
    """trainer.cpus=a, generator.cpus=b, buffer.cpus=b on a host's last and first core (two at least)."""
    a, b = max(os.sched_getaffinity(0)), min(os.sched_getaffinity(0))
    return [f"trainer.cpus={a}", f"generator.cpus={b}", f"buffer.cpus={b}", "run.allow_shared_cpus=true"]


def assert_pinned(placed: dict) -> None:
    """A job started with pinned_overrides() (tests/test_notebook.py's session): every thread of every proc
    runs on its set, torch runs one thread per core, and the generator's engine core (its child, with
    vLLM's worker inside) inherits core b, its OpenMP threads bound to b as vLLM binds a worker's."""
    a, b = max(os.sched_getaffinity(0)), min(os.sched_getaffinity(0))
    assert sorted(placed) == ["buffer", "generator0", "trainer rank 0"], placed
    want = {"trainer rank 0": str(a), "buffer": str(b), "generator0": str(b)}
    for role, info in placed.items():
        assert info["pinned"] and info["cpus"] == want[role] and info["threads"] == 1, info
        assert _allowed(info["pid"]) == {want[role]}, (role, _allowed(info["pid"]))
    assert placed["generator0"]["vllm_cpu_bind"] == str(b)
    engine = procs.descendants(placed["generator0"]["pid"])
    titles = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").strip()
              for pid, _ in engine}
    assert any("EngineCore" in t for t in titles.values()), titles
    # the model runs in the engine core (generator.cpu_executor=auto: vLLM's worker in the core), bound to b
    # with one OpenMP thread, as vLLM binds a worker process of its own (it reports them itself: the core is
    # forked, so /proc/PID/environ shows the generator proc's start, not the binding it took)
    assert not any("Worker" in t for t in titles.values()), titles
    assert placed["generator0"]["engine_core"] == {"cpus": str(b), "torch_threads": 1}, placed["generator0"]
    for pid, _ in engine:
        assert _allowed(pid) == {str(b)}, (titles[pid], _allowed(pid))
