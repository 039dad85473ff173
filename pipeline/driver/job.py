"""Job: the roles of one run, built together, started together and stopped together.

    job = Job(cfg)                       # nothing starts yet; a bad task or reward model is a ConfigError
    await job.start()                    # trainer, warm start (a count), buffer, reward model, generators,
                                         # weight sync, warm start (auto: probes on the generators)
    await job.start_generation()
    ...                                  # TrainLoop(job, ...).step(), job.evaluation.evaluate(), ...
    await shut_down(job)                 # pipeline/driver/shutdown.py
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from monarch.actor import this_host

from actors.replay_buffer import ReplayBufferActor
from actors.trainer import Trainer
from pipeline.checkpoint import Checkpoints
from pipeline.cluster.roles import Roles
from pipeline.config import Config, ConfigError, sync_mode_config
from pipeline.driver.calls import RunError, call_within
from pipeline.driver.evaluation import Evaluation
from pipeline.driver.fleet import Fleet
from pipeline.driver.pool import Pool
from pipeline.driver.rewiring import RestartWiring
from pipeline.driver.supervisor import Supervisor
from pipeline.driver.warm_start import WarmReport, auto_warm_start, warm_start
from pipeline.models.hf import model_dir
from pipeline.placement import describe, generator_placements
from pipeline.reward_model import check_tokenizer
from pipeline.tasks import open_task, take
from pipeline.tokens import PromptError, SpecialTokens, encode_prompt, load_tokenizer
from pipeline.weightsync.sync import WeightSync

log = logging.getLogger(__name__)


async def all_settled(steps: dict[str, Any]) -> None:
    """Run start steps (name -> coroutine) concurrently and let every one end, then raise the first
    failure: a step is never cancelled halfway (what it started is registered for shut_down only
    when it returns or fails by itself)."""
    names = list(steps)
    results = await asyncio.gather(*steps.values(), return_exceptions=True)
    failed = [(n, r) for n, r in zip(names, results) if isinstance(r, BaseException)]
    for n, r in failed[1:]:
        log.warning("%s failed as well: %s: %s", n, type(r).__name__, r)
    if failed:
        raise failed[0][1]


class Job:
    """The handles and the shared state of one run: the trainer, the buffer, the fleet, the weight
    sync, the supervisor, the evaluation, and the trainer's version as this process knows it.

    Contract: construction checks what can be checked before any mesh starts (the task, the reward
    model's tokenizer) and starts nothing. `start` reads the checkpoint's tokenizer and special ids
    (`special`), checks that the task's first prompt becomes tokens with them (a ConfigError), then
    brings the meshes up: the trainer, the buffer, and at the same time the reward model and the
    generators (after the trainer's warm start when a fixed count of warm-start steps makes the weights
    they serve); the weight sync; run.warm_start_steps=auto, which needs the generators for
    its probes; no warm start on a resume; `warm` holds its report. A failure midway lets the other
    start end, then leaves what started for `shut_down`, which stops whatever is there.
    With `supervised` (the CLI job) the weight sync hands a member's failure to the supervisor (which
    must then run: `Supervisor.run`), else (a Session) a failed member fails the push itself: never a
    generator silently left on old weights. Only the TrainLoop and a resume advance `version`.

    Example:
        job = Job(cfg, supervised=True)
        await job.start()
        loop = TrainLoop(job, AsyncPublish(job), hooks)
        await asyncio.wait({asyncio.create_task(loop.run(1)), asyncio.create_task(job.supervisor.run())}, ...)
    """

    def __init__(self, cfg: Config, host: Any = None, supervised: bool = False, roles: Roles | None = None):
        self.cfg = sync_mode_config(cfg) if cfg.run.mode == "sync" else cfg
        self.host = host  # one host mesh for every role (this host, or torchrun's nodes) ...
        self.roles = roles  # ... or a host mesh per role (run.launcher=monarch; pipeline/cluster/roles.py)
        self.supervised = supervised
        self.version = 0
        self.requeued_groups = 0
        self.eval_curve: list[tuple[int, float, float]] = []  # (step, sampled, greedy); kept in checkpoints
        self.env_server = None  # task.openenv.serve=local: the run's OpenEnv server, up before the task opens
        if cfg.task.openenv.serve == "local":
            from pipeline.tasks.openenv_server import LocalServer
            oc = cfg.task.openenv
            sessions = oc.max_concurrent or 4 * cfg.generator.concurrency * cfg.generator.num_generators + 16
            self.placement: dict = {}

            def spawned(pid: int, port: int) -> None:  # placement.json's "openenv_server", kept current
                self.placement["openenv_server"] = {"pid": pid, "port": port, "restarts": self.env_server.restarts}
                if getattr(self, "fleet", None) is not None:
                    self.fleet.write_placement()
            self.env_server = LocalServer(self.cfg.task, cfg.run.out_dir, sessions, spawned)
            cfg.task.openenv.url = self.env_server.start()  # TaskError if it does not serve (exit 2)
        try:
            self._open(cfg)
        except BaseException:
            if self.env_server is not None:
                self.env_server.stop()
            raise

    def _open(self, cfg: Config) -> None:
        self.task = open_task(cfg.task, evaluate=bool(cfg.run.eval_every and cfg.task.eval_prompts))  # TaskError
        self.checkpoints = Checkpoints(cfg)  # the user's config (before sync_mode_config) is what a resume diffs
        if cfg.reward_model.path:  # before any mesh starts: a scorer that cannot read our tokens is a config error
            why = check_tokenizer(model_dir(cfg.model), cfg.reward_model.path)
            if why is not None:
                raise ConfigError(f"config: reward_model.path={cfg.reward_model.path!r} cannot be used: {why}")
        check_teacher(cfg, self.task)
        self.placement = getattr(self, "placement", {})  # every proc's, by role (placement.json)
        self.fleet = Fleet(self.cfg, self.placement)
        self.supervisor = Supervisor(self.cfg, self.fleet, RestartWiring(self))
        self.pool = Pool(self)  # generators added and removed while the run goes on
        self.stop_requested = False  # `python -m pipeline.control OUT_DIR stop`: end after the step in flight
        self.generating = False  # start_generation ran: a generator that joins starts generating too
        self.evaluation = Evaluation(self.cfg, self.task, self.fleet, self.supervisor.report)
        self.procs: list[Any] = []  # the trainer's and the buffer's proc meshes
        self.trainer: Any = None
        self.buffer: Any = None
        self.sync: WeightSync | None = None
        self.tokenizer: Any = None
        self.special: SpecialTokens | None = None  # the checkpoint's eos, pad and stop ids (pipeline/tokens.py)
        self.trainer_addr = "127.0.0.1"  # where generators reach trainer rank 0's host
        self.warm: WarmReport | None = None  # the warm start's report (None: none ran, or a resume)
        self.pinned: asyncio.Task | None = None  # held-out work on the served weights (run.eval_overlap)
        self.pinned_end = 0.0  # time.monotonic() when the last pinned work ended

    def pin(self, work: Any) -> None:
        """Run `work` (a coroutine that reads the generators' served weights: an eval, the pre-flight
        probe) beside training; the next push waits for it (`settle`), so it sees one version."""
        if self.pinned is not None and not self.pinned.done():
            raise RuntimeError("Job.pin: held-out work is already running on the served weights")
        self.pinned = asyncio.create_task(work, name="pinned")
        self.pinned.add_done_callback(lambda _: setattr(self, "pinned_end", time.monotonic()))

    async def settle(self) -> None:
        """Wait for the pinned work (raising its error); before any push, so the weights it reads stay."""
        t = self.pinned
        if t is not None:
            try:
                await t
            finally:
                self.pinned = None

    async def drop_pinned(self) -> None:
        """Cancel the pinned work and let it end (the run is failing or interrupted)."""
        t, self.pinned = self.pinned, None
        if t is not None and not t.done():
            t.cancel()
        if t is not None:
            await asyncio.gather(t, return_exceptions=True)

    async def start(self) -> None:
        cfg = self.cfg
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.generator.kv_cache_gib))
        if self.env_server is not None:  # a dead server is restarted; past its budget the run stops
            self.env_watch = asyncio.create_task(self.env_server.watch(lambda why: self.supervisor.report(None, why)),
                                                 name="openenv-server")
        if self.roles is None:  # an attached torchrun host mesh has a 'hosts' dim; this_host() none
            self.roles = Roles.one_mesh(cfg, self.host or this_host())
        roles = self.roles
        num_hosts = roles.trainer_hosts
        # Trainer rank 0, the buffer and this controller's meshes start on the trainer's host 0.
        remote = roles.remote_generators()
        if remote and cfg.weight_sync.transport == "shm":
            raise RunError(f"weight_sync.transport='shm' only reaches generators on trainer rank 0's host (host 0), "
                           f"but {', '.join(remote)} (generator.placement={cfg.generator.placement!r}, "
                           f"{num_hosts} trainer hosts): use weight_sync.transport=rdma (or collective)")
        if num_hosts > 1 and cfg.weight_sync.transport == "shm":  # every trainer rank sends its own shards
            raise RunError(f"weight_sync.transport='shm' needs every trainer rank on the generators' host, but the "
                           f"{cfg.trainer.num_ranks} trainer ranks run on all {num_hosts} hosts and each sends its "
                           "own shards: use weight_sync.transport=rdma (or collective)")
        # cores or GPUs too few for the generators of a host: a ConfigError (exit 2) before anything starts
        placements = generator_placements(cfg, roles.generator_host,
                                          0 if roles.apart else cfg.trainer.num_ranks // num_hosts)
        self.tokenizer = load_tokenizer(model_dir(cfg.model))
        self.special = SpecialTokens.of(self.tokenizer)
        self.check_prompts()

        t0 = time.monotonic()
        steps = cfg.run.warm_start_steps
        if steps != "auto" and steps and not cfg.run.resume:
            # the generators serve the warm-started weights as their version 0: they start after them
            await all_settled({"trainer start": self._start_trainer(roles),
                               "buffer start": self._start_buffer(roles)})
            warm = str(await warm_start(cfg, self.task, self.trainer, self.tokenizer, steps))
            self.warm = WarmReport(steps, f"run.warm_start_steps={steps}", "fixed")
            await self._start_fleet(roles, placements, warm)
        else:
            # nothing the generators load waits on the trainer: all come up at once (the vLLM engines'
            # start is the longest part of a job's start)
            await all_settled({"trainer start": self._start_trainer(roles),
                               "buffer start": self._start_buffer(roles),
                               "generators start": self._start_fleet(roles, placements, None)})
        self.sync = WeightSync(self.trainer, self.fleet.handles, cfg,
                               on_failure=self.supervisor.report if self.supervised else None)
        await self.sync.attach(self.trainer_addr)
        log.info("meshes up in %.1fs: trainer x%d, buffer, generators x%d (transport=%s)",
                 time.monotonic() - t0, cfg.trainer.num_ranks, len(self.fleet.generators), cfg.weight_sync.transport)
        if steps == "auto" and not cfg.run.resume:  # a resumed run continues from its checkpoint's weights
            self.warm = await auto_warm_start(cfg, self.task, self.trainer, self.tokenizer, self.fleet, self.evaluation)
            log.info(self.warm.line())

    async def _start_trainer(self, roles: Roles) -> None:
        log.info("starting trainer mesh (%d ranks over %d host(s))", self.cfg.trainer.num_ranks, roles.trainer_hosts)
        self.trainer = await Trainer.start(self.cfg, roles.trainer)  # every call below: all ranks, rank 0's answer
        self.procs.append(self.trainer.procs)
        self.trainer_addr = self.trainer.addr
        self.placement.update({p["role"]: p for p in self.trainer.placements})

    async def _start_buffer(self, roles: Roles) -> None:
        log.info("starting replay buffer (the trainer's host 0)")
        buffer_procs = roles.buffer.spawn_procs(per_host={"procs": 1})
        self.procs.append(buffer_procs)
        self.buffer = buffer_procs.spawn("buffer", ReplayBufferActor, self.cfg, self.special.pad)
        self.placement["buffer"] = await call_within("buffer setup", self.buffer.setup.call_one(), 60)
        log.info("placement: buffer (pid %d): %s", self.placement["buffer"]["pid"], describe(self.placement["buffer"]))

    async def _start_fleet(self, roles: Roles, placements: list, warm: str | None) -> None:
        log.info("starting %d generator(s) on %shosts %s; vLLM engines take a while to start",
                 self.cfg.generator.num_generators, "generator " if roles.apart else "", roles.generator_host)
        self.supervisor.install_fault_hook()
        await self.fleet.start(roles, placements, warm)

    def check_prompts(self) -> None:
        """The task's first prompt must become tokens for this checkpoint (messages need a chat
        template): a ConfigError before any mesh starts, rather than every group failing later."""
        for item in take(self.task, self.cfg.task.seed, "train", 1):
            try:
                encode_prompt(self.tokenizer, item.prompt, self.cfg.task.enable_thinking)
            except PromptError as e:
                raise ConfigError(f"config: task {self.cfg.task.name!r} cannot be used with model "
                                  f"{self.tokenizer.name_or_path}: its first prompt: {e}") from None

    async def start_generation(self) -> None:
        self.generating = True
        await call_within("generation start", asyncio.gather(
            *[s.handle.start_generation.call_one(self.buffer) for _, s in self.fleet.live_generators()]))

    async def add_generators(self, n: int) -> list[int]:
        """n more generators join while the run goes on (pipeline/driver/pool.py); their indices."""
        return await self.pool.add(n)

    async def remove_generator(self, i: int) -> dict:
        """Generator i leaves the run (drained or aborted by generator.on_update); its "removed" event."""
        return await self.pool.remove(i)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, as the generators decode completions (special tokens dropped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def stats(self) -> dict:
        """Every actor's stats now (a round trip each: for the summary and the Session, not per step)."""
        out = {"buffer": await call_within("buffer.stats", self.buffer.stats.call_one(), 60)}
        for i, s in self.fleet.live_generators():
            out[f"generator{i}"] = await call_within(f"generator{i}.stats", s.handle.stats.call_one(), 60)
        for side in self.fleet.sides():
            h = self.fleet.side_handle(side)
            if h is not None:
                out[side.name] = await call_within(f"{side.name}.stats", h.stats.call_one(), 60)
        return out


