"""Shared fixtures: the tiny checkpoint is built once per machine under .cache/tiny-model."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def actor_spawner(actor_cls, overrides: list[str], loop, name: str):
    """A fixture body: yields spawn(incarnation) -> (actor, its setup's answer), each on a proc of its
    own (`overrides` make its config); every proc it made is stopped at the end."""
    from monarch.actor import this_host

    from pipeline.config import load_config

    made = []

    async def spawn(incarnation: int = 0):
        cfg = load_config(None, overrides)
        procs = this_host().spawn_procs(per_host={"procs": 1})
        made.append(procs)
        actor = procs.spawn(f"{name}{len(made)}", actor_cls, cfg, incarnation)
        return actor, await asyncio.wait_for(actor.setup.call_one(), 120)

    yield spawn
    for p in made:
        try:
            loop.run_until_complete(asyncio.wait_for(p.stop(), 30))
        except Exception:  # noqa: BLE001 - a proc the test killed
            pass


def run_and_kill(cmd: list[str], out, log_path, role: str, after_steps: int, timeout_s: float = 400) -> tuple[int, int]:
    """Run the CLI `cmd` (its run.out_dir is `out`, its output goes to `log_path`), SIGKILL the proc of
    `role` (its pid in out/placement.json) once `after_steps` steps are in metrics.jsonl, and wait for
    the run's end. Returns (exit code, the killed pid); the run is killed if the test fails first."""
    import json
    import signal
    import subprocess
    import time

    log = open(log_path, "w")
    p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s

        def steps() -> int:
            m = Path(out) / "metrics.jsonl"
            return sum(1 for line in m.read_text().splitlines() if '"step": ' in line) if m.exists() else 0

        while steps() < after_steps:
            assert p.poll() is None and time.monotonic() < deadline, Path(log_path).read_text()[-3000:]
            time.sleep(0.5)
        victim = json.loads((Path(out) / "placement.json").read_text())[role]["pid"]
        os.kill(victim, signal.SIGKILL)
        return p.wait(timeout=600), victim
    finally:
        if p.poll() is None:
            p.kill()
        log.close()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from pipeline.models.tiny import ensure_tiny

    return ensure_tiny(cache_dir=REPO / ".cache" / "tiny-model")  # builtin:tiny


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module, for modules that drive Monarch meshes from sync tests."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()



# A hung test must fail the run with its name and stack, not run CI into its time limit. No single
# test here takes more than a few minutes; RL_TEST_LIMIT_S raises the bound on a slow machine.
TEST_LIMIT_S = float(os.environ.get("RL_TEST_LIMIT_S", "600"))


def _dump_tasks(out) -> None:
    """The await chain of every pending asyncio task of every event loop in the process: a hang in a
    test that drives a loop shows only `run_until_complete` in the thread stacks above."""
    import asyncio
    import gc

    try:
        loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and not o.is_closed()]
        for lp in loops:
            tasks = [t for t in asyncio.all_tasks(lp) if not t.done()]
            out.write(f"[watchdog] event loop {id(lp):#x}: {len(tasks)} pending tasks\n")
            for t in tasks:
                out.write(f"--- {t.get_name()}\n")
                aw = t.get_coro()
                for _ in range(40):  # the coroutine chain, outermost first (a task's own stack is one frame)
                    frame = getattr(aw, "cr_frame", None) or getattr(aw, "gi_frame", None)
                    if frame is None:
                        if aw is not None:
                            out.write(f"    awaiting {aw!r}\n"[:300])
                        break
                    out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
                    aw = getattr(aw, "cr_await", None) or getattr(aw, "gi_yieldfrom", None)
    except Exception as e:  # diagnostics only: never mask the hang report
        out.write(f"[watchdog] could not list asyncio tasks: {e!r}\n")


def _hung(item) -> None:
    import faulthandler
    import sys

    import psutil

    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # the test's output is being captured: write to the real terminal
        capture.suspend_global_capture(in_=False)
    nodeid = item.nodeid
    sys.__stderr__.write(f"\n[watchdog] {nodeid} still running after {TEST_LIMIT_S:.0f}s; its stacks:\n")
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    _dump_tasks(sys.__stderr__)
    for child in psutil.Process().children(recursive=True):  # Monarch procs, vLLM engine cores
        child.kill()
    sys.__stderr__.flush()
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler
    import sys
    import threading

    timer = threading.Timer(TEST_LIMIT_S, _hung, args=(item,))
    timer.daemon = True
    timer.start()
    # backstop for a hang that holds the GIL: faulthandler's own thread needs none
    faulthandler.dump_traceback_later(TEST_LIMIT_S + 60, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


# ---------------------------------------------------------------- nothing left behind
# Every process a test starts inherits this marker, so the suite's own leftovers can be told from
# those of a job running beside it (CI shares its machine).
SESSION_MARK = "RL_TEST_SESSION"
os.environ[SESSION_MARK] = str(os.getpid())
SETTLE_S = 20.0  # a killed process's exit and reaping; a proc mesh's stop is already awaited by its fixture


def _ours(proc) -> bool:
    try:
        return proc.environ().get(SESSION_MARK) == str(os.getpid())
    except Exception:  # gone, or a zombie: nothing to leave behind
        return False


def _leftover_processes() -> list:
    import psutil

    me = psutil.Process()
    found = {p.pid: p for p in me.children(recursive=True)}
    found.update({p.pid: p for p in psutil.process_iter() if p.pid != me.pid and p.pid not in found and _ours(p)})
    # multiprocessing's resource tracker is the interpreter's own: it ends with this process
    return [p for p in found.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())]


