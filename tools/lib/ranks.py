"""Sharded weight push, per trainer rank: peak memory during a push and bytes sent, with N ranks.

    .venv/bin/python -m tools.bench.sync_bench --ranks 1,2,4                        # ~100M dict, 3 transports
    .venv/bin/python -m tools.bench.sync_bench --ranks 2 --transports shm --reps 2  # one case

N "trainer rank" procs each hold their FSDP2 shard of the ~100M HF dict (torch.chunk of dim 0 of
every tensor, as fully_shard splits it) as float32 master weights, build their WeightSender for the
same ShardPlan and push (pack: each piece cast to bf16 into the rank's slot; then the transfer) to
one receiver proc, which assembles the whole bf16 tensors (all real Monarch actors, the real
transports). Per rank and push:

  peak    VmHWM during the push (reset through /proc/self/clear_refs before it) minus the rank's RSS
          before its sender existed (its shard resident): the two bf16 slots (the double-buffered
          snapshot, faulted in at attach) plus whatever the push allocates. RSS, not tracemalloc:
          tracemalloc does not see torch's allocations.
  bound   shard + 2 buckets, shard = the rank's float32 master shard (what it holds; its two bf16
          slots together are exactly that size).
  bytes   bytes the rank packs and every receiver reads from it, over model / N (bf16 model bytes).

Ratios are per (N, transport): median over reps x ranks after one warm-up push, with min..max.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import torch
from monarch.actor import Actor, current_rank, endpoint, this_host

from pipeline.config import WeightSyncConfig
from pipeline.weightsync import BucketPlan, WeightReceiver, WeightSender, merge_handles
from tools.lib.report import pyplot, save


def status_kib() -> dict[str, int]:
    s = Path("/proc/self/status").read_text()
    return {k: int(re.search(k + r":\s+(\d+)", s).group(1)) for k in ("VmRSS", "VmHWM")}


def fsdp_boxes(meta: dict[str, tuple[torch.dtype, tuple[int, ...]]], world: int):
    """Every rank's boxes under FSDP2's dim-0 split (torch.chunk: uneven, maybe empty)."""
    out = [[] for _ in range(world)]
    for name, (_, shape) in meta.items():
        start = 0
        for r, c in enumerate(torch.chunk(torch.arange(shape[0]), world)):
            out[r].append((name, (start, *[0] * (len(shape) - 1)), (len(c), *shape[1:])))
            start += len(c)
    return out


class ShardRank(Actor):
    """One trainer rank: its float32 shard of a dict and its WeightSender (a new dict or transport per
    `open`, so one set of procs serves many cases: spawning them is the slow part)."""

    def __init__(self, world: int) -> None:
        self.rank, self.world = current_rank().rank, world
        self.meta, self.shard, self.sender = None, [], None

    @endpoint
    async def open(self, meta: dict, transport: str, bucket_mb: int) -> tuple:
        if meta != self.meta:
            self.shard = []  # the old shard goes before the new one is made
            self.meta, self.boxes = meta, fsdp_boxes(meta, self.world)
            g = torch.Generator().manual_seed(self.rank)
            self.shard = [torch.randn(size, generator=g) for _, _, size in self.boxes[self.rank]]
        self.base_kib = status_kib()["VmRSS"]  # the shard resident, no sender yet
        cfg = WeightSyncConfig(transport=transport, bucket_mb=bucket_mb, timeout_s=300.0)
        self.sender = WeightSender(cfg, self.meta, 1, holdings=self.boxes, rank=self.rank)
        shard = sum(t.numel() * t.element_size() for t in self.shard)
        return self.sender.handle(), shard

    @endpoint
    async def push(self, version: int) -> dict:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        await self.sender.push(self.shard, version)
        e2e = time.perf_counter() - t0
        peak = (status_kib()["VmHWM"] - self.base_kib) * 1024
        return dict(self.sender.last_timing, peak=float(peak), push_s=e2e,
                    buckets=float(self.sender.shards.num_buckets(self.rank)))

    @endpoint
    async def close(self) -> None:
        self.sender.close()
        self.sender = None


class Assembler(Actor):
    def __init__(self) -> None:
        self.receiver = None

    @endpoint
    async def open(self, handle) -> None:
        self.receiver = WeightReceiver(handle, rank=0)

    @endpoint
    async def pull(self, version: int) -> float:
        await self.receiver.pull(version)
        return self.receiver.last_timing["pull_s"]

    @endpoint
    async def close(self) -> None:
        self.receiver.close()


class RankMesh:
    """`world` trainer-rank procs (a ShardRank each) and one receiver proc (an Assembler), reused
    across cases until `stop`. `push_rows` runs one case: every rank opens its sender on `meta`
    under `transport`, then `reps` + 1 pushes (the first a warm-up), each pulled by the receiver.

    Example:
        mesh = RankMesh(2)
        try:
            rows, shards = mesh.push_rows(meta, "shm", 16, reps=3)   # one row per (push, rank)
        finally:
            mesh.stop()
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self._ranks_procs = this_host().spawn_procs(per_host={"procs": world})
        self._recv_procs = this_host().spawn_procs(per_host={"procs": 1})
        self.ranks = self._ranks_procs.spawn(f"shard_rank_{world}", ShardRank, world)
        self.recv = self._recv_procs.spawn(f"assembler_{world}", Assembler)

    def push_rows(self, meta: dict, transport: str, bucket_mb: int, reps: int) -> tuple[list[dict], list[int]]:
        """Rows of every timed push and rank: the sender's timing (pack_s, bytes, send_s for
        collective), peak, push_s, buckets (this rank's transfers), version, pull_s (the receiver's, from its
        pull call to the whole dict assembled) and e2e_s (from the push call to every rank and the
        receiver done, as the driver sees it); and each rank's shard bytes."""
        opened = list(self.ranks.open.call(meta, transport, bucket_mb).get().values())
        shards = [s for _, s in opened]
        self.recv.open.call_one(merge_handles([h for h, _ in opened])).get()
        rows = []
        try:
            for version in range(1, reps + 2):
                t0 = time.perf_counter()
                pushed = self.ranks.push.call(version)  # concurrent with the pull (collective needs both)
                pull_s = self.recv.pull.call_one(version).get()
                per_rank = list(pushed.get().values())
                e2e = time.perf_counter() - t0
                if version > 1:  # the first push is a warm-up
                    rows += [dict(r, rank=i, version=version, pull_s=pull_s, e2e_s=e2e)
                             for i, r in enumerate(per_rank)]
        finally:
            self.ranks.close.call().get()
            self.recv.close.call_one().get()
        return rows, shards

    def stop(self) -> None:
        self._ranks_procs.stop().get()
        self._recv_procs.stop().get()


