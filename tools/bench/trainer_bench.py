"""Trainer throughput: RL train_step tokens/s for 1 and 2 FSDP2 ranks on real Monarch procs.

    .venv/bin/python -m tools.bench.trainer_bench --out bench_out/trainer [--ranks 1 2] [--steps 8]
        [--samples 32] [--seq-len 128] [--prompt-len 32] [--micro-batch 0] [key=value config overrides]

Each rank count gets a fresh trainer mesh (tiny model unless model.hf_dir is set), one warm-up
step, then `--steps` timed steps on synthetic batches (random tokens, sampler logprobs with noise,
random advantages). Reports trained (loss-mask) tokens/s and total tokens/s as seen by the driver,
the speed-up of each rank count over the first, and writes results.json, results.csv and
tokens_per_s.png to --out. Each rank uses trainer.cpu_threads torch threads (default
cpu_count / ranks). Measured on this shared 2-core box (32x128 tokens, tiny model): with one
thread per rank (`trainer.cpu_threads=1`) 1 rank ~12.6k and 2 ranks ~14.0k trained tokens/s
(1.11x); with the default, the 1-rank mesh runs 2 threads and swings from 2.5k to 8.4k tokens/s
under the other jobs' load, so its "speed-up" of 1.5-5x measures contention, not FSDP.

    .venv/bin/python -m tools.bench.trainer_bench --ragged outputs/smollm2-s11/rollouts.jsonl --config \
        configs/smollm2-135m-add.yaml [--micro 0 8] [--steps 3] [--samples 32] [--prompt-len 58] [--out DIR]

Batches shaped like a run's (pipeline/trainer/synthetic.py ragged_batch): each completion's length
drawn from a run's rollouts.jsonl (or a range "MIN-MAX"), right-padded to the batch's longest as the
replay buffer pads it, in-process (TrainCore over a one-rank gloo group, no Monarch), one TrainCore
per trainer.micro_batch_size in --micro, the same batches in turn (the order flips each step so load
on the machine hits all alike), after a warm-up step each. Prints each setting's step time (median,
min..max) and its ratio to the first setting's, step by step (median, min..max). What it measures
(trainer.micro_batch_size): rows of like length per micro-batch, each forward cut to its longest row,
the output head on loss tokens only (pipeline/trainer/step.py).

    .venv/bin/python -m tools.bench.trainer_bench --loss-phase [--vocab 49152 151936] [--tokens 2048]
        [--chunk 1024] [--repeats 4] [--threads 1]

The loss head alone (trainer.logprob_chunk_tokens, pipeline/trainer/chunked.py), in-process, no
Monarch: a 2-layer, dim-128 model (tied head) at each vocabulary, one micro-batch of --tokens tokens
through the trainer's own forward, the PPO-clip loss with TIS and the entropy bonus, backward and
AdamW, with the unchunked head (chunk 0) and the chunked one. Peak memory: each configuration in a
fresh process, the RSS high-water (ru_maxrss) of one step above the RSS before it (the model's
activations are a few MB; the rest is the loss head), and the bytes autograd saved for the backward
(saved_tensors_hooks, distinct storages). Step time: one process per vocabulary alternating the two
heads step by step, --repeats timed steps each after a warm-up; median and min..max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from actors.trainer import Trainer
from pipeline.config import load_config
from pipeline.driver.metrics import write_csv
from pipeline.models.hf import model_dir, read_hf_config
from pipeline.trainer.synthetic import synthetic_batch
from tools.lib.push import push_overlap


async def bench(cfg, ranks: int, args, vocab: int, bar) -> dict:
    from dataclasses import replace

    cfg = replace(cfg, trainer=replace(cfg.trainer, num_ranks=ranks, micro_batch_size=args.micro_batch))
    t0 = time.perf_counter()
    trainer = await Trainer.start(cfg, name=f"bench{ranks}")
    start_s = time.perf_counter() - t0
    try:
        batches = [synthetic_batch(args.samples, args.seq_len, args.prompt_len, vocab, s) for s in range(args.steps + 1)]
        await trainer.train_step(batches[0])  # warm-up: allocator, FSDP lazy init
        bar(f"{ranks} rank(s): warm-up done")
        times, trained = [], 0.0
        for i, b in enumerate(batches[1:]):
            t = time.perf_counter()
            m = await trainer.train_step(b)
            times.append(time.perf_counter() - t)
            trained += m["tokens"]
            bar(f"{ranks} rank(s): step {i + 1}/{args.steps} {times[-1] * 1e3:.0f} ms loss {m['loss']:+.4f}")
        overlap = await push_overlap(trainer, batches[1:], bar) if args.overlap else {}
    finally:
        await trainer.close()
    total = sum(times)
    return {**overlap, "ranks": ranks, "start_s": start_s, "steps": args.steps, "step_s_mean": total / len(times),
            "step_s_min": min(times), "trained_tokens_per_s": trained / total,
            "total_tokens_per_s": args.steps * args.samples * args.seq_len / total}


def _loss_model(vocab: int):
    from pipeline.models import Arch, family

    arch = Arch(model_type="qwen3", vocab_size=vocab, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                ffn_dim=384, norm_eps=1e-6, rope_theta=1e6, tied=True)
    torch.manual_seed(0)
    return family(arch).build(arch)


def _loss_step(model, opt, ids, chunk: int, saved: list | None = None) -> None:
    """One micro-batch as TrainCore._ppo_step runs it: forward, PPO-clip + TIS + entropy bonus, backward, AdamW."""
    from pipeline import losses
    from pipeline.config import TrainerConfig
    from pipeline.trainer.batches import logprobs

    cfg = TrainerConfig(correction="tis", entropy_coef=0.01)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1)

    def run():
        logp, ent = logprobs(model, ids, 1.0, chunk, "grad")
        old = logp.detach()
        mu = old + 0.1 * torch.randn(old.shape, generator=g)
        adv = torch.randn(ids.shape[0], generator=g)
        return losses.policy_loss(logp, old, mu, mask, adv, cfg, entropy=ent, entropy_coef=0.01)[0]

    if saved is None:
        loss = run()
    else:  # bytes autograd holds for the backward, each storage once
        seen: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = run()
        saved.append(sum(seen.values()))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def loss_phase_worker(vocab: int, tokens: int, chunk: int, repeats: int, mode: str, threads: int) -> dict:
    """mode "memory": one step's RSS high-water above the RSS before it (run in a fresh process);
    "time": steps alternating chunk 0 and `chunk` after a warm-up of each."""
    import resource

    import psutil

    torch.set_num_threads(threads)
    model = _loss_model(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(4, vocab, (max(1, tokens // 512), min(tokens, 512) + 1), generator=torch.Generator().manual_seed(1))
    if mode == "memory":
        _loss_step(model, opt, ids[:, :9], chunk)  # optimizer state and allocator warm, on a few tokens
        before = psutil.Process().memory_info().rss
        saved: list[int] = []
        t = time.perf_counter()
        _loss_step(model, opt, ids, chunk, saved)
        dt = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"peak_bytes": peak - before, "saved_bytes": saved[0], "step_s": dt}
    times: dict[int, list[float]] = {0: [], chunk: []}
    for c in (0, chunk):
        _loss_step(model, opt, ids, c)
    for i in range(repeats):
        for c in ((0, chunk) if i % 2 == 0 else (chunk, 0)):
            t = time.perf_counter()
            _loss_step(model, opt, ids, c)
            times[c].append(time.perf_counter() - t)
    return {str(c): v for c, v in times.items()}


def loss_phase(args) -> None:
    import statistics
    import subprocess

    def worker(vocab: int, chunk: int, mode: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--loss-phase-worker", mode, "--vocab", str(vocab),
                              "--tokens", str(args.tokens), "--chunk", str(chunk), "--repeats", str(args.repeats),
                              "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    rows = []
    for vocab in args.vocab:
        mem = {c: worker(vocab, c, "memory") for c in (0, args.chunk)}
        times = worker(vocab, args.chunk, "time")
        t0, t1 = times["0"], times[str(args.chunk)]
        rows.append({"vocab": vocab, "tokens": args.tokens, "chunk": args.chunk, "mem": mem,
                     "time_0": t0, "time_chunk": t1, "ratios": [b / a for a, b in zip(t0, t1)]})
        m0, m1 = mem[0]["peak_bytes"], mem[args.chunk]["peak_bytes"]
        print(f"[trainer_bench] vocab {vocab}: peak {m0 / 2**30:.3f} -> {m1 / 2**30:.3f} GiB ({m1 / m0:.3f}x), step "
              f"{statistics.median(t0):.2f} -> {statistics.median(t1):.2f} s", flush=True)
    gb = 2 ** 30
    print(f"\nloss head: {args.tokens} tokens per micro-batch, 2 layers, dim 128, tied head, fp32, "
          f"{args.threads} torch thread(s); chunk 0 = full logits, chunk {args.chunk} = trainer.logprob_chunk_tokens")
    print(f"{'vocab':>7} {'chunk':>5} {'peak GiB':>9} {'saved GiB':>10} {'peak ratio':>11} "
          f"{'step s median (min..max)':>26} {'time ratio median (min..max)':>30}")
    for r in rows:
        for c, ts in ((0, r["time_0"]), (args.chunk, r["time_chunk"])):
            m = r["mem"][c]
            ratio = m["peak_bytes"] / r["mem"][0]["peak_bytes"]
            tr = "" if c == 0 else (f"{statistics.median(r['ratios']):.3f} ({min(r['ratios']):.3f}.."
                                    f"{max(r['ratios']):.3f})")
            print(f"{r['vocab']:>7} {c:>5} {m['peak_bytes'] / gb:>9.3f} {m['saved_bytes'] / gb:>10.3f} {ratio:>11.3f} "
                  f"{statistics.median(ts):>10.2f} ({min(ts):.2f}..{max(ts):.2f}) {tr:>30}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "loss_phase.json").write_text(json.dumps(rows, indent=2))


def completion_lengths(spec: str) -> list[int]:
    """A run's rollouts.jsonl (each row's `versions`: one per completion token) or "MIN-MAX"."""
    if Path(spec).is_file():
        lens = [len(json.loads(line)["versions"]) for line in Path(spec).read_text().splitlines() if line.strip()]
        if not lens:
            raise SystemExit(f"trainer_bench: {spec} holds no rollouts")
        return lens
    lo, _, hi = spec.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi)):
        raise SystemExit(f"trainer_bench: --ragged {spec!r} is neither a rollouts.jsonl nor a range MIN-MAX")
    return list(range(int(lo), int(hi) + 1))


def ragged(args) -> None:
    import statistics

    import torch.distributed as dist

    from pipeline.trainer.step import TrainCore
    from pipeline.trainer.synthetic import ragged_batch

    lens = completion_lengths(args.ragged)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cores = {}
    for m in args.micro:
        cfg = load_config(args.config, args.overrides + [f"trainer.micro_batch_size={m}"])
        cores[m] = TrainCore.from_config(cfg)
    vocab = next(iter(cores.values())).vocab_size
    batches = [ragged_batch(args.samples, args.prompt_len, lens, vocab, s) for s in range(args.steps + 1)]
    width = [b.input_ids.shape[1] for b in batches]
    real = [int(b.loss_mask.sum()) + args.samples * args.prompt_len for b in batches]
    print(f"[trainer_bench] {args.samples} samples a batch, prompt {args.prompt_len} tokens, completions of "
          f"{min(lens)}..{max(lens)} tokens (mean {statistics.mean(lens):.1f}): padded width {min(width)}..{max(width)}, "
          f"{statistics.mean(real) / (args.samples * statistics.mean(width)):.0%} of the padded tokens real", flush=True)
    for m, core in cores.items():
        core.train_step(batches[0])
    times: dict[int, list[float]] = {m: [] for m in cores}
    for i, b in enumerate(batches[1:]):
        order = list(cores) if i % 2 == 0 else list(reversed(cores))
        for m in order:
            t = time.perf_counter()
            cores[m].train_step(b)
            times[m].append(time.perf_counter() - t)
        print(f"[trainer_bench] step {i + 1}/{args.steps}: " + ", ".join(
            f"micro {m}: {times[m][-1]:.2f} s" for m in cores), flush=True)
    first = args.micro[0]
    print(f"\n{'micro_batch_size':>16} {'step s median (min..max)':>26} {'ratio to micro ' + str(first):>28}")
    rows = []
    for m in cores:
        ts, ratios = times[m], [a / b for a, b in zip(times[m], times[first])]
        rows.append({"micro_batch_size": m, "step_s": ts, "ratio_to_first": ratios})
        print(f"{m:>16} {statistics.median(ts):>12.2f} ({min(ts):.2f}..{max(ts):.2f}) "
              f"{statistics.median(ratios):>12.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ragged.json").write_text(json.dumps({"lengths": args.ragged, "samples": args.samples,
                                                     "prompt_len": args.prompt_len, "rows": rows}, indent=2))
    dist.destroy_process_group()


def main() -> None:
    if "--ragged" in sys.argv:
        rp = argparse.ArgumentParser(description="train steps on batches shaped like a run's")
        rp.add_argument("--ragged", required=True, help="a run's rollouts.jsonl, or completion lengths MIN-MAX")
        rp.add_argument("--config", default=None)
        rp.add_argument("--micro", type=int, nargs="+", default=[0, 8], help="trainer.micro_batch_size values")
        rp.add_argument("--steps", type=int, default=3)
        rp.add_argument("--samples", type=int, default=32)
        rp.add_argument("--prompt-len", type=int, default=58, help="the SmolLM2 recipe's chat prompts: ~58 tokens")
        rp.add_argument("--out", default="")
        rp.add_argument("overrides", nargs="*")
        ragged(rp.parse_args())
        return
    if "--loss-phase-worker" in sys.argv:
        wp = argparse.ArgumentParser()
        wp.add_argument("--loss-phase-worker", choices=("memory", "time"))
        wp.add_argument("--vocab", type=int)
        wp.add_argument("--tokens", type=int)
        wp.add_argument("--chunk", type=int)
        wp.add_argument("--repeats", type=int)
        wp.add_argument("--threads", type=int)
        a = wp.parse_args()
        print(json.dumps(loss_phase_worker(a.vocab, a.tokens, a.chunk, a.repeats, a.loss_phase_worker, a.threads)))
        return
    if "--loss-phase" in sys.argv:
        lp = argparse.ArgumentParser(description="the loss head alone, chunked vs not")
        lp.add_argument("--loss-phase", action="store_true")
        lp.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
        lp.add_argument("--tokens", type=int, default=2048)
        lp.add_argument("--chunk", type=int, default=1024)
        lp.add_argument("--repeats", type=int, default=4)
        lp.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
        lp.add_argument("--out", default="")
        loss_phase(lp.parse_args())
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/trainer")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--config", default=None)
    ap.add_argument("--overlap", action="store_true", help="also time steps with and without the previous version's "
                    "push before them (the async controller's order), in alternating pairs; target: under 10%% slower")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    vocab = int(read_hf_config(model_dir(cfg.model))["vocab_size"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def bar(msg: str) -> None:
        print(f"[trainer_bench] {msg}", flush=True)

    rows = []
    for r in args.ranks:
        rows.append(asyncio.run(bench(cfg, r, args, vocab, bar)))
    base = rows[0]["trained_tokens_per_s"]
    for row in rows:
        row["speedup_vs_first"] = row["trained_tokens_per_s"] / base
    shape = {"samples": args.samples, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
             "micro_batch": args.micro_batch, "model": str(model_dir(cfg.model))}
    (out / "results.json").write_text(json.dumps({"shape": shape, "results": rows}, indent=2))
    write_csv(out / "results.csv", rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(r["ranks"]) for r in rows], [r["trained_tokens_per_s"] for r in rows], color="tab:blue")
    ax.set_xlabel("trainer ranks (FSDP2, gloo, CPU)")
    ax.set_ylabel("trained tokens / s")
    ax.set_title(f"train_step: {args.samples}x{args.seq_len} tokens/batch")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=120)

    print(f"\n{'ranks':>5} {'step ms':>9} {'trained tok/s':>14} {'total tok/s':>12} {'speed-up':>9}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['step_s_mean'] * 1e3:>9.1f} {r['trained_tokens_per_s']:>14.0f} "
              f"{r['total_tokens_per_s']:>12.0f} {r['speedup_vs_first']:>8.2f}x")
    for r in rows:
        if "pairs" in r:
            print(f"{r['ranks']} rank(s), {r['pairs']} alternating pairs: train step "
                  f"{r['step_s_alone_median'] * 1e3:.1f} ms alone, {r['step_s_with_push_median'] * 1e3:.1f} ms "
                  f"with the push before it: {r['with_push_over_alone_median']:.3f}x median "
                  f"({r['with_push_over_alone_min']:.3f}..{r['with_push_over_alone_max']:.3f}; target < 1.10x); "
                  f"the push itself {r['push_s_median'] * 1e3:.1f} ms = {r['push_over_step_median']:.1%} of a step")
    print(f"wrote {out}/results.json, results.csv, tokens_per_s.png")


if __name__ == "__main__":
    main()
