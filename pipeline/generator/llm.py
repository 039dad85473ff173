"""The vLLM engine itself: its arguments, its start (with its worker in the engine core on CPU), and its
outright stop.

Contract:
  * `engine_args(cfg, hf_dir, seed)` is the AsyncEngineArgs of one generator engine; CPU and GPU differ
    only in the fields it sets.
  * `start_llm(args, worker_in_core)` builds the AsyncLLM. On CPU with one tensor-parallel rank and
    `worker_in_core` (generator.cpu_executor, "auto" or "uni"), vLLM's worker runs inside its engine-core
    process (UniProcExecutor) instead of a third process of its own: the engine is two processes, not
    three, and starts with one import of torch and vLLM fewer (on 2 cores: 25 -> 14 s wall, 26 -> 14 CPU s
    for the tiny model). vLLM's CPU platform turns the "uni" backend into "mp" because it cannot set
    OpenMP's environment for a worker in an already started process; here the core is started with the
    environment vLLM's multiprocess executor would give its worker (`OMPProcessManager`: the cores of
    VLLM_CPU_OMP_THREADS_BIND, or its auto choice, as OMP_NUM_THREADS and the OpenMP affinity
    variables), so the core's OpenMP threads are bound exactly as that worker's were. In a generator's
    Monarch proc that core is forked from the proc, not spawned: it starts with the proc's imports of torch and vLLM
    (on 2 cores a tiny run's meshes are up in 12 s instead of 21, 8 CPU s less per engine start), on
    a thread of its own so the core inherits no OpenMP pool, signal mask or actor context; the forked
    core then takes its OpenMP thread count and cores from that environment itself, drops the parent's
    signal handlers and wakeup fd and Monarch's log prefix, and dies with its parent (with
    VLLM_WORKER_MULTIPROC_METHOD=spawn in the environment, or in any other process, it is spawned). Everywhere else
    (GPU, tensor_parallel_size > 1, generator.cpu_executor=mp) vLLM chooses as it always does.
  * `core_processes(llm)` are the engine-core processes (multiprocessing.Process objects).
  * `stop_engine(llm)` kills core and worker outright and unlinks the shared memory they held.

Example:
    args = engine_args(cfg, model_dir(cfg.model), seed=0, extra=vllm_engine_kwargs())
    llm = start_llm(args, worker_in_core(cfg))        # blocks while the core starts: call it in a thread
    ...
    stop_engine(llm)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from multiprocessing import resource_tracker

from pipeline import cleanup, procs
from pipeline.config import Config


# set by the user before anything here ran ("spawn": the engine core is spawned as vLLM's CPU platform
# does); vLLM itself sets it in this process when it builds an engine config, so it is read once, now
FORCED_MP_METHOD = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")


def worker_in_core(cfg: Config) -> bool:
    """Whether this config's engines run vLLM's worker inside the engine core (module docstring)."""
    g = cfg.generator
    return g.engine == "vllm-cpu" and g.tensor_parallel_size == 1 and g.cpu_executor in ("auto", "uni")


def start_llm(args, in_core: bool = True, fork: bool | None = None):
    """AsyncLLM.from_engine_args(args), with vLLM's worker in the engine core where `in_core` and the engine
    is a one-rank CPU engine (module docstring). That core is forked where `fork`; None: in a proc
    Monarch spawned, unless VLLM_WORKER_MULTIPROC_METHOD=spawn was set. Blocks while the core starts."""
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    if not (in_core and current_platform.is_cpu() and args.tensor_parallel_size == 1):
        return AsyncLLM.from_engine_args(args)
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    # a class, not "uni": the CPU platform rewrites only the name
    vllm_config = dataclasses.replace(args, distributed_executor_backend=UniProcExecutor).create_engine_config()
    resource_tracker.ensure_running()  # started outside the OpenMP environment below, which is the core's only
    # the environment vLLM's multiprocess executor gives its rank-0 worker, here for the core that the
    # constructor starts (set in this process for the constructor's few seconds, then restored)
    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        build = lambda: AsyncLLM(vllm_config=vllm_config, executor_class=UniProcExecutor,  # noqa: E731
                                 log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats)
        # forked only in a proc Monarch spawned, which runs the generator and nothing else: in another
        # process (a tool, a test), threads that ran other work may hold state that cannot outlive a fork
        # (a thread-local gloo group's destructor joins a thread the child does not have)
        if fork is None:
            fork = FORCED_MP_METHOD != "spawn" and "HYPERACTOR_MESH_BOOTSTRAP_MODE" in os.environ
        return _forking(build) if fork else build()


class _Forks:  # multiprocessing.util.register_after_fork keys its hooks by a weak reference
    pass


_FORKS = _Forks()
_fork_hook = False


def _forking(build):
    """`build()` (an AsyncLLM constructor) on a new thread, with vLLM's engine core forked from this
    process instead of spawned: the core starts with this process's imports of torch and vLLM instead
    of its own (about 9 CPU seconds on 2 cores, tools/bench/engine_start.py). The thread is new so that the core's one thread has no
    OpenMP pool, no signal mask and no Monarch actor context of the thread that asked; the core then
    resets what a forked child inherits and a spawned one does not (`_core_after_fork`)."""
    global _fork_hook
    import multiprocessing.util

    if not _fork_hook:
        multiprocessing.util.register_after_fork(_FORKS, _core_after_fork)
        _fork_hook = True
    got: dict = {}

    def run() -> None:
        try:
            got["llm"] = build()
        except BaseException as e:  # noqa: BLE001 - raised again on the asking thread
            got["error"] = e

    before = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # vLLM's CPU platform set "spawn"
    try:
        t = threading.Thread(target=run, name="engine-start", daemon=True)
        t.start()
        t.join()
    finally:
        if before is None:
            os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        else:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = before
    if "error" in got:
        raise got["error"]
    return got["llm"]


def _core_after_fork(_) -> None:
    """In a forked engine core, before vLLM's code runs: what a spawned core would have had."""
    import logging
    import multiprocessing
    import signal

    if not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    signal.set_wakeup_fd(-1)  # the parent's event loop's: a signal here must not wake it
    for s in signal.valid_signals():
        if callable(signal.getsignal(s)):
            signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for h in logging.getLogger().handlers:  # Monarch's actor prefix: this process is no actor
        for f in list(h.filters):
            if type(f).__name__ == "_ActorFilter":
                h.removeFilter(f)
    _omp_from_env()
    cleanup.exit_with_parent()