def _leftover_segments(before: set[str]) -> list[str]:
    from pipeline import cleanup

    new = [n for n in os.listdir(cleanup.SHM_DIR) if n not in before
           and n.startswith((cleanup.WS_PREFIX, *cleanup.ANONYMOUS))]
    used = cleanup.segment_users()
    return sorted(n for n in new if used.get(n, set()) <= {os.getpid()})  # nobody, or only this process, holds it


def _live_engines() -> list[str]:
    """For each vLLM AsyncLLM still reachable: what holds it (a test module's global, a fixture's
    cache, a frame)."""
    import gc
    import sys

    engines = [o for o in gc.get_objects() if type(o).__name__ == "AsyncLLM"]
    here = sys._getframe()
    out = []
    for e in engines:
        holders = []
        for r in gc.get_referrers(e):
            if r is engines or r is here:
                continue
            if isinstance(r, dict):  # a module's or an object's namespace: name its owner
                owners = [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
                holders.append(f"dict of {[getattr(o, '__name__', type(o).__name__) for o in owners] or '?'} "
                               f"keys {[k for k, v in r.items() if v is e][:3]}")
            elif type(r).__name__ == "frame":
                up = sorted({type(x).__name__ for x in gc.get_referrers(r) if x is not here})
                holders.append(f"frame {r.f_code.co_name} at {r.f_code.co_filename}:{r.f_lineno} (held by {up})")
            elif type(r).__name__ == "cell":
                fns = [getattr(f, "__qualname__", type(f).__name__) for t in gc.get_referrers(r)
                       for f in (gc.get_referrers(t) if isinstance(t, tuple) else [t])]
                holders.append(f"cell of {fns[:4]}")
            else:
                holders.append(type(r).__name__)
        out.append("; ".join(holders))
    return out


@pytest.fixture(scope="session", autouse=True)
def leaves_nothing_behind():
    """After the last test: no process started by the suite still running, and no shared-memory
    segment of the suite's left in /dev/shm. A leftover fails the run, naming it, and is removed.
    Engines are checked once pytest has dropped the last test's fixtures (pytest_sessionfinish)."""
    import time

    from pipeline import cleanup

    before = set(os.listdir(cleanup.SHM_DIR))
    yield
    problems = []
    deadline = time.monotonic() + SETTLE_S
    while (procs := _leftover_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in procs:
        try:
            problems.append(f"process {p.pid} still running: {' '.join(p.cmdline())[:160]}")
            p.kill()
        except Exception:
            pass
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(5)
    segments = _leftover_segments(before)
    if segments:  # one that another pytest worker's engine stop is unlinking right now goes meanwhile
        time.sleep(2.0)
        segments = [n for n in _leftover_segments(before) if n in segments]
    for name in segments:
        problems.append(f"/dev/shm/{name} left behind")
        try:
            os.unlink(os.path.join(cleanup.SHM_DIR, name))
        except OSError:
            pass
    assert not problems, "the suite left things behind:\n  " + "\n  ".join(problems)


def _report_mesh_failure(failure) -> None:
    import sys

    report = failure.report()
    sys.__stderr__.write(f"[monarch] a mesh failed with nobody handling it (a test using it fails on its next "
                         f"call): {report}\n")
    if "RootClientActor" in report.split("\n", 1)[0]:  # this process's own Monarch client: every later call fails
        import psutil

        sys.__stderr__.write("[monarch] this process's Monarch client failed: the worker exits, and xdist gives "
                             "the files left to a fresh one\n")
        sys.__stderr__.flush()
        for child in psutil.Process().children(recursive=True):  # its procs, vLLM engine cores
            child.kill()
        os._exit(75)


@pytest.fixture(autouse=True)
def mesh_failures_are_reported_not_fatal():
    """Monarch hands a dead mesh that nobody handles to `unhandled_fault_hook`, whose default ends the
    process with a KeyboardInterrupt: under xdist that ends the whole run, every later file unrun. In
    the suite such a failure is printed and the test that uses the mesh fails on its next call; a
    run's own hook (a session test's supervisor) is replaced again after its test."""
    import monarch.actor

    monarch.actor.unhandled_fault_hook = _report_mesh_failure
    yield
    monarch.actor.unhandled_fault_hook = _report_mesh_failure


@pytest.fixture(scope="module", autouse=True)
def closes_its_zmq_sockets():
    """After each module: no ZMQ socket of the module's left open in a context nobody will close (an
    engine client's). Such a context blocks whatever later triggers its garbage collection forever, in
    zmq_ctx_term; the module fails, naming the sockets, and they are closed here."""
    yield
    import gc
    import sys

    zmq = sys.modules.get("zmq")
    if zmq is None:
        return
    # no gc.collect() first: collecting such a context is the hang; gc.get_objects() sees garbage too
    shared = getattr(zmq.Context, "_instance", None)  # the process-wide instance lives to exit
    found = []
    # by type, not isinstance: isinstance reads __class__, which a dead weakref.proxy among the objects
    # answers with ReferenceError, and a deprecated module attribute (torch's) with a warning
    contexts = [o for o in gc.get_objects() if issubclass(type(o), zmq.Context)]
    for ctx in contexts:
        if ctx is shared or ctx.closed:
            continue
        for sock in list(ctx._sockets):
            if not sock.closed:
                found.append(f"{sock!r} of {ctx!r}")
                sock.close(linger=0)
    assert not found, "ZMQ sockets left open (an engine client not closed):\n  " + "\n  ".join(found)


def pytest_collection_finish(session):
    """vLLM is imported here, once, when a collected test uses it. A module of vLLM's keeps an
    exception from its own import, whose traceback holds every frame that was on the stack: when a
    fixture or test that starts an engine did the first import, its frame (and the engine in its
    locals) would live until interpreter exit, and the engine's __del__ then fails."""
    files = {item.path for item in session.items}
    if any("vllm" in f.read_text() for f in files if f.suffix == ".py"):
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.v1.engine.async_llm  # noqa: F401


SESSION_END_LIMIT_S = 300  # the engine check below, bounded as a test is (a hang there is no test's)


def pytest_sessionfinish(session, exitstatus):
    """No vLLM engine left for the garbage collector: one alive at interpreter exit fails in its
    __del__ (its modules are gone) and leaves its output task pending. Cycles are collected here,
    while the modules exist; an engine still referenced fails the run, naming what holds it. Under
    pytest-xdist each worker checks its own and hands the lines to the controller, which fails."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(SESSION_END_LIMIT_S, exit=True, file=sys.__stderr__)
    try:
        _check_engines(session)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _check_engines(session) -> None:
    import gc

    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: xdist sends workeroutput after this hook
        gc.collect()
        config.workeroutput["leftovers"] = [_leftover_line(h) for h in _live_engines()]
        return
    lines = list(_LEFTOVERS)
    if not _XDIST_CONTROLLER[0]:
        gc.collect()
        lines += [_leftover_line(h) for h in _live_engines()]
    if lines:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()
        for line in lines:
            tr.write_line(line, red=True) if tr is not None else print(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_LEFTOVERS: list[str] = []
_XDIST_CONTROLLER = [False]


def _leftover_line(holders: str) -> str:
    return f"[leftovers] a vLLM AsyncLLM still referenced after the last test, by {holders}"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's leftovers (pytest_sessionfinish above)."""
    _XDIST_CONTROLLER[0] = True
    _LEFTOVERS.extend(getattr(node, "workeroutput", {}).get("leftovers", []))


# ---------------------------------------------------------------- order: the slowest files first
# Seconds per file in a run of the suite on the project's 2-core machine under two workers (`make test
# PYTEST_ARGS=--durations=0`, summed per file, rounded; refresh them when a file's cost changes much); a
# file not listed counts as quick. Under `make test`'s two workers (--dist loadfile) a file goes whole
# to whichever worker is free, in this order, so the long ones start first and the quick ones fill the
# gaps at the end instead of one long file running alone after the rest.
FILE_SECONDS = {
    "test_sync_matrix.py": 243, "test_openenv.py": 135, "test_signals.py": 129, "test_pipeline.py": 126,
    "test_elastic_pool.py": 120, "test_smollm2_run.py": 118, "test_multinode.py": 111, "test_chaos.py": 109,
    "test_reward_model.py": 105, "test_family_engines.py": 102, "test_planner_run.py": 88, "test_teacher.py": 85,
    "test_trainer.py": 84, "test_cluster.py": 80, "test_learning_signal.py": 76, "test_generator.py": 52,
    "test_chat_prompts.py": 49, "test_bf16.py": 48, "test_finite_tasks.py": 47, "test_faults.py": 43,
    "test_notebook.py": 41, "test_difficulty.py": 37, "test_multiturn.py": 31, "test_smollm2.py": 30,
    "test_verify.py": 21, "test_lora.py": 19, "test_vllm_engine.py": 19, "test_weightsync_vllm.py": 16,
    "test_config.py": 15, "test_end_of_turn.py": 14, "test_recipes.py": 13, "test_trainer_core.py": 13,
    "test_weightsync_transports.py": 12,
}


def pytest_configure(config):
    # xdist's loadfile would deal files by their number of tests, most first, not in the order below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {}
    for i, item in enumerate(items):
        rank.setdefault(item.path.name, (-FILE_SECONDS.get(item.path.name, 0), i))
    items.sort(key=lambda item: rank[item.path.name])  # stable: a file's own order is kept
