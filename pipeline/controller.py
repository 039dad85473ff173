"""Controller: spawns the generator, buffer and trainer meshes and runs the supervised loops.

    pipe = Pipeline(cfg)                 # nothing starts yet
    await pipe.start()                   # proc meshes, actors, engines, weight-sync wiring
    metrics = await pipe.step()          # one batch -> one optimizer step -> version + 1 -> push
    await pipe.shutdown()                # close -> cancel -> stop every proc mesh

`run(cfg)` composes these into the job: generation runs inside the generator actors (CoPRIS fixed
concurrency, pulling admitted groups from the buffer); the training loop here waits for a batch,
trains and hands version v to `pipe.sync` (pipeline/weightsync/sync.py, which owns the push
protocol for every transport). A health loop watches every actor; the first loop that fails stops
the run with its error, and shutdown always stops every proc mesh (Ctrl-C included).

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
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import Config
from pipeline.metrics import MetricsSink, Progress, plot_summary
from pipeline.model import EOS_ID, PAD_ID, load_tokenizer, model_dir
from pipeline.tasks import load_task, take
from pipeline.weightsync.sync import WeightSync

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 600.0
HEALTH_PERIOD_S = 2.0
EVAL_SAMPLES = 4


class RunError(RuntimeError):
    """A loop or an actor failed; the message names which and why."""


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
        self.task = load_task(cfg.task.name)

    # ------------------------------------------------------------------ start / stop

    async def start(self) -> None:
        from monarch.actor import this_host

        from actors.generator import GeneratorActor
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
        self.hf_dir = model_dir(cfg.model)
        self.tokenizer = load_tokenizer(self.hf_dir)

        t0 = time.monotonic()
        log.info("starting trainer mesh (%d ranks over %d host(s))", cfg.trainer.num_ranks, self.num_hosts)
        self.trainer = await Trainer.start(cfg, host)  # every call below: all ranks, rank 0's answer
        self._procs.append(self.trainer.procs)
        self.trainer_addr = self.trainer.addr  # where other hosts reach trainer rank 0's host
        if cfg.run.warm_start_steps and not cfg.run.resume:
            await self.warm_start(cfg.run.warm_start_steps)

        log.info("starting replay buffer (host 0) and %d generator(s) on hosts %s; vLLM engines take a while to start",
                 cfg.generator.num_generators, self.generator_hosts)
        buffer_procs = self._spawn(host, 0)
        self.buffer = buffer_procs.spawn("buffer", ReplayBufferActor, cfg, PAD_ID)
        gen_cfg = cfg if not hasattr(self, "warm_dir") else dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, hf_dir=str(self.warm_dir)))
        self.generators = []
        for i, h in enumerate(self.generator_hosts):
            procs = self._spawn(host, h)
            self.generators.append(procs.spawn(f"generator{i}", GeneratorActor, gen_cfg, i))
        await timed("generator setup", asyncio.gather(*[g.setup.call_one() for g in self.generators]),
                    cfg.generator.start_timeout_s)
        self.sync = WeightSync(self.trainer, self.generators, cfg)
        await self.sync.attach(self.trainer_addr)
        log.info("meshes up in %.1fs: trainer x%d, buffer, generators x%d (transport=%s)",
                 time.monotonic() - t0, cfg.trainer.num_ranks, len(self.generators), cfg.weight_sync.transport)

    def _spawn(self, host: Any, index: int):
        """One proc on host `index` of the job (`spawn_procs` on a whole host mesh spawns on every host)."""
        if "hosts" in host.sizes:
            host = host.slice(hosts=index)
        procs = host.spawn_procs(per_host={"procs": 1})
        self._procs.append(procs)
        return procs

    async def start_generation(self) -> None:
        await timed("generation start", asyncio.gather(*[g.start_generation.call_one(self.buffer) for g in self.generators]))

    async def shutdown(self) -> None:
        """close -> cancel -> stop: ends generation, then stops every proc mesh (never raises)."""
        if self.sync is not None:
            self.sync.cancel()
            with contextlib.suppress(BaseException):
                await self.sync.wait()
        for g in getattr(self, "generators", []):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(g.shutdown.call_one(), 60)
        for procs in reversed(self._procs):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(procs.stop(), 60)
        self._procs.clear()

    # ------------------------------------------------------------------ steps

    async def warm_start(self, steps: int) -> dict:
        """Supervised warm start on task demonstrations (reported as such), exported for the generators."""
        if self.task.demonstration is None:
            raise RunError(f"run.warm_start_steps={steps} but task {self.task.name} has no demonstration()")
        items = iter(self.task.prompts(self.cfg.task.seed + 7919, "train"))
        n = self.cfg.buffer.batch_groups * self.cfg.buffer.group_size
        loss = float("nan")
        for _ in range(steps):
            ids, mask = self.demo_batch([next(items) for _ in range(n)])
            loss = (await self.trainer.sft_step(ids, mask))["loss"]
        self.warm_dir = Path(self.cfg.run.out_dir) / "warm_start"
        await self.trainer.export_hf(str(self.warm_dir))
        log.info("warm start: %d supervised steps on demonstrations, final loss %.4f", steps, loss)
        return {"warm_start/loss": loss, "warm_start/steps": steps}

    def demo_batch(self, items) -> tuple[torch.Tensor, torch.Tensor]:
        seqs, masks = [], []
        for it in items:
            p = self.tokenizer(it.prompt)["input_ids"]
            c = self.tokenizer(self.task.demonstration(it))["input_ids"] + [EOS_ID]
            seqs.append(p + c)
            masks.append([0.0] * len(p) + [1.0] * len(c))
        t = max(map(len, seqs))
        ids = torch.tensor([s + [PAD_ID] * (t - len(s)) for s in seqs])
        mask = torch.tensor([m + [0.0] * (t - len(m)) for m in masks])
        return ids, mask

    async def train_once(self) -> dict:
        """Wait for a batch, take one optimizer step: version + 1 on the trainer (not yet announced)."""
        cfg = self.cfg
        t0 = time.monotonic()
        batch = await timed("buffer.get_batch", self.buffer.get_batch.call_one(self.version, cfg.buffer.batch_timeout_s),
                            cfg.buffer.batch_timeout_s + 30)
        t1 = time.monotonic()
        if cfg.generator.carry_over == "save":  # CoPRIS stage end: in-flight rollouts become partials
            await timed("end_stage", asyncio.gather(*[g.end_stage.call_one("save", True) for g in self.generators]),
                        cfg.generator.request_timeout_s)
        metrics = await self.trainer.train_step(batch)
        self.version += 1
        stale = batch.staleness().float()
        t2 = time.monotonic()
        metrics.update({
            "reward/mean": float(batch.rewards.mean()), "staleness/mean": float(stale.mean()),
            "staleness/max": float(stale.max()), "version/trainer": self.version, "time/batch_wait_s": t1 - t0,
            "time/train_s": t2 - t1, "trainer/idle_frac": (t1 - t0) / max(t2 - t0, 1e-9),
            "batch/tokens": batch.num_tokens,
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
        """Trainer state (DCP) plus the buffer's counters and prompt position, after the last push landed."""
        await self.sync.wait()
        path = Path(self.cfg.run.out_dir) / "checkpoints" / f"step_{step}"
        await self.trainer.save(str(path), {"step": step})
        buf = await timed("buffer.state_dict", self.buffer.state_dict.call_one())
        torch.save({"step": step, "version": self.version, "buffer": buf}, path / "controller_state.pt")
        return path

    async def resume(self, path: str) -> int:
        """Restore a checkpoint before generation starts; generators get its weights as its version."""
        state = torch.load(Path(path) / "controller_state.pt", weights_only=False)
        await self.trainer.load(path)
        self.version = await self.trainer.version()
        if self.version != state["version"]:
            raise RunError(f"checkpoint {path}: trainer version {self.version} != saved {state['version']}")
        await timed("buffer.load_state_dict", self.buffer.load_state_dict.call_one(state["buffer"]))
        if self.version:
            await self.push_weights()
        log.info("resumed from %s at step %d (version %d)", path, state["step"], self.version)
        return int(state["step"])

    async def evaluate(self) -> dict[str, float]:
        """Held-out prompts on generator 0, scored by the task's reward: `eval/reward` samples
        EVAL_SAMPLES completions per prompt at the training temperature (the policy's expected reward,
        what RL optimises); `eval/reward_greedy` is the greedy completion's reward."""
        items = take(self.task, self.cfg.task.seed, "eval", self.cfg.task.eval_prompts)
        prompts = [i.prompt for i in items]
        gen, n = self.generators[0], self.cfg.generator.max_new_tokens
        greedy = await timed("generate_eval", gen.generate_eval.call_one(prompts, n))
        sampled = await timed("generate_eval", gen.generate_eval.call_one(
            prompts * EVAL_SAMPLES, n, self.cfg.generator.temperature, self.cfg.task.seed))
        score = lambda outs: sum(self.task.reward(p, o) for p, o in zip(prompts * EVAL_SAMPLES, outs)) / max(len(outs), 1)
        return {"eval/reward": score(sampled), "eval/reward_greedy": score(greedy)}

    async def stats(self) -> dict:
        out = {"buffer": await timed("buffer.stats", self.buffer.stats.call_one(), 60)}
        for i, g in enumerate(self.generators):
            out[f"generator{i}"] = await timed(f"generator{i}.stats", g.stats.call_one(), 60)
        return out


