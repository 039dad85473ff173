"""Generation stall per weight update against model size, with shadow weights on and off.

    .venv/bin/python -m tools.bench.stall_bench --sizes tiny,100m --reps 5     # ~3 min
    .venv/bin/python -m tools.bench.stall_bench --sizes qwen3-0.6b --reps 3    # ~5 min; ~6 GB RAM
    .venv/bin/python -m tools.bench.stall_bench --plot docs/results/img/shadow_stall.png   # no run: table + plot of --out

One vLLM engine per size (CPU, enforce_eager, prefix caching off, as a generator with
on_update=keep builds it) with 4 long requests decoding; per rep a version is pushed over shm and
applied as a `keep` update applies it (pipeline/generator/gate.py): pause(keep) -> load -> label ->
resume. Shadow off: the load is today's layerwise reload of the served model, paused. Shadow on
(generator.shadow_weights): the version first loads into the worker's second copy while the requests
decode (weightsync/shadow_load.load_shadow), then the pause holds only the swap.
Per rep: `stall` = from the keep pause taking effect to resume returning (no engine step runs
meanwhile); `gap` = the longest interval between two outputs of a running request that overlaps
the update (what a request sees, pause included); `step` = the median interval before the update;
`load` = the load's wall time (shadow on: in the background); `load_step` = the median interval
while the shadow load runs (its cost to generation). Results per size accumulate in --out/results.json,
so sizes can run in separate invocations; every run rewrites the table and the plot from all of them.

Sizes: tiny (the tests' checkpoint), 100m (768-wide, 12 layers, character vocabulary, ~76M params,
fp32), qwen3-0.6b (Qwen3-0.6B's shapes, bf16, random weights; pipeline/models/qwen3_checkpoint.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from pipeline.config import WeightSyncConfig
from pipeline.weightsync import (WeightReceiver, WeightSender, load_into_vllm, load_shadow,
                                 swap_into_vllm, vllm_engine_kwargs)
from pipeline.weightsync.load import pause_keep

SIZES = ("tiny", "100m", "qwen3-0.6b")


def model_dir(size: str) -> tuple[str, str, int]:
    """(checkpoint dir, dtype, context length) of a size, built locally once."""
    if size == "qwen3-0.6b":
        from pipeline.models.qwen3_checkpoint import ensure_checkpoint, qwen3_config
        return str(ensure_checkpoint(qwen3_config(), seed=0)), "bfloat16", 1024
    from pipeline.models.tiny import TinySpec, ensure_tiny
    tiny = TinySpec(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048) if size == "100m" else TinySpec()
    return str(ensure_tiny(tiny)), "float32", 256


def state_dict(hf_dir: str) -> dict:
    """What the trainer pushes: the checkpoint's tensors under HF names, a tied lm_head left out."""
    from pipeline.models.hf import load_hf_state_dict
    sd = load_hf_state_dict(Path(hf_dir))
    if json.loads((Path(hf_dir) / "config.json").read_text()).get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    return sd


