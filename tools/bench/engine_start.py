"""vLLM CPU engine start: the engine core forked from the generator's process (this project's default)
against spawned (vLLM's CPU default), and the same engine's throughput both ways.

    .venv/bin/python -m tools.bench.engine_start                       # tiny model, 3 starts each way, ~3 min
    .venv/bin/python -m tools.bench.engine_start --reps 5 --config configs/smollm2-135m-add.yaml --out bench_out/es

Each start runs in a fresh process of its own, as a generator proc's does: it imports vLLM first (not
timed: the generator's proc does it either way), then times `start_llm` (the engine's arguments as a
run builds them, worker in the core), reads the engine core's CPU seconds once it is up (a spawned
core imports torch and vLLM again), then generates a fixed load (`--prompts` prompts of `--max-new`
tokens, EOS ignored, `--concurrency` in flight) for tokens/s. The two ways alternate, so drift on a
shared machine falls on both. Prints per way the median and range of start seconds, core CPU seconds
and tokens/s, and the ratios fork/spawn; writes engine_start.csv, .json and .png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.lib.report import engine_start_summary, plot_engine_start

WAYS = ("fork", "spawn")


def say(msg: str) -> None:
    print(f"[engine_start {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def one(way: str, config: str | None, prompts: int, max_new: int, concurrency: int) -> dict:
    """One start in this process, its core forked or spawned; returns its row."""
    import psutil
    import vllm.v1.engine.async_llm  # noqa: F401  (imported before the clock starts, as in a generator proc)
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pipeline.config import Config, GeneratorConfig, ModelConfig, load_config
    from pipeline.generator.llm import core_processes, engine_args, start_llm, stop_engine, worker_in_core
    from pipeline.models.hf import model_dir

    cfg = (load_config(config, [f"generator.concurrency={concurrency}"]) if config else
           Config(model=ModelConfig(), generator=GeneratorConfig(concurrency=concurrency, max_model_len=256)))
    hf_dir = model_dir(cfg.model)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.generator.kv_cache_gib)  # as the generator sets it
    t0 = time.monotonic()
    llm = start_llm(engine_args(cfg, hf_dir, seed=0), worker_in_core(cfg), fork=way == "fork")
    start_s = time.monotonic() - t0
    cores = [psutil.Process(p.pid) for p in core_processes(llm)]
    core_cpu = sum(sum(c.cpu_times()[:2]) for c in cores)
    sp = SamplingParams(max_tokens=max_new, temperature=1.0, ignore_eos=True, logprobs=0,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    sem = asyncio.Semaphore(concurrency)

    async def gen(engine, i: int) -> int:
        async with sem:
            last = None
            async for o in engine.generate({"prompt_token_ids": [1 + (i * 7 + k) % 50 for k in range(12)]}, sp,
                                        request_id=f"r{i}"):
                last = o
            return len(last.outputs[0].token_ids)

    async def load(engine) -> tuple[int, float]:
        await gen(engine, -1)  # warm-up
        t = time.monotonic()
        n = sum(await asyncio.gather(*(gen(engine, i) for i in range(prompts))))
        return n, time.monotonic() - t

    try:
        n, secs = asyncio.run(load(llm))
    finally:
        stop_engine(llm)
        del llm
    return {"start_s": start_s, "core_cpu_s": core_cpu, "tok_s": n / secs, "tokens": n}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.engine_start", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="starts per way")
    ap.add_argument("--config", default=None, help="a run config whose model to start (default: the tiny model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default="bench_out/engine_start")
    ap.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print("ROW " + json.dumps(one(a.one, a.config, a.prompts, a.max_new, a.concurrency)), flush=True)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rep in range(a.reps):
        for way in WAYS:
            cmd = [sys.executable, "-m", "tools.bench.engine_start", "--one", way, "--prompts", str(a.prompts),
                   "--max-new", str(a.max_new), "--concurrency", str(a.concurrency)]
            if a.config:
                cmd += ["--config", a.config]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            line = next((x for x in p.stdout.splitlines() if x.startswith("ROW ")), None)
            if p.returncode != 0 or line is None:
                print(p.stdout[-3000:] + p.stderr[-3000:], file=sys.stderr)
                say(f"{way} start {rep} failed (exit {p.returncode})")
                return 1
            rows.append({"way": way, "rep": rep, **json.loads(line[4:])})
            r = rows[-1]
            say(f"{way:5s} rep {rep}: start {r['start_s']:.1f} s, core CPU {r['core_cpu_s']:.1f} s, "
                f"{r['tok_s']:.0f} tok/s")
    s = engine_start_summary(rows)
    with open(out / "engine_start.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "engine_start.json").write_text(json.dumps({"rows": rows, "summary": s, "config": a.config or "tiny",
                                                       "cpu": _cpu()}, indent=2))
    plot_engine_start(rows, out / "engine_start.png")
    for way in WAYS:
        m = s[way]
        print(f"{way:5s}: start {m['start_s']['median']:.1f} s ({m['start_s']['min']:.1f}..{m['start_s']['max']:.1f}), "
              f"core CPU {m['core_cpu_s']['median']:.1f} s ({m['core_cpu_s']['min']:.1f}..{m['core_cpu_s']['max']:.1f}), "
              f"{m['tok_s']['median']:.0f} tok/s ({m['tok_s']['min']:.0f}..{m['tok_s']['max']:.0f})")
    r = s["ratio_fork_over_spawn"]
    print(f"fork/spawn: start {r['start_s']:.2f}x, core CPU {r['core_cpu_s']:.2f}x, tokens/s {r['tok_s']:.2f}x "
          f"({a.reps} starts each, medians; {out}/engine_start.png)")
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return f"unknown x{os.cpu_count()}"


if __name__ == "__main__":
    sys.exit(main())
