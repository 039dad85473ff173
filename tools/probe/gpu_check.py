"""The trainer core on one device, without Monarch or vLLM: a few PPO steps and one weight push's packing
and checksums, with figures.

    .venv/bin/python -m tools.probe.gpu_check [--device cuda|cpu] [--hf-dir DIR | --qwen3 Qwen3-0.6B [--layers N]]
        [--steps 8] [--samples 32] [--seq-len 256] [--prompt-len 64] [--dtype bfloat16] [--chunk 1024]
        [--out FILE.json] [key=value config overrides, e.g. model.hf_dir=$(python -m pipeline.models.tiny --dim 1024 --n-layers 8)]

The model: the tiny one (built here, pipeline/models/tiny.py), a local HF checkpoint (--hf-dir), or
random weights of a Qwen3 shape written to a temp dir first (--qwen3: vocab 151,936, where the chunked
head matters; no download). What runs is the trainer's own code path, as tests/test_bf16.py and
tests/test_chunked_logprobs.py build it: a one-rank torch.distributed group (nccl on CUDA, gloo on CPU), TrainCore
(pipeline/trainer/step.py) with FSDP2 over a mesh of one, float32 master weights and `--dtype` compute
(FSDP2's MixedPrecisionPolicy), the chunked loss head (trainer.logprob_chunk_tokens = --chunk;
pipeline/trainer/chunked.py), AdamW. Batches are synthetic (pipeline/trainer/synthetic.py): random
tokens, sampler log-probs the learner's own plus noise, random advantages. One warm-up step, then
--steps timed steps. Then one weight push as a trainer rank makes it (actors/trainer.py push_weights),
without a transport: the bucket plan of the HF tensors (pipeline/weightsync/plan.py), this rank's
shard plan of its FSDP2 shards (shard_plan.py), the pack (cast to model.dtype) into a host buffer
(where shm and rdma slots live) and into a device buffer (a nccl collective's slots), and the
checksums of the packed bytes (checksum.py, weight_sync.verify) on each. On CUDA, last, the peak
memory of one step with the chunked head and one with the full [tokens, vocab] logits (chunk 0).

Prints: step time (median, min..max), trained and total tokens/s, peak CUDA memory of the timed steps
(torch.cuda.max_memory_allocated), pack time and bytes, checksum time, and the chunked vs unchunked
step peak. Needs torch (with CUDA for --device cuda), torchtitan, safetensors, omegaconf, pyyaml, numpy,
and tokenizers for the tiny model or --qwen3; no network, no hub.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

NEEDED = {"torch": "torch", "torchtitan": "torchtitan", "safetensors": "safetensors", "omegaconf": "omegaconf",
          "yaml": "pyyaml", "numpy": "numpy"}


def preflight(tokenizers: bool) -> None:
    """Name every missing package before anything imports them (the device machine may lack some)."""
    need = dict(NEEDED, **({"tokenizers": "tokenizers"} if tokenizers else {}))
    missing = [pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None]
    if missing:
        sys.exit(f"gpu_check: missing Python package(s): {', '.join(missing)} "
                 f"(pip install {' '.join(missing)}); vLLM and Monarch are not needed")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    ap.add_argument("--hf-dir", default="", help="a local HF checkpoint directory (default: the tiny model)")
    ap.add_argument("--qwen3", default="", choices=("", "Qwen3-0.6B", "Qwen3-1.7B"),
                    help="a random-weight checkpoint of this shape (vocab 151,936), written to a temp dir first; "
                         "no download (pipeline/models/qwen3_checkpoint.py; the tokenizer file is a placeholder)")
    ap.add_argument("--layers", type=int, default=None, help="with --qwen3: fewer decoder layers")
    ap.add_argument("--steps", type=int, default=8, help="timed train steps (after one warm-up step)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=0, help="trainer.micro_batch_size (0: the whole batch)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model.dtype (compute)")
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens (0: full logits)")
    ap.add_argument("--pack-repeats", type=int, default=3)
    ap.add_argument("--chunk-compare", choices=("auto", "on", "off"), default="auto",
                    help="one step with full logits and one chunked, peak memory of each (auto: on CUDA only)")
    ap.add_argument("--out", default="", help="also write the figures as JSON here")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    return ap.parse_args()


class _TorchCompat:
    """torchtitan 0.3.0 imports names that only a newer torch has (e.g. DataParallelMeshDims of
    torch.distributed.fsdp, in parallelize modules this path never calls). On an older torch, as a
    GPU machine's image may have, such a name imported by a torchtitan module gets a stub, listed at
    the end of the run; a stub raises if anything calls it, so nothing is silently wrong."""

    def __init__(self):
        import builtins
        import types

        self.builtins, self.types, self.stubbed = builtins, types, []
        self.real_import = builtins.__import__

    def __enter__(self):
        self.builtins.__import__ = self._import
        return self

    def __exit__(self, *exc):
        self.builtins.__import__ = self.real_import

    def _stub(self, where: str, name: str):
        what = f"{where}.{name}"
        self.stubbed.append(what)

        def refuse(*_, **__):
            raise RuntimeError(f"{what} is not in this torch (a stub made by tools/probe/gpu_check.py so torchtitan "
                               "imports); this path needs a newer torch")
        return type(name, (), {"__init__": refuse, "__call__": refuse, "__init_subclass__": classmethod(refuse)})

    def _import(self, name, globals=None, locals=None, fromlist=(), level=0):
        caller = (globals or {}).get("__name__", "") or ""
        ours = level == 0 and caller.startswith("torchtitan") and name.split(".")[0] == "torch"
        try:
            mod = self.real_import(name, globals, locals, fromlist, level)
        except ModuleNotFoundError as e:
            if not ours or not (e.name or "").startswith("torch."):
                raise
            parent, _, leaf = name.rpartition(".")
            mod = self.types.ModuleType(name)
            sys.modules[name] = mod
            self.stubbed.append(f"{name} (module)")
            if parent in sys.modules:
                setattr(sys.modules[parent], leaf, mod)
        if ours and fromlist:
            for n in fromlist:
                if n != "*" and not hasattr(mod, n):
                    try:
                        self.real_import(f"{name}.{n}")
                    except ImportError:
                        setattr(mod, n, self._stub(name, n))
        return mod


def main() -> None:
    args = parse()
    if args.qwen3 and args.hf_dir:
        sys.exit("gpu_check: --qwen3 and --hf-dir are exclusive")
    preflight(tokenizers=not args.hf_dir)
    scratch = None
    if args.qwen3:
        scratch = write_qwen3(args.qwen3, args.layers)
        args.hf_dir = str(scratch)
    try:
        with _TorchCompat() as compat:
            run(args)
        if compat.stubbed:
            print(f"[gpu_check] this torch lacks {len(compat.stubbed)} name(s) that torchtitan imports; stubbed, "
                  f"and none was called: {', '.join(compat.stubbed)}", flush=True)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)


def write_qwen3(model: str, layers: int | None) -> Path:
    """config.json and random bf16 weights of `model`'s shape in a temp dir, with the tiny character
    tokenizer as a placeholder tokenizer.json (model.hf_dir asks for one; the trainer never tokenizes)."""
    import tempfile

    from safetensors.torch import save_file

    from pipeline.models.qwen3_checkpoint import qwen3_config, random_weights
    from pipeline.models.tiny import build_tokenizer_json

    t = time.perf_counter()
    out = Path(tempfile.mkdtemp(prefix="gpu_check_qwen3_"))
    conf = qwen3_config(layers=layers, model=model)
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    save_file(random_weights(conf, 0), str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer_json(out / "tokenizer.json")
    print(f"[gpu_check] wrote a random-weight {model} ({conf['num_hidden_layers']} layers) to {out} in "
          f"{time.perf_counter() - t:.1f} s", flush=True)
    return out


def run(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from pipeline.config import load_config
    from pipeline.trainer import chunked
    from pipeline.trainer.batches import logprobs
    from pipeline.trainer.step import TrainCore
    from pipeline.trainer.synthetic import synthetic_batch
    from pipeline.weightsync.pinning import HostPins
    from pipeline.weightsync.plan import BucketPlan
    from pipeline.weightsync.shard_plan import ShardPlan

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("gpu_check: --device cuda but torch.cuda.is_available() is False "
                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    backend = "nccl" if cuda else "gloo"
    # generator.engine=vllm: the config's rule for a CUDA trainer; nothing here starts or imports a generator
    overrides = [f"trainer.device={device}", f"trainer.backend={backend}", f"model.dtype={args.dtype}",
                 f"trainer.logprob_chunk_tokens={args.chunk}", f"trainer.micro_batch_size={args.micro_batch}",
                 "trainer.lr=1e-5"] + (["generator.engine=vllm"] if cuda else []) \
        + ([f"model.hf_dir={args.hf_dir}"] if args.hf_dir else []) + args.overrides
    cfg = load_config(None, overrides)

    def say(msg: str) -> None:
        print(f"[gpu_check] {msg}", flush=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.set_device(0)
        say(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        say(f"device: cpu ({torch.get_num_threads()} torch threads), torch {torch.__version__}")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        t0 = time.perf_counter()
        core = TrainCore.from_config(cfg)
        build_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in core.model.parameters())
        master = {str(p.dtype).removeprefix("torch.") for p in core.model.parameters()}
        fsdp = any(isinstance(p, DTensor) for p in core.model.parameters())
        wrap = f"FSDP2 over 1 rank ({backend})" if fsdp else \
            f"no FSDP (float32 on one rank is a plain module; {backend})"
        note = "" if core.chunk or not args.chunk else " (not chunkable)"
        name = f"random {args.qwen3}" if args.qwen3 else args.hf_dir or "tiny"
        say(f"model {name}: {n_params / 1e6:.2f} M parameters, vocab {core.vocab_size}, master "
            f"{'/'.join(sorted(master))}, compute {args.dtype}, {wrap}, chunk {core.chunk} tokens{note}; "
            f"built in {build_s:.1f} s")

        def score(ids: torch.Tensor) -> torch.Tensor:  # the learner's own log-probs: sampler ≈ learner
            return logprobs(core.model, ids.to(core.device), core.temperature, core.chunk)[0]

        def batch(seed: int):
            return synthetic_batch(args.samples, args.seq_len, args.prompt_len, core.vocab_size, seed, score)

        core.train_step(batch(0))  # warm-up: FSDP lazy init, allocator, kernels
        sync()
        say("warm-up step done")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, trained, losses = [], 0.0, []
        for i in range(args.steps):
            b = batch(i + 1)
            sync()
            t = time.perf_counter()
            m = core.train_step(b)
            sync()
            times.append(time.perf_counter() - t)
            trained += m["tokens"]
            losses.append(m["loss"])
            say(f"step {i + 1}/{args.steps}: {times[-1] * 1e3:.1f} ms, loss {m['loss']:+.4f}, "
                f"grad_norm {m['grad_norm']:.3f}, clip_frac {m['clip_frac']:.3f}")
        peak = torch.cuda.max_memory_allocated() if cuda else None
        total = sum(times)
        res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
               "model": name, "params": n_params, "vocab": core.vocab_size, "dtype": args.dtype,
               "fsdp": fsdp, "chunk": core.chunk, "samples": args.samples, "seq_len": args.seq_len,
               "prompt_len": args.prompt_len,
               "steps": args.steps, "step_s": times, "step_s_median": statistics.median(times),
               "trained_tokens_per_s": trained / total,
               "total_tokens_per_s": args.steps * args.samples * args.seq_len / total,
               "peak_cuda_bytes": peak, "build_s": build_s, "losses": losses}

        # one weight push, as push_weights makes it on a trainer rank, without a transport
        meta = core.state.hf_meta()
        boxes = core.state.push_boxes()
        plan = BucketPlan.from_state_dict(meta, cfg.weight_sync.bucket_mb << 20)
        shards = ShardPlan.build(plan, [[box for box, _ in boxes]])
        tensors = [t for _, t in boxes]
        push, all_sums = {}, {}
        pins = HostPins()
        for where in (["host", "host_pinned", "device"] if cuda else ["host"]):
            flat = torch.zeros(shards.totals[0], dtype=torch.uint8, device=device if where == "device" else "cpu")
            if where == "host_pinned" and not pins.pin(flat):  # page-locked in place, as push_weights does
                raise RuntimeError("gpu_check: CUDA refused to page-lock the host buffer")
            pack_s, sum_s, sums = [], [], None
            for r in range(args.pack_repeats):
                sync()
                t = time.perf_counter()
                sent = shards.pack(0, tensors, flat, version=core.version + r)
                sync()
                pack_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = shards.checksums(0, flat)
                sync()
                sum_s.append(time.perf_counter() - t)
                if sums is not None and got != sums:
                    raise RuntimeError(f"gpu_check: checksums of the same packed weights differ ({where})")
                sums = got
            all_sums[where] = sums
            push[where] = {"bytes": sent, "pack_s": pack_s, "checksum_s": sum_s, "tensors": len(sums),
                           "pack_gb_per_s": sent / statistics.median(pack_s) / 1e9}
        pins.release()
        if cuda and not all_sums["host"] == all_sums["host_pinned"] == all_sums["device"]:
            raise RuntimeError("gpu_check: the checksums of the host, page-locked host and device packs differ")
        res.update({"push": push, "buckets": plan.num_buckets, "bucket_mb": cfg.weight_sync.bucket_mb})

        # chunked vs full logits: one step each, peak CUDA memory
        compare = args.chunk_compare == "on" or (args.chunk_compare == "auto" and cuda)
        if compare and core.chunk and chunked.chunkable(core.model):
            phase, chunk = {}, core.chunk
            for c in (0, chunk):
                core.chunk = c
                b = batch(1000 + c)
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if cuda else 0
                t = time.perf_counter()
                core.train_step(b)
                sync()
                hi = torch.cuda.max_memory_allocated() if cuda else None
                phase[c] = {"step_s": time.perf_counter() - t, "peak_bytes": hi,
                            "peak_above_start_bytes": None if hi is None else hi - base}
            core.chunk = chunk
            res["chunk_vs_full"] = {str(k): v for k, v in phase.items()}
    finally:
        dist.destroy_process_group()

    report(res, args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")


def report(r: dict, args) -> None:
    med, ts = r["step_s_median"], r["step_s"]
    gib = 2 ** 30
    print(f"\n== gpu_check on {r['device']} (torch {r['torch']}): model {r['model']}, "
          f"{r['params'] / 1e6:.2f} M params, vocab {r['vocab']}, {r['dtype']} compute / float32 master, "
          f"{'FSDP2 1 rank' if r['fsdp'] else 'no FSDP'}, chunk {r['chunk']}")
    print(f"batch {r['samples']} x {r['seq_len']} tokens (prompt {r['prompt_len']}), {r['steps']} timed steps")
    print(f"step time        {med * 1e3:9.1f} ms median ({min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f})")
    print(f"tokens/s         {r['trained_tokens_per_s']:9.0f} trained (loss-mask), {r['total_tokens_per_s']:.0f} total")
    peak = r["peak_cuda_bytes"]
    print(f"peak memory      {'n/a on CPU' if peak is None else f'{peak / gib:9.3f} GiB'}"
          f"{'' if peak is None else ' (torch.cuda.max_memory_allocated, timed steps)'}")
    for where, p in r["push"].items():
        print(f"push pack {where:<6} {statistics.median(p['pack_s']) * 1e3:9.2f} ms median "
              f"({min(p['pack_s']) * 1e3:.2f}..{max(p['pack_s']) * 1e3:.2f}), {p['bytes'] / 2**20:.2f} MiB "
              f"({p['tensors']} tensors, {r['buckets']} bucket(s) of {r['bucket_mb']} MiB), "
              f"{p['pack_gb_per_s']:.2f} GB/s")
        print(f"checksum {where:<7} {statistics.median(p['checksum_s']) * 1e3:9.2f} ms median "
              f"({min(p['checksum_s']) * 1e3:.2f}..{max(p['checksum_s']) * 1e3:.2f})")
    if "chunk_vs_full" in r:
        full, ch = r["chunk_vs_full"]["0"], r["chunk_vs_full"][str(r["chunk"])]
        mem = "peak n/a on CPU" if full["peak_bytes"] is None else (
            f"peak {full['peak_bytes'] / gib:.3f} -> {ch['peak_bytes'] / gib:.3f} GiB "
            f"({ch['peak_bytes'] / full['peak_bytes']:.3f}x), above the step's start "
            f"{full['peak_above_start_bytes'] / gib:.3f} -> {ch['peak_above_start_bytes'] / gib:.3f} GiB")
        print(f"full vs chunked  one step each, full logits -> chunk {r['chunk']}: {mem}; "
              f"{full['step_s'] * 1e3:.1f} -> {ch['step_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
