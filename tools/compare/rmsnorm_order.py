"""Trainer vs HF transformers in bf16 with each RMSNorm rounding order: torch's (F.rms_norm: the float32
normalised input times the weight, rounded once) and HF's/vLLM's (rounded to bf16, then times the bf16
weight; pipeline/models/norm.py, what the trainer computes).

    python -m tools.compare.rmsnorm_order [--seeds 0 1 2] [--layers 4] [--tokens 2x128] \\
        [--out docs/results/data/audit-rmsnorm.json]

Per seed: a random Qwen3 of Qwen3-0.6B's widths (1024 wide, head_dim 128, q/k norms, the 151,936-row
vocabulary, tied) with `--layers` layers, weights N(0, 0.02) and norm weights 1 + 0.2·N(0, 1) (with every
norm weight 1 the two orders agree: x·1 is exact), stored bf16. The trainer's model (build_model in bf16,
the numbers its FSDP2 bf16 cast of the float32 master computes: tests/test_bf16.py) and HF's
Qwen3ForCausalLM in bf16 score the same random token rows. Prints per seed and over the seeds (mean,
min..max): the mean |Δ log p| of the next tokens, and over the whole distribution, trainer vs HF, for
each order; their ratio; the share of the norms' outputs one order puts a bf16 step from the other.
Writes the figures to --out. About 1 minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchtitan.models.common.nn_modules import RMSNorm

from pipeline.models.hf import build_model
from pipeline.models.norm import HFRMSNorm
from pipeline.models.qwen3_checkpoint import qwen3_config, random_weights

ORDERS = ("torch", "hf")


def checkpoint(out: Path, layers: int, seed: int) -> Path:
    """A random bf16 Qwen3 folder (config.json + model.safetensors) whose norm weights are not 1."""
    conf = qwen3_config(layers=layers)
    sd = random_weights(conf, seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    for name, t in sd.items():
        if name.endswith("norm.weight"):
            sd[name] = (1 + 0.2 * torch.randn(t.shape, generator=gen)).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def set_order(model: torch.nn.Module, order: str) -> None:
    """Every norm of `model` rounds in `order`: torch's (torchtitan's RMSNorm, the class it derives from)
    or HF's (HFRMSNorm). Same module, same weight: only the forward changes."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.__class__ = HFRMSNorm if order == "hf" else RMSNorm


def steps_apart(hf: torch.nn.Module) -> tuple[int, int]:
    """Hooks on HF's norms: (outputs where the two orders differ, outputs) over the forwards that follow."""
    count = [0, 0]

    def hook(mod, args, out):
        x = args[0].float()
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)
        torch_order = (h * mod.weight.float()).to(torch.bfloat16)
        count[0] += int((torch_order != out).sum())
        count[1] += out.numel()

    for name, m in hf.named_modules():
        if name.endswith("norm"):
            m.register_forward_hook(hook)
    return count


def measure(hf_dir: Path, rows: int, length: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    model, _ = build_model(hf_dir, dtype=torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16).eval()
    count = steps_apart(hf)
    ids = torch.randint(0, 151_669, (rows, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)
        out = {"seed": seed, "norm_outputs_apart": count[0] / count[1]}
        for order in ORDERS:
            set_order(model, order)
            ours = torch.log_softmax(model(ids).float(), -1)
            tok = torch.gather((ours - ref)[:, :-1], 2, ids[:, 1:, None])
            out[order] = {"token_dlogp_mean": tok.abs().mean().item(), "token_dlogp_max": tok.abs().max().item(),
                          "dist_dlogp_mean": (ours - ref).abs().mean().item()}
    return out


def spread(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="2x128", help="rows x length of the random token batch")
    ap.add_argument("--out", default="docs/results/data/audit-rmsnorm.json")
    args = ap.parse_args()
    rows, length = (int(v) for v in args.tokens.split("x"))
    torch.set_grad_enabled(False)
    runs = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(checkpoint(Path(tmp), args.layers, seed), rows, length, seed)
        runs.append(r)
        print(f"seed {seed}: norm outputs a bf16 step apart {r['norm_outputs_apart']:.3f}; mean |Δ log p| "
              f"(next tokens) torch order {r['torch']['token_dlogp_mean']:.3e}, HF order {r['hf']['token_dlogp_mean']:.3e}")
    summary = {order: {k: spread([r[order][k] for r in runs]) for k in runs[0][order]} for order in ORDERS}
    summary["norm_outputs_apart"] = spread([r["norm_outputs_apart"] for r in runs])
    t, h = summary["torch"]["token_dlogp_mean"], summary["hf"]["token_dlogp_mean"]
    summary["ratio_hf_over_torch"] = h["mean"] / t["mean"]
    print(f"over {len(runs)} seeds, mean |Δ log p| trainer vs HF (next tokens): torch order {t['mean']:.3e} "
          f"({t['min']:.3e}..{t['max']:.3e}), HF order {h['mean']:.3e} ({h['min']:.3e}..{h['max']:.3e}); "
          f"ratio {summary['ratio_hf_over_torch']:.3f}")
    d = summary["torch"]["dist_dlogp_mean"], summary["hf"]["dist_dlogp_mean"]
    print(f"over the whole distribution: torch order {d[0]['mean']:.3e}, HF order {d[1]['mean']:.3e}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": {"layers": args.layers, "seeds": args.seeds, "tokens": args.tokens,
                                                     "dtype": "bfloat16", "norm_weights": "1 + 0.2 N(0,1)"},
                                          "runs": runs, "summary": summary}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