def run(meta: dict, world: int, transport: str, bucket_mb: int, reps: int) -> dict:
    full = BucketPlan.from_state_dict(meta, bucket_mb << 20)
    mesh = RankMesh(world)
    try:
        rows, shards = mesh.push_rows(meta, transport, bucket_mb, reps)
    finally:
        mesh.stop()
    model = full.total_bytes
    bound = [shards[r["rank"]] + 2 * full.bucket_bytes for r in rows]
    peak = [r["peak"] / b for r, b in zip(rows, bound)]
    sent = [r["bytes"] / (model / world) for r in rows]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    return dict(ranks=world, transport=transport, bucket_mb=bucket_mb, model_mb=model / 1e6,
                shard_mb=med(shards) / 1e6, peak_mb=med([r["peak"] for r in rows]) / 1e6,
                peak_over_bound=med(peak), peak_min=min(peak), peak_max=max(peak),
                bytes_mb=med([r["bytes"] for r in rows]) / 1e6, bytes_over_share=med(sent),
                bytes_min=min(sent), bytes_max=max(sent), pack_ms=med([r["pack_s"] for r in rows]) * 1e3,
                push_ms=med([r["push_s"] for r in rows]) * 1e3, pull_ms=med([r["pull_s"] for r in rows]) * 1e3,
                samples=len(rows))


def main(meta: dict, ranks: list[int], transports: list[str], bucket_mb: int, reps: int, out: Path) -> str:
    results = []
    for world in ranks:
        for t in transports:
            print(f"sharded push: {world} rank(s), {t}, {bucket_mb} MiB buckets ...", flush=True)
            results.append(run(meta, world, t, bucket_mb, reps))
    return report(results, out)


def report(results: list[dict], out: Path) -> str:
    lines = ["| ranks | transport | model MB | shard MB (fp32) | peak MB | peak / (shard + 2 buckets) | "
             "bytes/rank MB | bytes / (model / N) | pack ms | push ms | pull+assemble ms | samples |",
             "|---:|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['ranks']} | {r['transport']} | {r['model_mb']:.0f} | {r['shard_mb']:.0f} | "
                     f"{r['peak_mb']:.0f} | {r['peak_over_bound']:.2f} ({r['peak_min']:.2f}..{r['peak_max']:.2f}) | "
                     f"{r['bytes_mb']:.1f} | {r['bytes_over_share']:.3f} ({r['bytes_min']:.3f}..{r['bytes_max']:.3f}) | "
                     f"{r['pack_ms']:.0f} | {r['push_ms']:.0f} | {r['pull_ms']:.0f} | {r['samples']} |")
    table = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks_table.md").write_text(table)
    (out / "ranks_results.json").write_text(json.dumps(results, indent=1))
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for t in dict.fromkeys(r["transport"] for r in results):
        rs = [r for r in results if r["transport"] == t]
        ax.plot([r["ranks"] for r in rs], [r["peak_mb"] for r in rs], "o-", label=f"{t}: peak per rank")
    rs = [r for r in results if r["transport"] == results[0]["transport"]]
    ax.plot([r["ranks"] for r in rs], [r["shard_mb"] + 2 * r["bucket_mb"] * 2**20 / 1e6 for r in rs], "k--",
            label="shard + 2 buckets")
    ax.plot([r["ranks"] for r in rs], [r["bytes_mb"] for r in rs], "s:", c="gray", label="bytes sent per rank")
    ax.set(xlabel="trainer ranks", ylabel="MB", xticks=[r["ranks"] for r in rs],
           title=f"sharded push, {results[0]['model_mb']:.0f} MB bf16 model")
    ax.legend(fontsize=7)
    save(fig, out / "ranks_memory.png", dpi=120)
    return table

