"""Reward latency after EOS and generator idle time: streaming prefill vs score-at-end (OPPO).

    .venv/bin/python -m tools.bench.reward_bench                      # chunks 0 (score at end), 8, 16, 32, 64
    .venv/bin/python -m tools.bench.reward_bench --chunks 0,16 --waves 3 --tokens 96 --quick

The real path of a run: a GeneratorCore (vLLM AsyncLLM on the tiny policy) generates waves of
--groups prompt groups, and each finished rollout is scored by a reward model on its own Monarch
proc through the generators' client (pipeline/generator/reward_client.py). With chunk size c > 0 the tokens
go to the reward model as they are sampled, c at a time, and are prefilled there on the sequence's
cache; with c = 0 the whole sequence is prefilled after EOS. The reward model is a scorer larger
than the policy (--rm-dim, --rm-layers; random weights: only its cost matters here), so its
prefill is what a reward model costs. The policy's engine and this process run on core 0, the
reward model on core 1 (disjoint, as reward_model.cpus would place them).

Per wave (a synchronous step's generation: every rollout of the wave finished and scored):
- latency after EOS: from a rollout's final output to its reward (median and p90 over rollouts);
- tail: from the wave's last EOS to its last reward, when the generator has nothing left to do;
- generator idle fraction: tail / wave time.
Modes alternate within each repeat. Writes results.csv, results.json, table.md and reward_bench.png
to --out, and prints the table with each streaming mode's latency as a fraction of score-at-end's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from pathlib import Path

from pipeline.config import Config, GeneratorConfig, ModelConfig, RewardModelConfig, TaskConfig
from pipeline.driver.metrics import write_csv
from pipeline.types import PromptGroup

GROUP_IDS = itertools.count()


class WaveSource:
    """A wave's groups in, its rollouts out (with arrival times)."""

    def __init__(self, items, group_size: int):
        self.items, self.g = list(items), group_size
        self.arrivals: list[float] = []

    async def admit(self, wait_s: float):
        if not self.items:
            await asyncio.sleep(min(wait_s, 0.02))
            return None
        return PromptGroup(next(GROUP_IDS), self.items.pop(0), self.g, admitted_version=0)

    async def add(self, rollout) -> None:
        self.arrivals.append(time.monotonic())

    async def release(self, group_id: int) -> bool:
        raise RuntimeError(f"group {group_id} failed: {self}")


