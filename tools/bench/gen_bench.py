"""Generator throughput: GeneratorActor (Monarch + vLLM + bookkeeping) vs the bare vLLM engine.

    .venv/bin/python -m tools.bench.gen_bench                              # tiny model, ~2 min on CPU
    .venv/bin/python -m tools.bench.gen_bench --prompts 48 --max-new 128 --concurrency 8 --out bench_out/gen
    .venv/bin/python -m tools.bench.gen_bench --config configs/smollm2-135m-add.yaml --prompts 24 --max-new 64 \
        --concurrency 16 --out bench_out/gen_smollm2                 # a recipe's model, task and prompts

Same workload both ways, measured in one run (bare engine first, then the actor; never both at
once, so they do not share the CPU): `--prompts` prompt groups of `--group` samples from the
reverse task (or, with `--config`, that config's model and task, its prompts through its chat template,
at its temperature; trailing key=value overrides apply to it), `--max-new` tokens each (EOS ignored,
so the token count is fixed), temperature 1,
`--concurrency` requests in flight, behaviour logprobs on. The bare side drives an AsyncLLM with
the same engine args from a semaphore-bounded asyncio loop; the actor side is the real
GeneratorActor on its own proc, fed by a queue-backed source actor, counting until every rollout
has arrived at the source (so Monarch messaging, reward and bookkeeping are all included).
Each side gets one warm-up round first. Prints the ratio actor/bare (targets: >= 0.8 on the tiny model, >= 0.9 on a real one) and writes
gen_bench.csv, gen_bench.json and gen_bench.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
import time
from pathlib import Path

from pipeline.types import PromptItem
from tools.lib.sources import ListSource


def bench_cfg(args):
    from pipeline.config import Config, GeneratorConfig, ModelConfig, load_config

    if args.config is None:
        return Config(model=ModelConfig(), generator=GeneratorConfig(
            concurrency=args.concurrency, max_new_tokens=args.max_new, ignore_eos=True, temperature=1.0,
            max_model_len=256, on_update="keep"))
    return load_config(args.config, [*args.overrides, f"generator.concurrency={args.concurrency}",
                                     f"generator.max_new_tokens={args.max_new}", "generator.ignore_eos=true",
                                     "generator.on_update=keep", "generator.num_generators=1"])


def say(msg: str) -> None:
    print(f"[gen_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def run_bare(cfg, items: list[PromptItem], group: int, rounds: int) -> list[float]:
    """tokens/s of a bare AsyncLLM at the same concurrency, same sampling, same logprobs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pipeline.generator.llm import engine_args, start_llm, stop_engine, worker_in_core
    from pipeline.models.hf import model_dir
    from pipeline.tokens import encode_prompt, load_tokenizer

    hf_dir = model_dir(cfg.model)
    tok = load_tokenizer(hf_dir)
    engine = start_llm(engine_args(cfg, hf_dir, seed=0), worker_in_core(cfg))  # as the actor's engine
    g = cfg.generator
    sp = SamplingParams(max_tokens=g.max_new_tokens, temperature=g.temperature, top_p=1.0, logprobs=0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    sem = asyncio.Semaphore(g.concurrency)
    try:
        out = []
        for r in range(rounds):
            async def one(i: int, item: PromptItem) -> int:
                async with sem:
                    last = None
                    async for o in engine.generate({"prompt_token_ids": encode_prompt(tok, item.prompt, cfg.task.enable_thinking)},
                                                   sp, request_id=f"bare{r}-{i}"):
                        last = o
                    return len(last.outputs[0].token_ids)

            t0 = time.monotonic()
            n = sum(await asyncio.gather(*(one(i, it) for i, it in enumerate(x for x in items for _ in range(group)))))
            out.append(n / (time.monotonic() - t0))
            say(f"bare engine round {r}: {n} tokens, {out[-1]:.0f} tok/s")
        return out
    finally:
        stop_engine(engine)
        del engine  # its __del__ would otherwise run again at interpreter exit, after vLLM's modules are gone


async def run_actor(cfg, items: list[PromptItem], group: int, rounds: int) -> tuple[list[float], dict]:
    from monarch.actor import this_host

    from actors.generator import GeneratorActor

    gprocs = this_host().spawn_procs(per_host={"procs": 1})
    sprocs = this_host().spawn_procs(per_host={"procs": 1})
    gen = gprocs.spawn("gen", GeneratorActor, cfg, 0)
    src = sprocs.spawn("src", ListSource, group)
    try:
        say("actor: starting engine")
        await asyncio.wait_for(gen.setup.call_one(), cfg.generator.start_timeout_s)
        out = []
        for r in range(rounds):
            await src.feed.call_one(items)
            t0 = time.monotonic()
            await gen.start_generation.call_one(src)
            deadline = t0 + 600
            while (p := await src.progress.call_one())[0] < len(items) * group:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"actor round {r}: only {p[0]} rollouts after 600s")
                await asyncio.sleep(0.02)
            out.append(p[1] / (time.monotonic() - t0))
            await gen.end_stage.call_one("keep")
            say(f"actor round {r}: {p[1]} tokens, {out[-1]:.0f} tok/s")
        stats = await gen.stats.call_one()
        await gen.shutdown.call_one()
        return out, stats
    finally:
        await gprocs.stop()
        await sprocs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per side (after one warm-up)")
    ap.add_argument("--out", default="bench_out/gen_bench")
    ap.add_argument("--config", default=None, help="a run config whose model, task and temperature to use "
                    "(default: the tiny model on reverse at temperature 1)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of --config")
    args = ap.parse_args()
    if args.overrides and args.config is None:
        ap.error("overrides need --config")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from pipeline.tasks import load_task, take

    cfg = bench_cfg(args)
    items = take(load_task(cfg.task.name, cfg.task), 0, "train", args.prompts)
    say(f"workload: {cfg.model.hf_dir}, {cfg.task.name}: {args.prompts} prompts x {args.group} samples x "
        f"{args.max_new} tokens, N'={args.concurrency}, temperature {cfg.generator.temperature}")
    bare = asyncio.run(run_bare(cfg, items, args.group, args.rounds + 1))[1:]
    actor, stats = asyncio.run(run_actor(cfg, items, args.group, args.rounds + 1))
    actor = actor[1:]
    bare_best, actor_best = max(bare), max(actor)
    ratio = actor_best / bare_best
    say(f"bare {bare_best:.0f} tok/s (rounds {min(bare):.0f}..{max(bare):.0f}), actor {actor_best:.0f} tok/s "
        f"(rounds {min(actor):.0f}..{max(actor):.0f}), ratio of the best rounds actor/bare = {ratio:.3f}")

    summary = {"args": vars(args), "bare_tok_s": bare, "actor_tok_s": actor, "ratio": ratio,
               "actor_stats": {k: v for k, v in stats.items() if k != "errors"}}
    (out / "gen_bench.json").write_text(json.dumps(summary, indent=2, default=str))
    with open(out / "gen_bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["side", "round", "tokens_per_s"])
        w.writerows([("bare", i, v) for i, v in enumerate(bare)] + [("actor", i, v) for i, v in enumerate(actor)])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["bare vLLM", "GeneratorActor"], [bare_best, actor_best], color=["gray", "tab:blue"])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"ratio {ratio:.2f}  (N'={args.concurrency}, {args.max_new} tok)")
    fig.tight_layout()
    fig.savefig(out / "gen_bench.png", dpi=120)
    say(f"wrote {out}/gen_bench.{{json,csv,png}}")
    sys.exit(0)


if __name__ == "__main__":
    main()
