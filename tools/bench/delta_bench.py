"""Delta push on real training: wire bytes per push over a full push's, and end-to-end push time of
a delta push over a full one, measured in the same run.

    .venv/bin/python -m tools.bench.delta_bench --model tiny --lr 1e-6,1e-5          # ~3 min a run
    .venv/bin/python -m tools.bench.delta_bench --model 100m --lr 1e-5 --steps 7     # the ~76M checkpoint
    .venv/bin/python -m tools.bench.delta_bench --report outputs/delta_bench         # the table of every run so far

Each (model, lr) is one real CLI run (`python -m pipeline.run`, configs/tiny.yaml, two generators,
bf16 weights with fp32 master weights, no warm start) with weight_sync.delta=true and
weight_sync.full_every=2: even versions are pushed full, odd ones as a delta, so both kinds of push
run in the same run on the same weights, alternating (version 1, the first push, is full and left
out). From metrics.jsonl: sync/delta_fraction (wire bytes of the push to every generator over a full
push's: rdma reads whole delta buckets, so this includes the last bucket's slack) and sync/latency_s
(end to end: pack on the trainer, delta included, to every generator serving the version). Reports
the median with min..max of each, and the ratio of the medians. `tiny`: the tiny Qwen3-shaped model
(~3M parameters, the real vocabulary); `100m`: tools/bench/sync_bench.py's `100m-vllm` shape (768 wide,
12 layers, ~76M parameters). Writes runs.json and table.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from tools.lib.cli import REPO, check_cli
from tools.lib.metrics import read_rows

SMALL = ["run.eval_every=0", "run.progress=false", "run.warm_start_steps=0", "buffer.batch_groups=2",
         "buffer.group_size=4", "generator.concurrency=8", "generator.num_generators=2", "generator.max_new_tokens=16",
         "model.dtype=bfloat16", "weight_sync.delta=true", "weight_sync.full_every=2", "run.checkpoint_every=0"]
MODELS = {"tiny": None, "100m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048)}


def model_overrides(model: str) -> list[str]:
    """model.hf_dir of `model`: builtin:tiny, or a tiny checkpoint of that shape built once here."""
    if MODELS[model] is None:
        return []
    from pipeline.models.tiny import TinySpec, ensure_tiny

    return [f"model.hf_dir={ensure_tiny(TinySpec(**MODELS[model]))}"]


def run(model: str, lr: str, transport: str, steps: int, ranks: int, out: Path) -> dict:
    """One CLI run; its pushes split into delta and full ones."""
    out_dir = out / f"{model}-lr{lr}-{transport}-r{ranks}-{int(time.time())}"
    overrides = [*SMALL, *model_overrides(model), f"trainer.lr={lr}", f"weight_sync.transport={transport}",
                 f"trainer.num_ranks={ranks}", f"run.steps={steps}", f"run.out_dir={out_dir}"]
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    check_cli(REPO / "configs/tiny.yaml", overrides, out / f"{out_dir.name}.log", f"the run {out_dir.name}")
    rows = read_rows(out_dir / "metrics.jsonl")
    pushes: dict[float, dict] = {}  # a step reports the last finished push: one push may show twice
    for r in rows:
        lat, frac = r.get("sync/latency_s"), r.get("sync/delta_fraction")
        if lat is None or frac is None or lat != lat or r.get("step", 0) < 1:
            continue
        pushes[lat] = {"latency_s": lat, "fraction": frac, "delta": r.get("sync/delta_receivers", 0) > 0}
    ordered = list(pushes.values())[1:]  # the first push is full with nothing to diff against, and warms up
    return {"model": model, "lr": lr, "transport": transport, "ranks": ranks, "steps": steps, "dir": str(out_dir),
            "wall_s": time.monotonic() - t0, "delta": [p for p in ordered if p["delta"]],
            "full": [p for p in ordered if not p["delta"]]}


def spread(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}..{format(max(xs), fmt)}, n={len(xs)})"


def table(runs: list[dict]) -> str:
    lines = ["| model | lr | transport | ranks | delta bytes / full bytes | delta push s | full push s | "
             "push time delta / full |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        d, f = [p["latency_s"] for p in r["delta"]], [p["latency_s"] for p in r["full"]]
        ratio = f"{statistics.median(d) / statistics.median(f):.2f}" if d and f else "-"
        lines.append(f"| {r['model']} | {r['lr']} | {r['transport']} | {r['ranks']} | "
                     f"{spread([p['fraction'] for p in r['delta']], '.4f')} | {spread(d, '.3f')} | "
                     f"{spread(f, '.3f')} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--lr", default="1e-6,1e-5", help="comma-separated learning rates, one run each")
    ap.add_argument("--transport", default="rdma", choices=["rdma", "collective"])
    ap.add_argument("--ranks", type=int, default=1, help="trainer.num_ranks")
    ap.add_argument("--steps", type=int, default=9, help="run.steps: versions 3, 5, ... are deltas, 2, 4, ... full")
    ap.add_argument("--out", type=Path, default=REPO / "outputs/delta_bench")
    ap.add_argument("--report", action="store_true", help="only print the table of the runs in --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    db = args.out / "runs.json"
    runs = json.loads(db.read_text()) if db.exists() else []
    if not args.report:
        for lr in args.lr.split(","):
            runs.append(run(args.model, lr, args.transport, args.steps, args.ranks, args.out))
            db.write_text(json.dumps(runs, indent=1))
            print(table(runs[-1:]), flush=True)
    (args.out / "table.md").write_text(table(runs) + "\n")
    print(table(runs))


if __name__ == "__main__":
    main()
