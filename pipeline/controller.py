"""Controller: spawns the generator, buffer and trainer meshes and runs the supervised loops.

    pipe = Pipeline(cfg)                 # nothing starts yet
    await pipe.start()                   # proc meshes, actors, engines, weight-sync wiring
    metrics = await pipe.step()          # one batch -> one optimizer step -> version + 1 -> push
    await pipe.shutdown()                # close -> cancel -> stop every proc mesh

`run(cfg)` composes these into the job: generation runs inside the generator actors (CoPRIS fixed
concurrency, pulling admitted groups from the buffer); the training loop here waits for a batch,
trains and hands version v to `pipe.sync` (pipeline/weightsync/sync.py, which owns the push
protocol for every transport). Beside it `pipe.supervise()` watches the generators: a dead engine
or proc (a failed probe, a failed push, a Monarch fault) is stopped, its leased groups go back to the
buffer, and a new generator starts on the trainer's latest weights while the others keep generating
(generator.max_restarts bounds it). The first loop that fails stops the run with its error, and
shutdown always stops every proc mesh (Ctrl-C included).

One step, async mode (`run.mode=async`):
    batch(v-1) -> [carry_over=save: every generator ends its stage; partials resume on v]
    -> train -> buffer.finish_step(v) (admission for v opens) -> sync.start(v) (returns once packed)
    -> the next step's batch wait and compute overlap the delivery of v.
Sync mode (`run.mode=sync`, the baseline): the buffer runs with Δ=0 and max_staleness=0, and
    batch(v-1) -> train -> sync.push(v) (every generator serves v) -> buffer.finish_step(v).
Admission for v opens only once v is served, so every sample of a step is generated on the
weights it is trained against and nothing is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint import (Checkpoints, load_controller_state, prepare_resume, read_marker, rng_state,
                                 save_controller_state, set_rng_state)
from pipeline.config import Config, ConfigError
from pipeline.health import CollapseWatch, batch_health
from pipeline.metrics import MetricsSink, Progress, plot_summary, trained_samples
from pipeline.model import EOS_ID, PAD_ID, encode_completion, encode_prompt, load_tokenizer, model_dir
from pipeline.placement import describe, generator_placements
from pipeline.procs import alive, kill
from pipeline.generator.rewards import RewardScorer, reject_rate_problem
from pipeline.tasks import PromptStream, RewardRejected, open_task, take
from pipeline.trainer.errors import TooManySkippedSteps, skipped_step_error
from pipeline.weightsync.sync import WeightSync

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 600.0
REWARD_MODEL = "reward_model"  # the supervisor's key for the reward model's failures
HEALTH_PERIOD_S = 2.0
EVAL_SAMPLES = 4
LAST_CHECKPOINT_TIMEOUT_S = 120.0  # after a failure; after an interrupt (Ctrl-C, a signal) a quarter of it
SHUTDOWN_TIMEOUT_S = 60.0  # Pipeline.shutdown, all of it


class RunError(RuntimeError):
    """A loop or an actor failed; the message names which and why."""


class EndOfData(Exception):
    """The prompt stream ended (run.epochs) and the buffer holds no full batch any more: a normal end."""


async def timed(what: str, aw, timeout: float = CALL_TIMEOUT_S):
    """Await with a timeout whose error names the call."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise RunError(f"{what} did not answer within {timeout:.0f}s") from None


def sync_mode_config(cfg: Config) -> Config:
    """The synchronous baseline: same components, no over-commitment, strictly on-policy."""
    return dataclasses.replace(
        cfg, buffer=dataclasses.replace(cfg.buffer, overcommit="none", max_staleness=0),
        generator=dataclasses.replace(cfg.generator, on_update="drain"))