class Busy:
    """Long requests decoding, each output's arrival time recorded."""

    def __init__(self, llm, n: int, max_tokens: int) -> None:
        from vllm import SamplingParams
        self.arrivals: list[list[float]] = [[] for _ in range(n)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        tag = os.urandom(3).hex()

        async def one(i: int) -> None:
            async for _ in llm.generate({"prompt_token_ids": [5, 6, 7, 8 + i]}, sp, request_id=f"busy{tag}-{i}"):
                self.arrivals[i].append(time.monotonic())
        self.tasks = [asyncio.ensure_future(one(i)) for i in range(n)]

    async def decoding(self, tokens: int) -> None:
        """Until every request has `tokens` outputs (a finished one raises: its runway was too short)."""
        while min(len(a) for a in self.arrivals) < tokens:
            done = [t for t in self.tasks if t.done()]
            if done:
                raise RuntimeError(f"stall_bench: a busy request ended after {min(len(a) for a in self.arrivals)} "
                                   f"outputs ({done[0].exception()!r}); the update outlasted its runway")
            await asyncio.sleep(0.005)  # the requests' own outputs arrive on this loop

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def gap(self, t0: float, t1: float) -> float:
        """The longest interval between two outputs of one request that overlaps [t0, t1]."""
        return max((b - a for arr in self.arrivals for a, b in zip(arr, arr[1:]) if b >= t0 and a <= t1),
                   default=float("nan"))

    def step(self, t0: float, t1: float) -> float:
        """Median interval between outputs inside [t0, t1]."""
        d = [b - a for arr in self.arrivals for a, b in zip(arr, arr[1:]) if a >= t0 and b <= t1]
        return statistics.median(d) if d else float("nan")


async def run_size(size: str, reps: int) -> list[dict]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from pipeline.generator.llm import start_llm

    from pipeline.generator.llm import stop_engine

    hf_dir, dtype, max_len = model_dir(size)
    sd = state_dict(hf_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    llm = start_llm(AsyncEngineArgs(
        model=hf_dir, dtype=dtype, enforce_eager=True, max_model_len=max_len, enable_prefix_caching=False, seed=0,
        **vllm_engine_kwargs()))
    sender = WeightSender(WeightSyncConfig(transport="shm", bucket_mb=64, timeout_s=600), sd, num_receivers=1)
    receiver = WeightReceiver(sender.handle(), rank=0)
    rows, version = [], 0
    try:
        for shadow in (False, True):
            for rep in range(reps + 1):  # the first is a warm-up (shadow on: it allocates the copy)
                version += 1
                await asyncio.gather(sender.push(sd, version), receiver.pull(version))
                busy = Busy(llm, 4, max_len - 8)
                await busy.decoding(5)
                tl0 = time.monotonic()
                if shadow:
                    await load_shadow(llm, receiver, version, 600)
                tl1 = time.monotonic()
                await pause_keep(llm)
                t1 = time.monotonic()  # no engine step runs from here until resume returns
                load = swap_into_vllm if shadow else load_into_vllm
                await load(llm, receiver, version, 600)
                t2 = time.monotonic()
                await llm.resume_generation()
                t3 = time.monotonic()
                n = min(len(a) for a in busy.arrivals)
                await busy.decoding(n + 3)
                await busy.stop()
                assert await llm.get_weight_version() == str(version)
                if rep:
                    rows.append(dict(size=size, shadow=shadow, rep=rep, bytes=receiver.plan.total_bytes,
                                     load_s=(tl1 - tl0) if shadow else (t2 - t1), stall_s=t3 - t1,
                                     gap_s=busy.gap(tl1, t3), step_s=busy.step(0, tl0),
                                     load_step_s=busy.step(tl0, tl1) if shadow else float("nan")))
                    r = rows[-1]
                    print(f"{size} shadow={'on' if shadow else 'off'} rep {rep}: load {r['load_s'] * 1e3:.1f} ms, "
                          f"stall {r['stall_s'] * 1e3:.2f} ms, gap {r['gap_s'] * 1e3:.1f} ms "
                          f"(step {r['step_s'] * 1e3:.1f} ms)", flush=True)
    finally:
        receiver.close()
        sender.close()
        stop_engine(llm)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for size in [s for s in SIZES if any(r["size"] == s for r in rows)]:
        for shadow in (False, True):
            rs = [r for r in rows if r["size"] == size and r["shadow"] == shadow]
            if not rs:
                continue
            agg = {"size": size, "shadow": shadow, "n": len(rs), "mb": rs[0]["bytes"] / 1e6}
            for k in ("load_s", "stall_s", "gap_s", "step_s", "load_step_s"):
                vals = [r[k] for r in rs]
                agg[k] = statistics.median(vals)
                agg[k + "_min"], agg[k + "_max"] = min(vals), max(vals)
            ratios = [r["stall_s"] / r["load_s"] for r in rs]
            agg["ratio"], agg["ratio_min"], agg["ratio_max"] = statistics.median(ratios), min(ratios), max(ratios)
            out.append(agg)
    return out


def report(rows: list[dict], plot: Path) -> str:
    s = summarize(rows)
    ms = lambda a, k: f"{a[k] * 1e3:.2f} ({a[k + '_min'] * 1e3:.2f}–{a[k + '_max'] * 1e3:.2f})"  # noqa: E731
    lines = ["| model | MB pushed | shadow | reps | load ms | stall ms | stall / load | longest output gap ms | "
             "step ms before | step ms during shadow load |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a in s:
        during = ms(a, "load_step_s") if a["shadow"] else "–"
        lines.append(f"| {a['size']} | {a['mb']:.0f} | {'on' if a['shadow'] else 'off'} | {a['n']} | {ms(a, 'load_s')} | "
                     f"{ms(a, 'stall_s')} | {a['ratio']:.3f} ({a['ratio_min']:.3f}–{a['ratio_max']:.3f}) | "
                     f"{ms(a, 'gap_s')} | {ms(a, 'step_s')} | {during} |")
    lines.append("")
    lines.append("Median (min–max) over the reps. stall: keep pause in effect until resume returns.")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for shadow, style in ((False, "s-"), (True, "o-")):
        a = [x for x in s if x["shadow"] == shadow]
        if not a:
            continue
        label = "shadow on" if shadow else "shadow off"
        ax.errorbar([x["mb"] for x in a], [x["stall_s"] * 1e3 for x in a], fmt=style, capsize=3,
                    yerr=[[(x["stall_s"] - x["stall_s_min"]) * 1e3 for x in a],
                          [(x["stall_s_max"] - x["stall_s"]) * 1e3 for x in a]], label=f"stall, {label}")
        ax.plot([x["mb"] for x in a], [x["load_s"] * 1e3 for x in a], style, alpha=0.35, label=f"load, {label}")
    ax.axhline(5, ls="--", c="k", lw=0.8, label="5 ms goal")
    ax.set(xscale="log", yscale="log", xlabel="MB pushed (model size)", ylabel="ms",
           title="Generation stall per keep update (vLLM CPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=120)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="", help=f"comma list of {', '.join(SIZES)}; none: report only")
    ap.add_argument("--reps", type=int, default=5, help="timed reps per mode after one warm-up")
    ap.add_argument("--out", default="bench_out/stall_bench")
    ap.add_argument("--plot", default="", help="PNG path (default --out/stall.png)")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"stall_bench: --sizes: unknown {bad}; known: {', '.join(SIZES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "results.json"
    rows = json.loads(store.read_text()) if store.is_file() else []
    for size in sizes:
        new = asyncio.run(run_size(size, args.reps))
        rows = [r for r in rows if r["size"] != size] + new
        store.write_text(json.dumps(rows, indent=1))
    table = report(rows, Path(args.plot) if args.plot else out / "stall.png")
    (out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