def omp_cpus(env) -> set[int]:
    """The cores an OpenMP environment binds to, as vLLM's executor writes it for GNU OpenMP
    (GOMP_CPU_AFFINITY "0 1 2-3"), another OpenMP (OMP_PLACES "{0,1}") or Intel's
    (KMP_AFFINITY "...,proclist=[0,1]"); empty when it binds none."""
    import re

    from pipeline.config.ids import parse_ids

    kmp = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
    spec = env.get("GOMP_CPU_AFFINITY") or env.get("OMP_PLACES") or (kmp.group(1) if kmp else "")
    return set(parse_ids(",".join(re.sub(r"[{},]", " ", spec).split())))  # as cpuset syntax


def _omp_from_env() -> None:
    """OpenMP's thread count and cores from the environment vLLM's executor set for this core
    (OMP_NUM_THREADS and `omp_cpus`), which a forked process's OpenMP, loaded before, does not read
    again."""
    import torch

    cpus = omp_cpus(os.environ)
    if cpus:
        os.sched_setaffinity(0, cpus)
    n = os.environ.get("OMP_NUM_THREADS", "")
    if n.isdigit() and int(n) > 0:
        torch.set_num_threads(int(n))


def engine_args(cfg: Config, hf_dir, seed: int, extra: dict | None = None):
    """AsyncEngineArgs for one generator engine; CPU and GPU differ only in these fields."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    g = cfg.generator
    kw = dict(model=str(hf_dir), tokenizer=str(hf_dir), dtype=cfg.model.dtype, seed=seed,
              tensor_parallel_size=g.tensor_parallel_size, max_model_len=g.max_model_len,
              max_num_seqs=max(g.concurrency, 8), logprobs_mode=f"{g.logprobs_mode}_logprobs",
              enable_prefix_caching=g.on_update != "keep", enforce_eager=g.engine == "vllm-cpu",
              use_tqdm_on_load=cfg.run.log_level in ("debug", "info"))  # a progress bar per engine start
    if g.engine == "vllm":
        kw["gpu_memory_utilization"] = g.gpu_memory_utilization
    else:  # a split prefill rewinds a seeded request's generator, which a CPU generator cannot do: the
        # engine core dies on seeded eval sampling once more prompt tokens wait than one step takes
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(g.max_model_len, 2048))
    if cfg.trainer.lora.rank:  # every version is an adapter of its own (pipeline/lora.py); two live at a switch
        kw.update(enable_lora=True, max_lora_rank=cfg.trainer.lora.rank, max_loras=2, max_cpu_loras=2)
    kw.update(extra or {})
    return AsyncEngineArgs(**kw)


def core_processes(llm) -> list:
    """The engine core processes vLLM started for `llm` (multiprocessing.Process objects)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", []))