def buffer_metrics(buf: dict) -> dict[str, float]:
    """The buffer's per-step metrics: Δ, drops and wasted tokens (every mode reports them)."""
    return {"buffer/delta": float(buf["delta"]), "buffer/dropped_samples": float(buf["dropped_samples"]),
            "buffer/wasted_tokens": float(buf["wasted_tokens"]), "buffer/held_samples": float(buf["held_samples"])}


# ---------------------------------------------------------------------- the job


async def _health_loop(pipe: Pipeline) -> None:
    """Heartbeat every actor; a generator whose loop died, or an actor that stops answering, ends the run."""
    while True:
        await asyncio.sleep(HEALTH_PERIOD_S)
        for i, g in enumerate(pipe.generators):
            st = await timed(f"generator{i}.stats (health)", g.stats.call_one(), 120)
            if st.get("error"):
                raise RunError(f"generator{i} failed: {st['error']}")


async def _train_loop(pipe: Pipeline, sink, progress: Progress, first_step: int = 1) -> dict:
    cfg = pipe.cfg
    summary: dict[str, Any] = {}
    eval_curve: list[tuple[int, float, float]] = []
    if cfg.run.eval_every and cfg.task.eval_prompts:
        ev = await pipe.evaluate()
        eval_curve.append((first_step - 1, ev["eval/reward"], ev["eval/reward_greedy"]))
        sink.log(first_step - 1, ev)
    t_start = time.monotonic()
    samples = tokens = 0
    for step in range(first_step, cfg.run.steps + 1):
        metrics = await pipe.step()
        samples += int(metrics.get("samples", cfg.buffer.batch_groups * cfg.buffer.group_size))
        tokens += int(metrics["batch/tokens"])
        elapsed = time.monotonic() - t_start
        gens = await timed("generator stats", asyncio.gather(*[g.stats.call_one() for g in pipe.generators]), 60)
        served = min(g["version"] for g in gens)  # the oldest weights any generator serves
        metrics.update({
            "throughput/samples_per_s": samples / elapsed, "throughput/trained_tokens_per_s": tokens / elapsed,
            "throughput/gen_tokens_per_s": sum(g["tokens_per_s"] for g in gens),
            "sync/latency_s": pipe.sync.last.get("total_s", float("nan")),
            "version/generator": served, "version/lag": pipe.version - served,
            "carry/samples": float(sum(g["carried_samples"] for g in gens)),
            "carry/tokens": float(sum(g["carried_tokens"] for g in gens)),
            "carry/reprefill_tokens": float(sum(g["reprefill_tokens"] for g in gens)),
        })
        if cfg.run.eval_every and cfg.task.eval_prompts and (step % cfg.run.eval_every == 0 or step == cfg.run.steps):
            await pipe.sync.wait()
            ev = await pipe.evaluate()
            eval_curve.append((step, ev["eval/reward"], ev["eval/reward_greedy"]))
            metrics.update(ev)
        if cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0:
            metrics["checkpoint"] = str(await pipe.save_checkpoint(step))
        sink.log(step, metrics)
        progress.update(metrics)
    await pipe.sync.wait()
    elapsed = max(time.monotonic() - t_start, 1e-9)
    summary.update({"steps": cfg.run.steps - first_step + 1, "version": pipe.version, "elapsed_s": elapsed,
                    "samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed, "eval_curve": eval_curve})
    return summary


async def run(cfg: Config, host: Any = None) -> dict:
    """The whole job. Returns a summary dict; raises RunError naming the loop that failed."""
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sink = MetricsSink(out)
    progress = None
    pipe = Pipeline(cfg, host)
    try:
        await pipe.start()
        first_step = (await pipe.resume(cfg.run.resume)) + 1 if cfg.run.resume else 1
        await pipe.start_generation()
        progress = Progress(cfg.run.steps - first_step + 1, cfg.run.progress, desc=f"rl[{cfg.run.mode}]")
        loops = {asyncio.create_task(_train_loop(pipe, sink, progress, first_step), name="train"),
                 asyncio.create_task(_health_loop(pipe), name="health")}
        done, pending = await asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        first = done.pop()
        if first.get_name() != "train":
            first.result()  # raises the health loop's error
            raise RunError("health loop ended before training finished")
        summary = first.result()
        ckpt = out / "hf_checkpoint"
        await pipe.trainer.export_hf(str(ckpt))
        summary["checkpoint"] = str(ckpt)
        summary["stats"] = await pipe.stats()
        return summary
    finally:
        if progress is not None:
            progress.close()
        sink.close()
        await pipe.shutdown()
        if sink.path.exists() and sink.path.stat().st_size:
            plot_summary(sink.path, out / "summary.png", title=f"{cfg.task.name} ({cfg.run.mode})")