class Pipeline:
    """Handles to the running meshes and the step primitives shared by `run` and the session API."""

    def __init__(self, cfg: Config, host: Any = None):
        self.cfg = sync_mode_config(cfg) if cfg.run.mode == "sync" else cfg
        self._host = host
        self.version = 0
        self._procs: list[Any] = []
        self.sync: WeightSync | None = None
        self.trainer_addr = "127.0.0.1"  # where generators reach trainer rank 0's host (set by start)
        self.num_hosts = 1  # hosts of the job (set by start)
        n = cfg.generator.num_generators
        self.generators: list[Any] = [None] * n  # generator i's actor; None while it is restarted
        self._gen_procs: list[Any] = [None] * n
        self._gen_pids: list[list] = [[] for _ in range(n)]  # (pid, start) of its proc and engine core
        self._gen_segs: list[set[str]] = [set() for _ in range(n)]  # /dev/shm segments its processes held at start
        self.restarts = [0] * n
        self.requeued_groups = 0
        self._failures: asyncio.Queue | None = None  # (generator index or None for fatal, cause)
        self.task = open_task(cfg.task, evaluate=bool(cfg.run.eval_every and cfg.task.eval_prompts))  # TaskError
        self.checkpoints = Checkpoints(cfg)  # the user's config (before sync_mode_config) is what a resume diffs
        self.saved_step = -1  # the step of this run's newest checkpoint (or the one it resumed from)
        self.eval_curve: list[tuple[int, float, float]] = []  # (step, sampled, greedy); kept in checkpoints
        self.last_batch = None  # the Batch of the last trained step: the rollouts log decodes a few of its rows
        self.reward_model = None  # the reward model's actor (reward_model.path); None while it is restarted
        self._rm_procs = None
        self._rm_pids: list = []
        self.rm_restarts = 0
        self.rm_stats: dict = {}  # its last answer to the supervisor's probe
        if cfg.reward_model.path:  # before any mesh starts: a scorer that cannot read our tokens is a config error
            from pipeline.reward_model import check_tokenizer

            why = check_tokenizer(model_dir(cfg.model), cfg.reward_model.path)
            if why is not None:
                raise ConfigError(f"config: reward_model.path={cfg.reward_model.path!r} cannot be used: {why}")

    # ------------------------------------------------------------------ start / stop

    async def start(self) -> None:
        from monarch.actor import this_host

        from actors.replay_buffer import ReplayBufferActor
        from actors.trainer import Trainer

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.generator.kv_cache_gib))
        host = self._host or this_host()  # an attached torchrun host mesh has a 'hosts' dim; this_host() none
        cfg = self.cfg
        self.num_hosts = host.sizes.get("hosts", 1)
        # Trainer rank 0, the buffer and this controller's meshes start on host 0.
        self.generator_hosts = [i % self.num_hosts if cfg.generator.placement == "spread" else 0
                                for i in range(cfg.generator.num_generators)]
        remote = [f"generator{i} on host {h}" for i, h in enumerate(self.generator_hosts) if h != 0]
        if remote and cfg.weight_sync.transport == "shm":
            raise RunError(f"weight_sync.transport='shm' only reaches generators on trainer rank 0's host (host 0), "
                           f"but {', '.join(remote)} (generator.placement={cfg.generator.placement!r}, "
                           f"{self.num_hosts} hosts): use weight_sync.transport=rdma (or collective)")
        # cores or GPUs too few for the generators of a host: a ConfigError (exit 2) before anything starts
        self._gen_placements = generator_placements(cfg, self.generator_hosts, cfg.trainer.num_ranks // self.num_hosts)
        self.hf_dir = model_dir(cfg.model)
        self.tokenizer = load_tokenizer(self.hf_dir)

        t0 = time.monotonic()
        log.info("starting trainer mesh (%d ranks over %d host(s))", cfg.trainer.num_ranks, self.num_hosts)
        self.trainer = await Trainer.start(cfg, host)  # every call below: all ranks, rank 0's answer
        self._procs.append(self.trainer.procs)
        self.trainer_addr = self.trainer.addr  # where other hosts reach trainer rank 0's host
        self.placement = {p["role"]: p for p in self.trainer.placements}  # every proc's, by role (placement.apply)
        if cfg.run.warm_start_steps and not cfg.run.resume:
            await self.warm_start(cfg.run.warm_start_steps)

        log.info("starting replay buffer (host 0) and %d generator(s) on hosts %s; vLLM engines take a while to start",
                 cfg.generator.num_generators, self.generator_hosts)
        buffer_procs = self._spawn(host, 0)
        self.buffer = buffer_procs.spawn("buffer", ReplayBufferActor, cfg, PAD_ID)
        self.placement["buffer"] = await timed("buffer setup", self.buffer.setup.call_one(), 60)
        log.info("placement: buffer (pid %d): %s", self.placement["buffer"]["pid"],
                 describe(self.placement["buffer"]))
        self._host_mesh = host
        self._install_fault_hook()
        if cfg.reward_model.path:
            await self._spawn_reward_model()
        warm = str(self.warm_dir) if hasattr(self, "warm_dir") else None
        gens = await asyncio.gather(*[self._spawn_generator(i, warm, 0) for i in range(len(self.generators))])
        self.generators[:] = gens
        # A member that fails a push is taken out only while `supervise` runs (it restarts it); without
        # a supervisor (Session), the push itself fails: never a generator silently left on old weights.
        self.sync = WeightSync(self.trainer, self.generators, cfg)
        await self.sync.attach(self.trainer_addr)
        log.info("meshes up in %.1fs: trainer x%d, buffer, generators x%d (transport=%s)",
                 time.monotonic() - t0, cfg.trainer.num_ranks, len(self.generators), cfg.weight_sync.transport)

    def _spawn(self, host: Any, index: int, keep: bool = True):
        """One proc on host `index` of the job (`spawn_procs` on a whole host mesh spawns on every host)."""
        if "hosts" in host.sizes:
            host = host.slice(hosts=index)
        procs = host.spawn_procs(per_host={"procs": 1})
        if keep:
            self._procs.append(procs)
        return procs

    async def _spawn_generator(self, i: int, hf_dir: str | None, version: int) -> Any:
        """Generator i on its own proc, its engine serving `hf_dir` (default: the model) as `version`."""
        from actors.generator import GeneratorActor

        cfg = self.cfg if hf_dir is None else dataclasses.replace(
            self.cfg, model=dataclasses.replace(self.cfg.model, hf_dir=hf_dir))
        procs = self._spawn(self._host_mesh, self.generator_hosts[i], keep=False)
        self._gen_procs[i] = procs
        # a unique mesh name per incarnation: a late fault of a replaced mesh must not hit its successor
        gen = procs.spawn(f"generator{i}r{self.restarts[i]}", GeneratorActor, cfg, i, self.restarts[i])
        info = await timed(f"generator{i} setup", gen.setup.call_one(version, self._gen_placements[i]),
                           self.cfg.generator.start_timeout_s)
        self._gen_pids[i] = info["procs"]
        if self._local(i):  # its engine's segments, unlinked after it stops even if all its holders died first
            from pipeline.cleanup import held_by

            self._gen_segs[i] = held_by(p for p, _ in info["procs"])
        self.placement[f"generator{i}"] = info["placement"]
        self._write_placement()
        log.info("placement: generator%d (pid %d): %s", i, info["placement"]["pid"], describe(info["placement"]))
        if self.reward_model is not None:  # while it is restarted, its restart attaches it (_restart_reward_model)
            await timed(f"generator{i}.attach_reward_model", gen.attach_reward_model.call_one(self.reward_model), 60)
        return gen

    async def _spawn_reward_model(self) -> None:
        """The reward model on its own proc on host 0 (reward_model.path, pipeline/reward_model.py)."""
        from actors.reward_model import RewardModelActor

        rc = self.cfg.reward_model
        procs = self._spawn(self._host_mesh, 0, keep=False)
        self._rm_procs = procs
        rm = procs.spawn(f"reward_modelr{self.rm_restarts}", RewardModelActor, self.cfg, self.rm_restarts)
        info = await timed("reward model setup", rm.setup.call_one(), rc.start_timeout_s)
        self._rm_pids = info["procs"]
        self.placement["reward_model"] = info["placement"]
        self._write_placement()
        log.info("reward model %s loaded in %.1fs (pid %d): %s; streaming chunks of %d tokens", rc.path,
                 info["load_s"], info["pid"], describe(info["placement"]), rc.chunk_tokens)
        self.reward_model = rm

    def _write_placement(self) -> None:
        """out_dir/placement.json: every proc's role, pid, cores, threads and GPUs, kept current
        across restarts (where to look, or what to kill, when debugging a run)."""
        out = Path(self.cfg.run.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "placement.json.tmp"
        tmp.write_text(json.dumps(self.placement, indent=2, default=str))
        tmp.replace(out / "placement.json")

    async def _stop_reward_model(self, rm: Any) -> None:
        """Best effort, bounded, like _stop_generator."""
        if rm is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(rm.shutdown.call_one(), 10)
        procs, self._rm_procs = self._rm_procs, None
        if procs is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(procs.stop(), 30)
        if self.num_hosts == 1:
            kill(self._rm_pids)

    async def _restart_reward_model(self, cause: str) -> None:
        """Stop the reward model, start a new one, and hand it to every generator: their scores in
        flight wait for it (within reward_model.timeout_s) and send their sequences whole."""
        detected, t0 = time.time(), time.monotonic()
        self.rm_restarts += 1
        log.warning("reward model failed (%s); restart %d of %d", cause[:300], self.rm_restarts,
                    self.cfg.reward_model.max_restarts)
        old, self.reward_model = self.reward_model, None
        await self._stop_reward_model(old)
        await self._spawn_reward_model()
        res = await asyncio.gather(*[asyncio.wait_for(g.attach_reward_model.call_one(self.reward_model), 60)
                                     for _, g in self.live_generators()], return_exceptions=True)
        for (i, _), r in zip(self.live_generators(), res):
            if isinstance(r, BaseException):
                self._report_failure(i, f"attaching the restarted reward model failed: {r}")
        event = {"reward_model": True, "restart": self.rm_restarts, "cause": cause[:500], "detected_at": detected,
                 "recovered_at": time.time(), "recovery_s": time.monotonic() - t0}
        with open(Path(self.cfg.run.out_dir) / "faults.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        log.warning("reward model back in %.1fs", event["recovery_s"])

    def _local(self, i: int) -> bool:
        """Generator i surely runs on this (the controller's) host, so its recorded pids mean something
        here: a one-host job (with several, host 0 need not be the controller's)."""
        return self.num_hosts == 1

    def live_generators(self) -> list[tuple[int, Any]]:
        return [(i, g) for i, g in enumerate(self.generators) if g is not None]

    async def start_generation(self) -> None:
        await timed("generation start", asyncio.gather(
            *[g.start_generation.call_one(self.buffer) for _, g in self.live_generators()]))

    # ------------------------------------------------------------------ supervision

    def _report_failure(self, i: int | None, cause: str | BaseException) -> None:
        """Queue a failure for `supervise` (i: a generator; None: fatal, e.g. the trainer's mesh)."""
        if self._failures is not None:
            self._failures.put_nowait((i, str(cause)))

    def _install_fault_hook(self) -> None:
        """Monarch reports a dead mesh to the client's fault hook, whose default exits the process.
        A generator's failure is ours to handle (restart); any other mesh's failure ends the run."""
        import re

        import monarch.actor

        loop = asyncio.get_running_loop()
        self._failures = asyncio.Queue()

        def hook(failure) -> None:
            m = re.match(r"generator(\d+)r(\d+)-", failure.mesh_name)
            if m and int(m[2]) != self.restarts[int(m[1])]:
                return  # a replaced incarnation's late report
            r = re.match(r"reward_modelr(\d+)-", failure.mesh_name)
            if r:
                if int(r[1]) == self.rm_restarts:
                    loop.call_soon_threadsafe(self._report_failure, REWARD_MODEL, failure.report())
                return
            if m or failure.mesh_name.startswith("logger-"):  # a dead proc's logger mesh goes with it
                i = int(m[1]) if m else -1
            else:
                i = None
            if i != -1:
                loop.call_soon_threadsafe(self._report_failure, i, failure.report())

        monarch.actor.unhandled_fault_hook = hook

    async def _probe(self, slow: dict[int, int]) -> dict[int, str]:
        """Ask every live generator for its stats: a dead actor fails at once, a dead engine reports
        an error, a slow one times out (three timeouts in a row count as hung)."""
        live = self.live_generators()
        failed = {}
        for i, _ in live:  # a proc on this host that is gone is dead now; Monarch may take ~30 s to say so
            if self._local(i) and self._gen_pids[i] and not alive(self._gen_pids[i][0]):
                failed[i] = f"its process {self._gen_pids[i][0][0]} died"
        live = [(i, g) for i, g in live if i not in failed]
        t = self.cfg.generator.health_timeout_s
        if self.reward_model is not None:
            if self.num_hosts == 1 and self._rm_pids and not alive(self._rm_pids[0]):
                failed[REWARD_MODEL] = f"its process {self._rm_pids[0][0]} died"
            else:
                try:
                    self.rm_stats = await asyncio.wait_for(self.reward_model.stats.call_one(), t)
                    slow.pop(REWARD_MODEL, None)
                except asyncio.TimeoutError:
                    slow[REWARD_MODEL] = slow.get(REWARD_MODEL, 0) + 1
                    if slow[REWARD_MODEL] >= 3:
                        failed[REWARD_MODEL] = f"no health answer within {t:.0f}s three times in a row"
                except Exception as e:  # noqa: BLE001 - a dead actor
                    failed[REWARD_MODEL] = f"{type(e).__name__}: {e}"
        res = await asyncio.gather(*[asyncio.wait_for(g.stats.call_one(), t) for _, g in live], return_exceptions=True)
        for (i, _), r in zip(live, res):
            if isinstance(r, asyncio.TimeoutError):
                slow[i] = slow.get(i, 0) + 1
                if slow[i] >= 3:
                    failed[i] = f"no health answer within {t:.0f}s three times in a row (generator.health_timeout_s)"
                continue
            slow.pop(i, None)
            if isinstance(r, BaseException):
                failed[i] = f"{type(r).__name__}: {r}"
            elif r.get("error"):
                failed[i] = r["error"]
            elif (why := reject_rate_problem(r, self.cfg.task.max_reject_frac)) is not None:
                raise RunError(f"generator{i}: {why}")  # the task's fault: a restart would not help
        return failed

    async def supervise(self) -> None:
        """Runs beside the train loop: probes the generators (and the reward model) every
        HEALTH_PERIOD_S and reacts at once to a failed push or a Monarch fault. A failed generator
        or reward model is restarted in the background while the others keep generating. Raises
        RunError past generator.max_restarts (reward_model.max_restarts) or on a fatal fault."""
        restarting: dict[int | str, asyncio.Task] = {}
        slow: dict[int | str, int] = {}
        self.sync.on_failure = self._report_failure
        try:
            while True:
                try:
                    failed = dict([await asyncio.wait_for(self._failures.get(), HEALTH_PERIOD_S)])
                except asyncio.TimeoutError:
                    failed = await self._probe(slow)
                for i, t in list(restarting.items()):
                    if t.done():
                        del restarting[i]
                        if t.exception() is not None:  # the restart itself failed: try again, within bounds
                            failed.setdefault(i, f"restart failed: {t.exception()}")
                if None in failed:
                    raise RunError(f"a trainer or buffer mesh failed: {failed[None]}")
                for i, cause in failed.items():
                    if i in restarting:
                        continue
                    if i == REWARD_MODEL:
                        if self.rm_restarts >= self.cfg.reward_model.max_restarts:
                            raise RunError(f"the reward model failed and has used its {self.cfg.reward_model.max_restarts} "
                                           f"restarts (reward_model.max_restarts): {cause}")
                        slow.pop(i, None)
                        restarting[i] = asyncio.create_task(self._restart_reward_model(cause), name="restart-reward-model")
                        continue
                    if self.restarts[i] >= self.cfg.generator.max_restarts:
                        raise RunError(f"generator{i} failed and has used its {self.cfg.generator.max_restarts} "
                                       f"restarts (generator.max_restarts): {cause}")
                    slow.pop(i, None)
                    restarting[i] = asyncio.create_task(self._restart(i, cause), name=f"restart-generator{i}")
        finally:
            self.sync.on_failure = None
            for t in restarting.values():
                t.cancel()
            await asyncio.gather(*restarting.values(), return_exceptions=True)

    async def _restart(self, i: int, cause: str) -> None:
        """Stop generator i, requeue its groups, start a new one on the trainer's latest weights and
        let it generate once the weight sync has it (see WeightSync.rejoin)."""
        detected, t0 = time.time(), time.monotonic()
        lessee = (i, self.restarts[i])  # this incarnation; its successor is a new lessee
        self.restarts[i] += 1
        log.warning("generator%d failed (%s); restart %d of %d", i, cause[:300], self.restarts[i],
                    self.cfg.generator.max_restarts)
        self.sync.detach(i)
        old, self.generators[i] = self.generators[i], None
        requeued = await timed("buffer.release_generator", self.buffer.release_generator.call_one(lessee))
        self.requeued_groups += requeued
        await self._stop_generator(i, old)
        path = Path(self.cfg.run.out_dir) / "respawn" / f"generator{i}"
        version = await self.trainer.export_hf(str(path))
        gen = await self._spawn_generator(i, str(path), version)
        await self.sync.rejoin(i, gen)
        self.generators[i] = gen
        if self.reward_model is not None:  # the predecessor's streams go; this one scores with the current model
            from actors.generator import stream_prefix

            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.reward_model.release_prefix.call_one(stream_prefix(*lessee)), 10)
            await timed(f"generator{i}.attach_reward_model", gen.attach_reward_model.call_one(self.reward_model), 60)
        await timed(f"generator{i}.start_generation", gen.start_generation.call_one(self.buffer))
        shutil.rmtree(path, ignore_errors=True)
        event = {"generator": i, "restart": self.restarts[i], "cause": cause[:500], "detected_at": detected,
                 "recovered_at": time.time(), "recovery_s": time.monotonic() - t0, "requeued_groups": requeued,
                 "version": version}
        with open(Path(self.cfg.run.out_dir) / "faults.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        log.warning("generator%d back in %.1fs at version %d (%d groups requeued)", i, event["recovery_s"],
                    version, requeued)

    async def _stop_generator(self, i: int, gen: Any, closed: bool = False) -> None:
        """Best effort, bounded: shut the engine down (unless `closed`: done already), stop the proc
        mesh, then SIGKILL whatever of its recorded processes survived (an engine core outlives a
        parent killed with SIGKILL), and unlink the shared-memory segments those processes held that
        nobody uses any more."""
        from pipeline import cleanup
        from pipeline.procs import descendants

        held: set[str] = set()
        tree = list(self._gen_pids[i])
        if self._local(i):  # the engine's message queues: unlinked by vLLM on a clean exit, not after a kill
            tree += [d for root, _ in self._gen_pids[i] for d in descendants(root) if d not in tree]
            held = cleanup.held_by(p for p, _ in tree) | self._gen_segs[i]
        clean = closed
        if gen is not None and not closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(gen.shutdown.call_one(), 15)
                clean = True
        procs, self._gen_procs[i] = self._gen_procs[i], None
        if procs is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(procs.stop(), 30)
        killed = kill(tree) if self._local(i) else []
        if self._local(i):  # a generator killed hard leaves its LoRA adapter directory and segments behind
            deadline = time.monotonic() + 5.0  # a SIGKILLed process holds its mappings until it is reaped
            while any(alive(p) for p in tree) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            cleanup._sweep_lora_dirs()
            gone = cleanup.unlink_orphaned(held)
            if gone:
                log.info("generator%d: removed %d shared-memory segments it left: %s", i, len(gone), " ".join(gone))
        if killed:  # after a clean engine shutdown only vLLM's exiting helpers are left: routine
            log.log(logging.INFO if clean else logging.WARNING, "generator%d: killed leftover processes %s", i, killed)

    async def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """close -> cancel -> stop, within timeout_s overall: cancel the push in flight, then close
        every generator (its generation and engine) concurrently, then stop their procs (and leftover
        engine processes) and every other proc mesh concurrently.
        Never raises: a failed or late step is logged, so the error that caused the shutdown is the
        one that propagates (what a timeout leaves running, pipeline.run kills at exit)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        if self.sync is not None:
            self.sync.cancel()
            await _settle({"weight sync": self.sync.wait()}, deadline)
        procs, self._procs = self._procs, []
        rm, self.reward_model = self.reward_model, None
        # the generators stop generating first: one still sending to a buffer whose mesh is stopping
        # would break on it (and say so) at the end of a run that went well
        closed = await _settle({i: asyncio.wait_for(g.shutdown.call_one(), 15)
                                for i, g in enumerate(self.generators) if g is not None}, deadline, "generator{} shutdown")
        await _settle({**{f"generator{i} stop": self._stop_generator(i, g, closed.get(i, False))
                          for i, g in enumerate(self.generators)},
                       "reward model stop": self._stop_reward_model(rm),
                       **{f"proc mesh {k} stop": p.stop() for k, p in enumerate(procs)}}, deadline)

    # ------------------------------------------------------------------ steps

    async def warm_start(self, steps: int) -> dict:
        """Supervised warm start on task demonstrations (reported as such), exported for the generators."""
        if self.task.demonstration is None:
            raise RunError(f"run.warm_start_steps={steps} but task {self.task.name} has no demonstration()")
        items = PromptStream(self.task, self.cfg.task.seed + 7919)  # a finite split cycles in epochs
        n = self.cfg.buffer.batch_groups * self.cfg.buffer.group_size
        loss = float("nan")
        for _ in range(steps):
            ids, mask = self.demo_batch([next(items) for _ in range(n)])
            loss = (await self.trainer.sft_step(ids, mask, self.cfg.run.warm_start_lr or None))["loss"]
        self.warm_dir = Path(self.cfg.run.out_dir) / "warm_start"
        await self.trainer.export_hf(str(self.warm_dir))
        if await self.trainer.set_reference():
            log.info("warm start: the KL reference (trainer.kl_coef) is the warm-started policy")
        log.info("warm start: %d supervised steps on demonstrations, final loss %.4f", steps, loss)
        return {"warm_start/loss": loss, "warm_start/steps": steps}

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, as the generators decode completions (special tokens dropped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def demo_batch(self, items) -> tuple[torch.Tensor, torch.Tensor]:
        seqs, masks = [], []
        for it in items:
            p = encode_prompt(self.tokenizer, it.prompt)  # as the generators do: the same tokens in RL
            demo = self.task.demonstration(it)
            # a str: one model turn; a list (multi-turn): model turn, observation, model turn, ...,
            # laid out as the generators lay out a rollout: each model turn ends with EOS and is
            # trained on, each observation is tokenised on its own and masked out (pipeline/envs.py)
            seq, mask = list(p), [0.0] * len(p)
            for k, text in enumerate([demo] if isinstance(demo, str) else list(demo)):
                ids = encode_completion(self.tokenizer, text) + ([EOS_ID] if k % 2 == 0 else [])
                seq += ids
                mask += [1.0 if k % 2 == 0 else 0.0] * len(ids)
            seqs.append(seq)
            masks.append(mask)
        t = max(map(len, seqs))
        ids = torch.tensor([s + [PAD_ID] * (t - len(s)) for s in seqs])
        mask = torch.tensor([m + [0.0] * (t - len(m)) for m in masks])
        return ids, mask

    async def train_once(self) -> dict:
        """Wait for a batch, take one optimizer step: version + 1 on the trainer (not yet announced).
        A step the trainer skips (non-finite loss or gradient, no loss tokens) gives its batch back
        to the buffer, booked as dropped so that admission reopens, and the next batch is tried; after
        trainer.max_skipped_steps skips in a row the run stops. EndOfData once the prompts ran out."""
        cfg = self.cfg
        t0 = time.monotonic()
        while True:
            batch = await timed("buffer.get_batch",
                                self.buffer.get_batch.call_one(self.version, cfg.buffer.batch_timeout_s),
                                cfg.buffer.batch_timeout_s + 30)
            if batch is None:
                raise EndOfData(f"the prompt stream ended (run.epochs={cfg.run.epochs}) and no full batch is left")
            t1 = time.monotonic()
            if cfg.generator.carry_over == "save":  # CoPRIS stage end: in-flight rollouts become partials
                # a generator dying meanwhile is the supervisor's business, not this step's
                await asyncio.gather(*[asyncio.wait_for(g.end_stage.call_one("save", True), cfg.generator.request_timeout_s)
                                       for _, g in self.live_generators()], return_exceptions=True)
            try:
                metrics = await self.trainer.train_step(batch)
                break
            except Exception as e:  # from the actor: Monarch's ActorError, the trainer's error in .exception
                inner = getattr(e, "exception", e)
                if isinstance(inner, TooManySkippedSteps):
                    raise RunError(str(inner)) from e
                why = skipped_step_error(e)
                if why is None:
                    raise
            log.warning("step at version %d skipped, its batch goes back to the buffer as dropped: %s",
                        self.version, why)
            await timed("buffer.skip_batch", self.buffer.skip_batch.call_one(batch.group_ids))
            if cfg.generator.carry_over == "save":  # the stages ended for an update that is not coming
                await timed("start_generation", asyncio.gather(
                    *[g.start_generation.call_one(self.buffer) for _, g in self.live_generators()],
                    return_exceptions=True))
        self.version += 1
        self.last_batch = batch
        metrics["trainer/skipped_steps"] = metrics.pop("skipped_steps")
        stale = batch.staleness().float()
        t2 = time.monotonic()
        metrics.update({
            "reward/mean": float(batch.rewards.mean()), "staleness/mean": float(stale.mean()),
            "staleness/max": float(stale.max()), "version/trainer": self.version, "time/batch_wait_s": t1 - t0,
            "time/train_s": t2 - t1, "trainer/idle_frac": (t1 - t0) / max(t2 - t0, 1e-9),
            "batch/tokens": batch.num_tokens, **batch_health(batch),
        })
        return metrics

    async def finish_step(self, mean_reward: float) -> dict:
        """Announce the trainer's version to the buffer (admission for it opens) and feed Δ; buffer stats."""
        return await timed("buffer.finish_step", self.buffer.finish_step.call_one(self.version, mean_reward))

    async def step(self) -> dict:
        """One RL step in the configured mode (see the module docstring); metrics incl. the buffer's."""
        metrics = await self.train_once()
        if self.cfg.run.mode == "sync":
            await self.sync.push(self.version)
            buf = await self.finish_step(metrics["reward/mean"])
        else:
            buf = await self.finish_step(metrics["reward/mean"])
            await self.sync.start(self.version)
        metrics.update(buffer_metrics(buf))
        return metrics

    async def push_weights(self) -> float:
        """Push the trainer's current version to every generator and wait; seconds end to end."""
        return await self.sync.push(self.version)

    async def save_checkpoint(self, step: int) -> Path:
        """A checkpoint at a step boundary, once the last push landed (pipeline/checkpoint.py)."""
        await self.sync.wait()
        buf = await timed("buffer.state_dict", self.buffer.state_dict.call_one())
        return await self._write_checkpoint(step, buf)

    async def _write_checkpoint(self, step: int, buf: dict) -> Path:
        """Every trainer rank (possibly on other hosts) saves into a new step_N.tmp-* directory, then
        the controller adds its state; the directory becomes step_N only once all of it is written.
        A failed save is removed; a cancelled one is left (trainer ranks may still be writing into
        it) for the next start to sweep."""
        tmp = self.checkpoints.begin(step)
        try:
            await self.trainer.save(str(tmp), {"step": step})
            save_controller_state(tmp, {"step": step, "version": self.version, "buffer": buf,
                                        "eval_curve": list(self.eval_curve), "rng": rng_state()})
            path = self.checkpoints.commit(tmp, step, self.version)
        except Exception:
            self.checkpoints.abort(tmp)
            raise
        self.saved_step = step
        return path

    async def save_last_checkpoint(self, err: BaseException) -> Path | None:
        """After a failure or an interrupt (`err`): a checkpoint at the trainer's version, if
        checkpoints are on, the trainer still answers and every batch the buffer handed out was
        trained (a step cut short between the two would leave a checkpoint whose buffer is a batch
        ahead of its trainer). Bounded by LAST_CHECKPOINT_TIMEOUT_S; logs and returns None on any
        failure of its own, so the caller re-raises the run's error, not this one."""
        if not self.cfg.run.checkpoint_every or self.sync is None:  # off, or the meshes never came up
            return None
        timeout = LAST_CHECKPOINT_TIMEOUT_S if isinstance(err, Exception) else LAST_CHECKPOINT_TIMEOUT_S / 4
        try:
            return await asyncio.wait_for(self._save_last(), timeout)
        except asyncio.TimeoutError:
            log.error("no last checkpoint: not written within %.0fs", timeout)
        except Exception as e:
            log.error("no last checkpoint: %s: %s", type(e).__name__, e)
        return None

    async def _save_last(self) -> Path | None:
        buf = await self.buffer.state_dict.call_one()
        version = await self.trainer.version()
        if version == self.saved_step:
            log.info("no last checkpoint needed: step_%d is saved", version)
            return None
        if version == 0 or buf["buffer"]["batches"] != version:
            log.warning("no last checkpoint: trainer at version %d, the buffer handed out %d batches (%s)", version,
                        buf["buffer"]["batches"], "nothing trained" if version == 0 else "a step was cut short")
            return None
        self.version = version  # a train step may have finished after its caller was cancelled
        path = await self._write_checkpoint(version, buf)
        log.warning("saved a last checkpoint %s: continue with run.resume=latest", path)
        return path

    async def resume(self, path: str) -> int:
        """Restore checkpoint `path` before generation starts: trainer, buffer (its complete groups
        are trained next, its in-flight ones requeued), prompt position, the controller's RNG and
        eval curve; the generators get its weights as its version. Returns its step."""
        state = load_controller_state(path)
        await self.trainer.load(path)
        self.version = await self.trainer.version()
        if self.version != state["version"]:
            raise RunError(f"checkpoint {path}: trainer version {self.version} != saved {state['version']}")
        await timed("buffer.load_state_dict", self.buffer.load_state_dict.call_one(state["buffer"]))
        set_rng_state(state["rng"])
        self.eval_curve[:] = state["eval_curve"]
        self.saved_step = state["step"]
        if self.version:
            await self.push_weights()
        held = state["buffer"]["buffer"]
        log.info("resumed from %s at step %d (version %d): %d complete groups to train, %d requeued", path,
                 state["step"], self.version, len(held["complete"]), len(held["in_flight"]))
        return int(state["step"])

    async def evaluate(self) -> dict[str, float]:
        """Held-out prompts on generator 0, scored by the task's reward: `eval/reward` samples
        EVAL_SAMPLES completions per prompt at the training temperature (the policy's expected reward,
        what RL optimises); `eval/reward_greedy` is the greedy completion's reward."""
        items = take(self.task, self.cfg.task.seed, "eval", self.cfg.task.eval_prompts)
        prompts = [i.prompt for i in items]
        n = self.cfg.generator.max_new_tokens
        for k, (i, gen) in enumerate(live := self.live_generators()):  # a generator dying meanwhile: the next
            try:  # the items, not just their prompts: a multi-turn task's environment gets them as in training
                greedy = await timed("generate_eval", gen.generate_eval.call_one(items, n))
                sampled = await timed("generate_eval", gen.generate_eval.call_one(
                    items * EVAL_SAMPLES, n, self.cfg.generator.temperature, self.cfg.task.seed))
                break
            except Exception as e:
                if k == len(live) - 1:
                    raise
                log.warning("eval on generator%d failed (%s); trying the next", i, e)
                self._report_failure(i, e)
        else:
            raise RunError("evaluate: no generator is serving (all are being restarted)")
        # Faults stay local: prompts the generator could not serve came back None (skipped), and
        # completions whose reward cannot be used are counted and left out of the mean.
        scorer = RewardScorer(self.task, self.cfg.task.reward_timeout_s, self.cfg.task.reward_workers)
        rejected: Counter = Counter()

        async def one(prompt: str, completion: str) -> float | None:
            try:
                return await scorer.score(prompt, completion)
            except RewardRejected as e:
                rejected[e.reason] += 1
                return None

        async def score(outs: list) -> float:
            got = await asyncio.gather(*(one(p, o) for p, o in zip(prompts * EVAL_SAMPLES, outs) if o is not None))
            ok = [r for r in got if r is not None]
            return sum(ok) / len(ok) if ok else float("nan")

        out = {"eval/reward": await score(sampled), "eval/reward_greedy": await score(greedy),
               "eval/skipped_prompts": float(sum(o is None for o in greedy))}
        return out | {f"eval/rejected/{k}": float(v) for k, v in sorted(rejected.items())}

    async def stats(self) -> dict:
        out = {"buffer": await timed("buffer.stats", self.buffer.stats.call_one(), 60)}
        for i, g in self.live_generators():
            out[f"generator{i}"] = await timed(f"generator{i}.stats", g.stats.call_one(), 60)
        if self.reward_model is not None:
            out["reward_model"] = await timed("reward_model.stats", self.reward_model.stats.call_one(), 60)
        return out


def rejected_metrics(gens: list[dict]) -> dict[str, float]:
    """`rejected/<reason>`: samples (rewards) and prompts rejected so far, summed over the generators'
    stats; `rejected/recent_frac`: the highest recent rejected fraction (task.max_reject_frac bounds it)."""
    total: Counter = Counter()
    for g in gens:
        total.update(g["rejected"])
        total.update(g["failed"])
    return {**{f"rejected/{k}": float(v) for k, v in sorted(total.items())},
            "rejected/recent_frac": max((g["recent_rejected_frac"] for g in gens), default=0.0)}


def reward_metrics(gens: list[dict], pipe: Pipeline) -> dict[str, float]:
    """Reward latency after EOS (median over the generators' recent samples) and, with a reward
    model, its stream and restart counters (its stats as of the supervisor's last probe)."""
    import statistics

    lat = [x for g in gens for x in g.get("reward_latency_s", [])]
    out = {"reward/latency_after_eos_s": statistics.median(lat) if lat else float("nan")}
    if pipe.cfg.reward_model.path:
        rms = [g["reward_model"] for g in gens if g.get("reward_model")]
        rs = pipe.rm_stats
        out.update({"reward_model/restarts": float(pipe.rm_restarts),
                    "reward_model/score_mean": statistics.fmean([r["score_mean"] for r in rms]) if rms else float("nan"),
                    "reward_model/chunks": float(sum(r["chunks"] for r in rms)),
                    "reward_model/resent_whole": float(sum(r["resent_whole"] for r in rms)),
                    "reward_model/held_streams": float(rs.get("held", 0)),
                    "reward_model/busy_frac": float(rs.get("busy_frac", 0.0)),
                    "reward_model/ops_per_forward": float(rs.get("ops_per_forward", 0.0))})
    return out


def buffer_metrics(buf: dict) -> dict[str, float]:
    """The buffer's per-step metrics: Δ, drops and wasted tokens (every mode reports them)."""
    return {"buffer/delta": float(buf["delta"]), "buffer/dropped_samples": float(buf["dropped_samples"]),
            "buffer/wasted_tokens": float(buf["wasted_tokens"]), "buffer/held_samples": float(buf["held_samples"]),
            "buffer/zero_signal_groups": float(buf["zero_signal_groups"]), "data/epoch": float(buf["data_epoch"])}


# ---------------------------------------------------------------------- the job


async def _train_loop(pipe: Pipeline, sink, progress: Progress, first_step: int = 1) -> dict:
    cfg = pipe.cfg
    summary: dict[str, Any] = {}
    eval_curve = pipe.eval_curve  # a resumed run continues the checkpoint's curve
    if cfg.run.eval_every and cfg.task.eval_prompts and first_step == 1:
        ev = await pipe.evaluate()
        eval_curve.append((first_step - 1, ev["eval/reward"], ev["eval/reward_greedy"]))
        sink.log(first_step - 1, ev)
    t_start = time.monotonic()
    samples = tokens = 0
    watch = CollapseWatch(cfg.run.collapse_entropy, cfg.run.collapse_length, cfg.run.collapse_patience)
    last, ended = first_step - 1, "steps"
    for step in range(first_step, cfg.run.steps + 1):
        try:
            metrics = await pipe.step()
        except EndOfData as e:  # run.epochs reached: a normal end (below: a final eval, then the summary)
            log.info("end of data after step %d: %s", last, e)
            ended = "data"
            break
        last = step
        if (msg := watch.update(step, metrics)) is not None:
            log.warning(msg)
        samples += int(metrics.get("samples", cfg.buffer.batch_groups * cfg.buffer.group_size))
        tokens += int(metrics["batch/tokens"])
        elapsed = time.monotonic() - t_start
        gens = [g for g in await asyncio.gather(*[asyncio.wait_for(g.stats.call_one(), cfg.generator.health_timeout_s)
                                                  for _, g in pipe.live_generators()], return_exceptions=True)
                if not isinstance(g, BaseException)]  # a generator that died is the supervisor's business
        served = min((g["version"] for g in gens), default=pipe.version)  # the oldest weights any generator serves
        metrics.update({
            "throughput/samples_per_s": samples / elapsed, "throughput/trained_tokens_per_s": tokens / elapsed,
            "throughput/gen_tokens_per_s": sum(g["tokens_per_s"] for g in gens),
            "sync/latency_s": pipe.sync.last.get("total_s", float("nan")),
            "version/generator": served, "version/lag": pipe.version - served,
            "carry/samples": float(sum(g["carried_samples"] for g in gens)),
            "carry/tokens": float(sum(g["carried_tokens"] for g in gens)),
            "carry/reprefill_tokens": float(sum(g["reprefill_tokens"] for g in gens)),
            "faults/restarts": float(sum(pipe.restarts)), "faults/requeued_groups": float(pipe.requeued_groups),
            **rejected_metrics(gens), **reward_metrics(gens, pipe),
        })
        if cfg.run.eval_every and cfg.task.eval_prompts and (step % cfg.run.eval_every == 0 or step == cfg.run.steps):
            await pipe.sync.wait()
            ev = await pipe.evaluate()
            eval_curve.append((step, ev["eval/reward"], ev["eval/reward_greedy"]))
            metrics.update(ev)
        if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0:
            metrics["checkpoint"] = str(await pipe.save_checkpoint(step))
        sink.log(step, metrics)
        sink.log_rollouts(step, trained_samples(pipe.last_batch, pipe.decode, cfg.run.log_rollouts, PAD_ID))
        progress.update(metrics)
    await pipe.sync.wait()
    evaluated = bool(eval_curve) and eval_curve[-1][0] == last
    if ended == "data" and cfg.run.eval_every and cfg.task.eval_prompts and last >= first_step and not evaluated:
        # the final model (the loop evaluates at run.steps, which end of data comes before): its own row
        ev = await pipe.evaluate()
        eval_curve.append((last, ev["eval/reward"], ev["eval/reward_greedy"]))
        sink.log(last, ev)
    elapsed = max(time.monotonic() - t_start, 1e-9)
    summary.update({"steps": last - first_step + 1, "ended": ended, "version": pipe.version, "elapsed_s": elapsed,
                    "collapsed_steps": watch.steps_collapsed,
                    "samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed, "eval_curve": eval_curve})
    return summary


async def run(cfg: Config, host: Any = None) -> dict:
    """The whole job. Returns a summary dict; raises RunError naming the loop that failed. On a
    failure or an interrupt a last checkpoint is written first (Pipeline.save_last_checkpoint)."""
    if cfg.run.resume == "latest":  # load_config resolves it; a Config built in code may not have
        cfg = prepare_resume(cfg)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    resume_step = read_marker(cfg.run.resume)["step"] if cfg.run.resume else None
    sink = MetricsSink(out, resume_step, cfg.run.wandb, dataclasses.asdict(cfg))  # resumed: rows past it dropped
    progress = None
    pipe = Pipeline(cfg, host)
    pipe.checkpoints.sweep()
    loops: set[asyncio.Task] = set()
    try:
        await pipe.start()
        first_step = (await pipe.resume(cfg.run.resume)) + 1 if cfg.run.resume else 1
        await pipe.start_generation()
        progress = Progress(cfg.run.steps - first_step + 1, cfg.run.progress, desc=f"rl[{cfg.run.mode}]")
        loops = {asyncio.create_task(_train_loop(pipe, sink, progress, first_step), name="train"),
                 asyncio.create_task(pipe.supervise(), name="supervisor")}
        done, pending = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        first = done.pop()
        if first.get_name() != "train":
            first.result()  # raises the supervisor's error
            raise RunError("the generator supervisor ended before training finished")
        summary = first.result()
        ckpt = out / "hf_checkpoint"
        await pipe.trainer.export_hf(str(ckpt))
        summary["checkpoint"] = str(ckpt)
        if cfg.trainer.lora.rank and cfg.trainer.lora.export_merged:  # adapters in ckpt/adapter; merged beside
            summary["checkpoint_merged"] = str(out / "hf_checkpoint_merged")
            await pipe.trainer.export_hf(summary["checkpoint_merged"], True)
        summary["stats"] = await pipe.stats()
        summary["restarts"] = list(pipe.restarts)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        return summary
    except BaseException as err:
        for t in loops:  # nothing may train or take a batch while the last checkpoint is written
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await pipe.save_last_checkpoint(err)  # never raises: the run's own error follows
        raise
    finally:  # nothing here raises over the run's own outcome: a failed step is logged
        if progress is not None:
            _quietly("closing the progress bar", progress.close)
        _quietly("closing the metrics sink", sink.close)
        await pipe.shutdown()
        if sink.path.exists() and sink.path.stat().st_size:
            _quietly("the summary plot", plot_summary, sink.path, out / "summary.png",
                     f"{cfg.task.name} ({cfg.run.mode})")


async def _settle(steps: dict[Any, Any], deadline: float, name: str = "{}") -> dict[Any, bool]:
    """Run shutdown steps (key -> awaitable) concurrently until all end or `deadline` (loop time);
    log each failure (the step named name.format(key)) and cancel what is late. Returns which steps
    succeeded, by key. Raises only the caller's own cancellation."""
    tasks = {asyncio.ensure_future(aw): key for key, aw in steps.items()}
    if not tasks:
        return {}
    try:
        done, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    for t in late:
        t.cancel()
        log.error("shutdown: %s still running at the shutdown's deadline; cancelled", name.format(tasks[t]))
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.warning("shutdown: %s failed: %s: %s", name.format(tasks[t]), type(t.exception()).__name__,
                        t.exception())
    return {key: t in done and not t.cancelled() and t.exception() is None for t, key in tasks.items()}


def _quietly(what: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("%s failed", what)