def check_teacher(cfg: Config, task: Any) -> None:
    """ConfigError, before any mesh starts, for a teacher that cannot read the student's token ids
    (one line naming both directories and the first difference) or a teacher.context that names a
    column the task's first train prompt does not have."""
    from pipeline.config.teacher import SELF
    from pipeline.tasks import take
    from pipeline.teacher import check_tokenizers

    tc = cfg.teacher
    if not tc.hf_dir:
        return
    if tc.hf_dir != SELF:
        from pipeline.models import ModelError, read_arch
        from pipeline.models.hf import check_weights

        try:
            read_arch(Path(tc.hf_dir))  # a family and fields this build supports
        except ModelError as e:
            raise ConfigError(f"config: teacher.hf_dir={tc.hf_dir!r} cannot be used: {e}") from None
        why = check_weights(Path(tc.hf_dir)) or check_tokenizers(model_dir(cfg.model), tc.hf_dir)
        if why is not None:
            raise ConfigError(f"config: teacher.hf_dir={tc.hf_dir!r} cannot teach model.hf_dir="
                              f"{str(Path(model_dir(cfg.model)).resolve())!r}: {why}")
    if tc.context:
        item = take(task, cfg.task.seed, "train", 1)[0]
        try:
            tc.context.format(**item.fields())
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"config: teacher.context={tc.context!r} cannot be filled from the task's prompts: "
                              f"{type(e).__name__}: {e} (they have: {', '.join(sorted(item.fields()))})") from None