def scorer_dir(dim: int, layers: int, out: Path) -> Path:
    from pipeline.models.tiny import TinySpec, ensure_tiny
    from pipeline.reward_model import init_scorer

    body = ensure_tiny(TinySpec(dim=dim, n_layers=layers, n_heads=max(dim // 64, 1), n_kv_heads=max(dim // 128, 1),
                                ffn_dim=dim * 3))
    path = out / f"scorer_{dim}x{layers}"
    if not (path / "config.json").exists():
        init_scorer(body, path)
    return path


async def bench(args, out: Path) -> list[dict]:
    from monarch.actor import this_host

    import transformers

    from actors.reward_model import RewardModelActor
    from pipeline.generator.core import GeneratorCore
    from pipeline.tasks import take

    from pipeline import logs

    logs.configure("warning")  # vLLM's INFO lines (before the engine starts: it inherits the level)
    transformers.utils.logging.set_verbosity_error()
    cores = sorted(os.sched_getaffinity(0))
    gen_core, rm_core = (cores[0], cores[1]) if len(cores) > 1 else (cores[0], cores[0])
    rm_path = scorer_dir(args.rm_dim, args.rm_layers, out)
    from pipeline.models.tiny import ensure_tiny

    cfg = Config(model=ModelConfig(hf_dir=str(ensure_tiny())),
                 generator=GeneratorConfig(concurrency=args.groups * args.group_size, max_new_tokens=args.tokens,
                                           ignore_eos=True, max_model_len=args.tokens + 64, start_timeout_s=300),
                 task=TaskConfig(name="pipeline.tasks.reverse"),
                 reward_model=RewardModelConfig(path=str(rm_path), timeout_s=300, cpus=str(rm_core)))
    os.sched_setaffinity(0, {gen_core})  # this process and the engine core it starts
    procs = this_host().spawn_procs(per_host={"procs": 1})
    rows: list[dict] = []
    eng = None
    try:
        rm = procs.spawn("rm_bench", RewardModelActor, cfg, 0)
        info = await asyncio.wait_for(rm.setup.call_one(), 300)
        print(f"reward model {rm_path.name} on core {rm_core} (loaded in {info['load_s']:.1f}s); "
              f"policy engine on core {gen_core}", flush=True)
        eng = GeneratorCore(cfg, 0)
        await eng.start_engine()
        eng.attach_reward_model(rm, "bench/")
        items = take(eng.episodes.task, 0, "train", 10_000)
        total = args.repeats * len(args.chunks) * (args.waves + 1)
        k = 0
        for rep in range(args.repeats):
            for c in (args.chunks if rep % 2 == 0 else list(reversed(args.chunks))):
                eng.episodes.rm.chunk = c  # one engine for every mode (a start each would cost 15-45 s): set per block
                for w in range(args.waves + 1):  # the first wave of each block warms up and is not kept
                    k += 1
                    src = WaveSource(items[:args.groups], args.group_size)
                    items = items[args.groups:]
                    n = args.groups * args.group_size
                    eng.stats.reward_latency_s.clear()
                    t0 = time.monotonic()
                    eng.begin_stage(src)
                    while len(src.arrivals) < n:
                        eng.check()
                        if time.monotonic() - t0 > 600:
                            raise TimeoutError(f"wave of {n} rollouts not done in 600s")
                        await asyncio.sleep(0.005)
                    await eng.end_stage(60)
                    lat = list(eng.stats.reward_latency_s)
                    eos = [a - x for a, x in zip(src.arrivals, lat)]
                    t_end = max(src.arrivals)
                    row = {"chunk": c, "repeat": rep, "wave": w, "rollouts": n, "wave_s": t_end - t0,
                           "latency_median_s": statistics.median(lat),
                           "latency_p90_s": sorted(lat)[int(0.9 * (len(lat) - 1))],
                           "tail_s": t_end - max(eos), "idle_frac": (t_end - max(eos)) / (t_end - t0)}
                    print(f"[{k}/{total}] chunk {c:>3} rep {rep} wave {w}: latency {row['latency_median_s'] * 1e3:7.1f} ms"
                          f" (p90 {row['latency_p90_s'] * 1e3:.1f}), tail {row['tail_s'] * 1e3:7.1f} ms, "
                          f"idle {row['idle_frac']:.1%} of {row['wave_s']:.2f}s", flush=True)
                    if w > 0:
                        rows.append(row)
        rows_stats = await rm.stats.call_one()
        print(f"reward model: {rows_stats['prefill_tokens']} tokens prefilled while decoding, "
              f"{rows_stats['finish_tokens']} after EOS on streams, {rows_stats['whole_tokens']} scored whole", flush=True)
    finally:
        if eng is not None:
            await eng.close()
        await asyncio.wait_for(procs.stop(), 60)
    return rows


def summarize(rows: list[dict], chunks: list[int]) -> list[dict]:
    out = []
    for c in chunks:
        r = [x for x in rows if x["chunk"] == c]
        med = {k: statistics.median(x[k] for x in r) for k in ("latency_median_s", "latency_p90_s", "tail_s",
                                                                 "idle_frac", "wave_s")}
        spread = {k: (min(x[k] for x in r), max(x[k] for x in r)) for k in ("latency_median_s", "idle_frac")}
        out.append({"chunk": c, "waves": len(r), **med, "latency_min_s": spread["latency_median_s"][0],
                    "latency_max_s": spread["latency_median_s"][1], "idle_min": spread["idle_frac"][0],
                    "idle_max": spread["idle_frac"][1]})
    base = next((s for s in out if s["chunk"] == 0), None)
    for s in out:
        s["latency_vs_end"] = s["latency_median_s"] / base["latency_median_s"] if base else float("nan")
        s["tail_vs_end"] = s["tail_s"] / base["tail_s"] if base else float("nan")
    return out


def table(summary: list[dict]) -> str:
    lines = ["| chunk tokens | latency after EOS, median (min..max over waves) | p90 | vs score-at-end | "
             "wave tail after last EOS | generator idle (min..max) | wave |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        name = "0 (score at end)" if s["chunk"] == 0 else str(s["chunk"])
        lines.append(f"| {name} | {s['latency_median_s'] * 1e3:.1f} ms ({s['latency_min_s'] * 1e3:.1f}.."
                     f"{s['latency_max_s'] * 1e3:.1f}) | {s['latency_p90_s'] * 1e3:.1f} ms | {s['latency_vs_end']:.2f}x | "
                     f"{s['tail_s'] * 1e3:.1f} ms | {s['idle_frac']:.1%} ({s['idle_min']:.1%}..{s['idle_max']:.1%}) | "
                     f"{s['wave_s']:.2f} s |")
    return "\n".join(lines)


def plot(summary: list[dict], rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["end" if s["chunk"] == 0 else str(s["chunk"]) for s in summary]
    for ax, key, title, scale in ((axes[0], "latency_median_s", "reward latency after EOS (ms)", 1e3),
                                  (axes[1], "idle_frac", "generator idle in a wave (%)", 100)):
        for i, s in enumerate(summary):
            pts = [x[key] * scale for x in rows if x["chunk"] == s["chunk"]]
            ax.scatter([i] * len(pts), pts, color="tab:gray", s=12, zorder=2)
            ax.bar(i, s[key] * scale, color="tab:blue" if s["chunk"] else "tab:orange", alpha=0.7, zorder=1)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("reward_model.chunk_tokens")
        ax.set_title(title)
    fig.suptitle("streaming reward prefill vs score-at-end (bars: median; dots: waves)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="0,8,16,32,64", help="reward_model.chunk_tokens values; 0 = score at end")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per response (EOS ignored)")
    ap.add_argument("--groups", type=int, default=2, help="prompt groups per wave")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--waves", type=int, default=3, help="kept waves per mode and repeat (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rm-dim", type=int, default=512)
    ap.add_argument("--rm-layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="chunks 0,16; 1 repeat; 2 waves; 64 tokens")
    ap.add_argument("--out", default="bench_out/reward")
    a = ap.parse_args()
    if a.quick:
        a.chunks, a.repeats, a.waves, a.tokens = "0,16", 1, 2, 64
    a.chunks = [int(x) for x in a.chunks.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(bench(a, out))
    summary = summarize(rows, a.chunks)
    write_csv(out / "results.csv", rows)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "rows": rows, "summary": summary}, indent=2))
    t = table(summary)
    (out / "table.md").write_text(t + "\n")
    plot(summary, rows, out / "reward_bench.png")
    print(t)
    print(f"wrote {out}/results.csv, results.json, table.md, reward_bench.png")


if __name__ == "__main__":
    main()