def stop_engine(engine) -> None:
    """Stop a vLLM AsyncLLM at once (call it off the engine's event loop, or with that loop idle). Its
    output handler is cancelled first; its core and worker hold nothing to flush, so they are killed
    outright instead of vLLM's graceful stop (SIGTERM, then up to 5 s for the core and more for its
    worker: most of a run's shutdown); the shared-memory queues they held are unlinked once nobody
    maps them, as vLLM's own exit would, and this process's resource tracker forgets them."""
    handler = getattr(engine, "output_handler", None)  # would log the killed core as a failure
    loop = handler.get_loop() if handler is not None else None
    try:
        on_loop = loop is not None and asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    # the loop runs in another thread (the engine driven through asyncio.to_thread): vLLM's shutdown
    # hands the socket closes to that loop, which runs them; otherwise they are closed here
    loop_elsewhere = loop is not None and not on_loop and not loop.is_closed() and loop.is_running()
    if handler is not None and not handler.done() and not loop.is_closed():
        if on_loop:  # the cancellation runs once this coroutine yields
            handler.cancel()
        elif not loop.is_running():  # an idle loop (a test fixture's teardown): run the cancellation now,
            handler.cancel()  # or the task outlives the loop and the engine with it ("Task was destroyed")
            other_loop = False
            try:
                asyncio.get_running_loop()
                other_loop = True  # this thread runs another loop: the cancellation runs when that one does
            except RuntimeError:
                pass
            if not other_loop and not handler.done():
                with contextlib.suppress(Exception):
                    loop.run_until_complete(asyncio.wait([handler], timeout=2.0))
        else:  # called off the loop (asyncio.to_thread): the loop runs the cancellation now
            loop.call_soon_threadsafe(handler.cancel)
            deadline = time.monotonic() + 2.0
            while not handler.done() and time.monotonic() < deadline:
                time.sleep(0.005)  # another thread's loop: nothing here to await
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    # live children of this process only: a core that died was reaped by vLLM, and its pid may be reused
    cores = [p.pid for p in core_processes(engine)
             if getattr(p, "pid", None) and p.exitcode is None and procs.parent(p.pid) == os.getpid()]
    if resources is not None:  # vLLM's liveness monitor then takes the kill for a shutdown, not a crash
        resources.engine_dead = True
    tree = [(pid, st) for pid in cores if (st := procs.start_time(pid)) is not None]
    tree += [d for pid, _ in tree for d in procs.descendants(pid)]
    held = cleanup.held_by(pid for pid, _ in tree)
    procs.kill(tree)
    deadline = time.monotonic() + 5.0  # a killed process holds its mappings until it exits
    while any(procs.alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.02)  # other processes' exits: no event to wait on from this thread
    engine.shutdown()
    if not loop_elsewhere:
        _close_client(engine, resources)
    cleanup.untrack(cleanup.unlink_orphaned(held))


def _close_client(engine, resources) -> None:
    """Close the engine client's ZMQ sockets and terminate its context. vLLM's shutdown queues the
    socket closes on the engine's event loop when called off it; a loop that never runs again (a
    fixture's, idle) leaves them open, and the context, once garbage-collected, then blocks its
    collector forever in zmq_ctx_term (whatever code happened to trigger that collection). Every
    socket the client made is in its context's (or the asyncio shadow's) socket set."""
    if resources is None:
        return
    ctx = getattr(resources, "ctx", None)
    contexts = [c for c in (getattr(getattr(engine, "engine_core", None), "ctx", None), ctx) if c is not None]
    for c in contexts:
        for sock in list(getattr(c, "_sockets", ()) or ()):
            if not sock.closed:
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
    if ctx is not None and not ctx.closed:
        with contextlib.suppress(Exception):
            ctx.destroy(linger=0)
