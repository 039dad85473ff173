"""Weight-sync latency and bandwidth per transport, bucket size and model size, with baselines.

    .venv/bin/python -m tools.bench.sync_bench --quick                 # ~2 min: tiny + ~100M, 3 bucket sizes
    .venv/bin/python -m tools.bench.sync_bench                         # tiny + ~100M, 1..256 MiB buckets
    .venv/bin/python -m tools.bench.sync_bench --sizes tiny,100m,1b    # adds a ~1B bf16 dict (~8 GiB peak RAM)
    .venv/bin/python -m tools.bench.sync_bench --sizes 100m-vllm       # a ~100M checkpoint loaded into vLLM
    .venv/bin/python -m tools.bench.sync_bench --sizes 100m,100m-lora16 --no-vllm   # LoRA adapters vs full weights
    .venv/bin/python -m tools.bench.sync_bench --ranks 1,2,4           # sharded push: per-rank memory and bytes

A "trainer" proc (WeightSender) and a "generator" proc (WeightReceiver, plus a vLLM AsyncLLM for the
tiny model) run as real Monarch actors. Per (transport, model, bucket size) we time pack (snapshot
copy into the slot), transfer (receiver pull; for collective the concurrent broadcast), load into
vLLM (the checkpoints vLLM can run: `tiny`, and `100m-vllm`, a 768-wide 12-layer Qwen3 with the
tiny model's character vocabulary, ~76M parameters (302 MB in float32), built locally; one per run;
start/update/finish with layerwise reload), the generation stall (from the
keep pause taking effect until resume returns: no engine step runs meanwhile, as on_update=keep
applies an update; the wait for the step in progress before it, which still generates, is reported
apart as pause_wait) and end to end, median over reps
after one warm-up. Baselines measured in the same run, on the same bytes: a local memcpy in the
generator proc (the one-host physical limit), one raw `RDMABuffer.read_into` of all bytes, and one
RDMA read per tensor. Writes table.md, results.csv, results.json and latency.png to --out.
`--ranks` measures the sharded push instead (tools/lib/ranks.py: per-rank peak memory and
bytes sent with N trainer ranks; ranks_table.md, ranks_results.json, ranks_memory.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch
from monarch.actor import Actor, endpoint, this_host

from pipeline.config import WeightSyncConfig
from pipeline.driver.metrics import write_csv
from pipeline.weightsync import WeightReceiver, WeightSender, load_into_vllm, vllm_engine_kwargs
from pipeline.weightsync.load import pause_keep
from tools.lib import ranks as sharded
from tools.lib.report import pyplot, save

SHAPES = {  # Qwen3-like (dim, layers, ffn, vocab, kv_dim)
    "100m": (768, 12, 2048, 32000, 256),
    "1b": (2048, 16, 8192, 32000, 512),
}


VLLM_SIZES = {"tiny": {}, "100m-vllm": {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 2048}}
"""Checkpoints built locally (pipeline.models.tiny.ensure_tiny with these shapes) that vLLM loads."""


def vllm_model_dir(size: str) -> str:
    from pipeline.models.tiny import TinySpec, ensure_tiny
    return str(ensure_tiny(TinySpec(**VLLM_SIZES[size])))


def make_state_dict(size: str, hf_dir: str) -> dict[str, torch.Tensor]:
    if size in VLLM_SIZES:
        from pipeline.models.hf import load_hf_state_dict
        return load_hf_state_dict(Path(hf_dir))
    if "-lora" in size:  # the adapters alone (pipeline/lora.py, PEFT names): what a LoRA push carries
        base, rank = size.split("-lora")
        dim, layers, ffn, vocab, kv = SHAPES[base]
        r = int(rank)
        shapes = {"self_attn.q_proj": (dim, dim), "self_attn.k_proj": (kv, dim), "self_attn.v_proj": (kv, dim),
                  "self_attn.o_proj": (dim, dim), "mlp.gate_proj": (ffn, dim), "mlp.up_proj": (ffn, dim),
                  "mlp.down_proj": (dim, ffn)}
        return {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight":
                torch.full((r, sh[1]) if ab == "A" else (sh[0], r), 0.5, dtype=torch.bfloat16)
                for i in range(layers) for m, sh in shapes.items() for ab in "AB"}
    dim, layers, ffn, vocab, kv = SHAPES[size]
    sd = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": (dim,), p + "self_attn.q_proj.weight": (dim, dim),
               p + "self_attn.k_proj.weight": (kv, dim), p + "self_attn.v_proj.weight": (kv, dim),
               p + "self_attn.o_proj.weight": (dim, dim), p + "post_attention_layernorm.weight": (dim,),
               p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
               p + "mlp.down_proj.weight": (dim, ffn)}
    sd["model.norm.weight"] = (dim,)
    return {k: torch.full(s, 0.5, dtype=torch.bfloat16) for k, s in sd.items()}


class BenchSender(Actor):
    def __init__(self, hf_dir: str) -> None:
        self.hf_dir, self.sds, self.senders, self.raw = hf_dir, {}, {}, []

    def _sd(self, size: str) -> dict[str, torch.Tensor]:
        if size not in self.sds:
            self.sds = {size: make_state_dict(size, self.hf_dir)}  # keep one size resident
        return self.sds[size]

    @endpoint
    async def open_sender(self, key: str, transport: str, size: str, bucket_mb: int):
        cfg = WeightSyncConfig(transport=transport, bucket_mb=bucket_mb, timeout_s=300.0)
        self.senders[key] = (WeightSender(cfg, self._sd(size), num_receivers=1), size)
        return self.senders[key][0].handle()

    @endpoint
    async def push(self, key: str, version: int) -> dict:
        s, size = self.senders[key]
        await s.push(self._sd(size), version)
        return dict(s.last_timing)

    @endpoint
    async def close_sender(self, key: str) -> None:
        self.senders.pop(key)[0].close()

    @endpoint
    async def raw_buffers(self, size: str):
        """One RDMABuffer over all bytes, and one per tensor: the raw and per-tensor RDMA baselines."""
        from monarch.rdma import RDMABuffer
        sd = self._sd(size)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in sd.values()])
        per = [RDMABuffer(t.reshape(-1).view(torch.uint8)) for t in sd.values() if t.numel()]
        self.raw = [flat, RDMABuffer(flat), per]
        return self.raw[1], per

    @endpoint
    async def drop_raw(self) -> None:
        for b in [self.raw[1], *self.raw[2]]:
            await b.drop()
        self.raw = []


class BenchReceiver(Actor):
    def __init__(self) -> None:
        self.receivers, self.engine, self.busy = {}, None, []

    @endpoint
    async def start_engine(self, hf_dir: str) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from pipeline.generator.llm import start_llm
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # built as a generator with on_update=keep is (no prefix caching), so requests can stay paused
        self.engine = start_llm(AsyncEngineArgs(
            model=hf_dir, dtype="float32", enforce_eager=True, max_model_len=256, enable_prefix_caching=False,
            **vllm_engine_kwargs()))
        self._seq = 0

    async def _generate(self) -> None:
        """One long request: keeps the engine busy while an update pauses it."""
        from vllm import SamplingParams

        self._seq += 1
        sp = SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.0)
        async for _ in self.engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, sp, request_id=f"busy{self._seq}"):
            pass

    @endpoint
    async def stop_engine(self) -> None:
        if self.engine is not None:
            from pipeline.generator.llm import stop_engine

            stop_engine(self.engine)
            self.engine = None

    @endpoint
    async def open_receiver(self, key: str, handle) -> None:
        self.receivers[key] = WeightReceiver(handle, rank=0)

    @endpoint
    async def busy_start(self) -> None:
        """Requests in flight for the next load to pause; returns once they decode."""
        self.busy = [asyncio.ensure_future(self._generate()) for _ in range(4)]
        await asyncio.sleep(0.2)

    @endpoint
    async def busy_stop(self) -> None:
        for b in self.busy:
            b.cancel()
        await asyncio.gather(*self.busy, return_exceptions=True)
        self.busy = []

    @endpoint
    async def pull(self, key: str, version: int, load: bool) -> dict:
        r = self.receivers[key]
        await r.pull(version)
        out = dict(r.last_timing)
        if load:  # as a generator with on_update=keep applies it: the busy requests stay paused meanwhile
            t0 = time.perf_counter()
            await pause_keep(self.engine)  # the generator's keep pause
            t1 = time.perf_counter()  # from here no engine step runs until resume returns
            await load_into_vllm(self.engine, r, version, timeout_s=300.0)
            t2 = time.perf_counter()
            await self.engine.resume_generation()
            out.update(load_s=t2 - t1, stall_s=time.perf_counter() - t1, pause_wait_s=t1 - t0)
        return out

    @endpoint
    async def close_receiver(self, key: str) -> None:
        self.receivers.pop(key).close()

    @endpoint
    async def memcpy_s(self, nbytes: int, reps: int) -> float:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        return _median(lambda: dst.copy_(src), reps)

    @endpoint
    async def raw_read_s(self, buf, reps: int) -> float:
        dst = torch.empty(buf.size(), dtype=torch.uint8)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            await buf.read_into(dst, timeout=300)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    @endpoint
    async def per_tensor_s(self, bufs, reps: int) -> float:
        dsts = [torch.empty(b.size(), dtype=torch.uint8) for b in bufs]
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for b, d in zip(bufs, dsts):  # one transfer per tensor: the unpacked baseline
                await b.read_into(d, timeout=300)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(sender, receiver, transport: str, size: str, bucket_mb: int, reps: int, load: bool) -> dict:
    key = f"{transport}-{size}-{bucket_mb}"
    t0 = time.perf_counter()
    handle = sender.open_sender.call_one(key, transport, size, bucket_mb).get()
    receiver.open_receiver.call_one(key, handle).get()
    setup_s = time.perf_counter() - t0
    rows = []
    try:
        for version in range(1, reps + 2):
            if load:
                receiver.busy_start.call_one().get()
            t0 = time.perf_counter()
            push = sender.push.call_one(key, version)
            if transport != "collective":  # pull transports: pull after the push published
                push = push.get()
            pull = receiver.pull.call_one(key, version, load).get()
            push = push.get() if transport == "collective" else push
            e2e = time.perf_counter() - t0
            if load:
                receiver.busy_stop.call_one().get()
            transfer = max(push.get("send_s", 0.0), pull["pull_s"])
            rows.append(dict(pack_s=push["pack_s"], transfer_s=transfer, load_s=pull.get("load_s", float("nan")),
                             stall_s=pull.get("stall_s", float("nan")),
                             stall_over_load=pull.get("stall_s", float("nan")) / pull.get("load_s", float("nan")),
                             pause_wait_s=pull.get("pause_wait_s", float("nan")), e2e_s=e2e))
    finally:
        receiver.close_receiver.call_one(key).get()
        sender.close_sender.call_one(key).get()
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    return dict(transport=transport, model=size, bucket_mb=bucket_mb, bytes=handle.plan.total_bytes,
                num_buckets=handle.plan.num_buckets, setup_s=setup_s, **med)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 bucket sizes, 2 reps")
    ap.add_argument("--sizes", default="tiny,100m", help="comma list of tiny,100m,1b,100m-vllm "
                    "(at most one of tiny and 100m-vllm, the sizes loaded into vLLM), and <size>-lora<r>: "
                    "the LoRA adapters of rank r of 100m or 1b, what a trainer.lora push carries")
    ap.add_argument("--transports", default="shm,rdma,collective")
    ap.add_argument("--buckets", default="", help="MiB list; default 1,4,16,64,256 (quick: 1,16,64)")
    ap.add_argument("--reps", type=int, default=0, help="timed reps after one warm-up (default 3, quick 2)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the unpack-into-vLLM measurement")
    ap.add_argument("--ranks", default="", help="comma list of trainer rank counts: measure the sharded push "
                    "(per-rank peak memory, bytes sent) on --sizes' first size (default 100m), --buckets' first "
                    "size (default 16 MiB)")
    ap.add_argument("--out", default="bench_out/sync_bench")
    args = ap.parse_args()
    if args.ranks:
        size = args.sizes.split(",")[0] if args.sizes != "tiny,100m" else "100m"
        sd = make_state_dict(size, vllm_model_dir("tiny") if size in VLLM_SIZES else "")
        meta = {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}
        del sd
        print(sharded.main(meta, [int(n) for n in args.ranks.split(",")], args.transports.split(","),
                                    int((args.buckets or "16").split(",")[0]), args.reps or 3, Path(args.out)))
        return
    from tqdm import tqdm

    sizes, transports = args.sizes.split(","), args.transports.split(",")
    unknown = [s for s in sizes if s not in (*SHAPES, *VLLM_SIZES) and not
               (s.split("-lora")[0] in SHAPES and s.split("-lora")[-1].isdigit() and "-lora" in s)]
    in_vllm = [s for s in sizes if s in VLLM_SIZES]
    if unknown or len(in_vllm) > 1:
        raise SystemExit(f"sync_bench: --sizes {args.sizes}: " + (f"unknown {unknown}" if unknown else
                         f"one vLLM engine per run: pick one of {in_vllm}"))
    hf_dir = vllm_model_dir(in_vllm[0] if in_vllm else "tiny")
    buckets = [int(b) for b in (args.buckets or ("1,16,64" if args.quick else "1,4,16,64,256")).split(",")]
    reps = args.reps or (2 if args.quick else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
    gen_procs = this_host().spawn_procs(per_host={"procs": 1})
    sender = trainer_procs.spawn("bench_sender", BenchSender, hf_dir)
    receiver = gen_procs.spawn("bench_receiver", BenchReceiver)
    load = bool(in_vllm) and not args.no_vllm
    if load:
        print("starting vLLM engine in the generator proc ...", flush=True)
        receiver.start_engine.call_one(hf_dir).get()
    results, baselines = [], {}
    cases = [(s, t, b) for s in sizes for t in transports for b in buckets]
    bar = tqdm(total=len(cases) + len(sizes), desc="sync_bench", unit="case")
    try:
        for size in sizes:
            bar.set_postfix_str(f"{size} baselines")
            raw, per = sender.raw_buffers.call_one(size).get()
            nbytes = raw.size()
            baselines[size] = dict(bytes=nbytes, memcpy_s=receiver.memcpy_s.call_one(nbytes, 5).get(),
                                   raw_read_s=receiver.raw_read_s.call_one(raw, reps).get(),
                                   per_tensor_s=receiver.per_tensor_s.call_one(per, reps).get(),
                                   num_tensors=len(per))
            sender.drop_raw.call_one().get()
            bar.update(1)
            for s, t, b in [c for c in cases if c[0] == size]:
                bar.set_postfix_str(f"{s} {t} {b} MiB")
                results.append(run_case(sender, receiver, t, s, b, reps, load and s in VLLM_SIZES))
                bar.update(1)
    finally:
        bar.close()
        if load:
            receiver.stop_engine.call_one().get()
        trainer_procs.stop().get()
        gen_procs.stop().get()
    print(report(results, baselines, out))


def report(results: list[dict], baselines: dict, out: Path) -> str:
    """Markdown table with ratios to the baselines; also CSV, JSON and the latency plot."""
    for r in results:
        b = baselines[r["model"]]
        r["gbps"] = r["bytes"] / r["transfer_s"] / 1e9
        # A sync is pack + transfer (shm's transfer is zero-copy, its one copy is the pack).
        r["sync_gbps"] = r["bytes"] / (r["pack_s"] + r["transfer_s"]) / 1e9
        r["x_memcpy_bw"] = b["memcpy_s"] / (r["pack_s"] + r["transfer_s"])
        r["x_raw_rdma_bw"] = b["raw_read_s"] / r["transfer_s"]
        r["speedup_vs_per_tensor"] = b["per_tensor_s"] / r["transfer_s"]
    lines = ["| model | MB | baseline | ms | GB/s |", "|---|---:|---|---:|---:|"]
    for m, b in baselines.items():
        for name, key in (("local memcpy", "memcpy_s"), ("raw RDMABuffer.read_into", "raw_read_s"),
                          (f"RDMA per tensor ({b['num_tensors']} reads)", "per_tensor_s")):
            lines.append(f"| {m} | {b['bytes'] / 1e6:.1f} | {name} | {b[key] * 1e3:.1f} | {b['bytes'] / b[key] / 1e9:.2f} |")
    lines += ["", "| transport | model | bucket MiB | buckets | pack ms | transfer ms | vLLM load ms | stall ms | e2e ms | "
              "transfer GB/s | pack+transfer GB/s | × memcpy bw (pack+transfer) | × raw RDMA bw (transfer) | "
              "speed-up vs per-tensor (transfer) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def rd(x: float) -> str:  # the RDMA baselines only compare with the rdma transport
        return f"{x:.2f}" if r["transport"] == "rdma" else "–"

    for r in results:
        load = "" if r["load_s"] != r["load_s"] else f"{r['load_s'] * 1e3:.1f}"
        stall = "" if r["stall_s"] != r["stall_s"] else f"{r['stall_s'] * 1e3:.1f}"
        lines.append(f"| {r['transport']} | {r['model']} | {r['bucket_mb']} | {r['num_buckets']} | "
                     f"{r['pack_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.1f} | {load} | {stall} | {r['e2e_s'] * 1e3:.1f} | "
                     f"{r['gbps']:.2f} | {r['sync_gbps']:.2f} | {r['x_memcpy_bw']:.2f} | {rd(r['x_raw_rdma_bw'])} | "
                     f"{rd(r['speedup_vs_per_tensor'])} |")
    lines.append("")
    for m in baselines:  # the targets, best bucket size per transport
        best = {t: max((r for r in results if r["model"] == m and r["transport"] == t), key=lambda r: r[key],
                       default=None) for t, key in (("shm", "x_memcpy_bw"), ("rdma", "gbps"))}
        if best["shm"]:
            lines.append(f"- {m}: shm at {best['shm']['x_memcpy_bw']:.0%} of memcpy bandwidth "
                         f"(target >= 50%, bucket {best['shm']['bucket_mb']} MiB)")
        if best["rdma"]:
            lines.append(f"- {m}: rdma at {best['rdma']['x_raw_rdma_bw']:.0%} of one raw read_into (target >= 80%), "
                         f"{best['rdma']['speedup_vs_per_tensor']:.2f}x faster than per-tensor reads "
                         f"(target >= 3x; bucket {best['rdma']['bucket_mb']} MiB)")
        stalls = [r for r in results if r["model"] == m and r["stall_s"] == r["stall_s"]]
        if stalls:
            worst = max(stalls, key=lambda r: r["stall_over_load"])
            lines.append(f"- {m}: generation stall per update (keep: requests paused in the engine) "
                         f"{statistics.median(r['stall_over_load'] for r in stalls):.2f}x the load, median over "
                         f"{len(stalls)} cases (target <= 1.2x; each case the median of its reps); worst case "
                         f"{worst['stall_over_load']:.2f}x ({worst['stall_s'] * 1e3:.1f} ms stall, "
                         f"{worst['load_s'] * 1e3:.1f} ms load; {worst['transport']}, {worst['bucket_mb']} MiB "
                         f"buckets). Before the stall, "
                         f"{statistics.median(r['pause_wait_s'] for r in stalls) * 1e3:.1f} ms (median) waiting "
                         f"for the engine's step in progress to finish, which still generates")
    for m in baselines:  # LoRA against its full model: bytes and end-to-end sync time, best bucket each
        full = m.split("-lora")[0]
        if "-lora" in m and full in baselines:
            for t in dict.fromkeys(r["transport"] for r in results):
                lo = min((r for r in results if r["model"] == m and r["transport"] == t), key=lambda r: r["e2e_s"],
                         default=None)
                fu = min((r for r in results if r["model"] == full and r["transport"] == t), key=lambda r: r["e2e_s"],
                         default=None)
                if lo and fu:
                    lines.append(f"- {m} vs {full} over {t}: {baselines[m]['bytes'] / 1e6:.2f} MB vs "
                                 f"{baselines[full]['bytes'] / 1e6:.1f} MB ({baselines[full]['bytes'] / baselines[m]['bytes']:.0f}x "
                                 f"fewer bytes); sync {lo['e2e_s'] * 1e3:.1f} ms vs {fu['e2e_s'] * 1e3:.1f} ms "
                                 f"({fu['e2e_s'] / lo['e2e_s']:.0f}x faster)")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    (out / "results.json").write_text(json.dumps({"results": results, "baselines": baselines}, indent=1))
    write_csv(out / "results.csv", results)
    models = list(baselines)
    fig, axes = pyplot().subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        for t in dict.fromkeys(r["transport"] for r in results):
            rs = [r for r in results if r["model"] == m and r["transport"] == t]
            ax.plot([r["bucket_mb"] for r in rs], [r["e2e_s"] * 1e3 for r in rs], "o-", label=f"{t} e2e")
        ax.axhline(baselines[m]["memcpy_s"] * 1e3, ls="--", c="k", label="memcpy")
        ax.axhline(baselines[m]["per_tensor_s"] * 1e3, ls=":", c="r", label="rdma per tensor")
        ax.set(xscale="log", yscale="log", xlabel="bucket MiB", ylabel="ms", title=f"{m} ({baselines[m]['bytes'] / 1e6:.0f} MB)")
        ax.legend(fontsize=7)
    save(fig, out / "latency.png", dpi=120)
    return table


if __name__ == "__main__":
    main()
