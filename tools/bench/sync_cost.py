"""A cost model of the weight push, fitted here and projected to a GPU cluster on paper.

    # heavy (Monarch procs, real transports): under the lock, each run bounded by --budget-s (no new
    # case after it); a case with --reps points in --out is skipped, so the same command resumes, and
    # a larger --reps adds that many pushes more to every case
    flock /tmp/rl-heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m tools.bench.sync_cost measure            # ~2 min
    flock /tmp/rl-heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m tools.bench.sync_cost measure --reps 6   # 9 per case
    .venv/bin/python -m tools.bench.sync_cost fit        # pure: fit.json, fit.md (the table), fit.png
    .venv/bin/python -m tools.bench.sync_cost project    # pure: 8B / 70B / 1T on tools/plan/data/cluster_h100.json

measure  tools/sync_bench_ranks.RankMesh (N trainer-rank procs, each a WeightSender over its FSDP2
         shard of a Qwen3-shaped float32 dict, one receiver assembling the whole bf16 dict: the real
         transports) over a grid of dict sizes, bucket sizes and 1/2/4 ranks per transport; every
         timed push is one raw point (after a warm-up push per case) in --out (points.json).
fit      per transport, non-negative least squares (relative error, case medians) of the push time
         the driver sees (pipeline/sim/push_model.py):
             t = fixed + N * per_rank + transfers_per_rank * per_transfer + bytes_per_rank / rank_bw
                 + bytes / recv_bw
         with every coefficient's spread (bootstrap of each case's pushes; fits of each repeat alone),
         R², the relative errors, the short form's (no per-rank, no receiver term) beside;
         fit.png: measured vs fitted.
project  the same form with the cluster file's parameters (no local figure is used: a CPU, the TCP
         fallback and 2 shared cores say nothing about NCCL over InfiniBand), for 8B, 70B and 1T:
         full and delta pushes, with and without shadow weights, beside the published figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from pipeline.sim.push_cluster import PUBLISHED, load_cluster, planner_push, project, projection_table
from pipeline.sim.push_model import FEATURES, bootstrap, fit_transport, load_points
from tools.lib.ranks import RankMesh
from tools.lib.cli import REPO

OUT = REPO / "bench_out" / "sync_cost"


def sized_meta(mb: float) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A Qwen3-shaped bf16 dict of about `mb` MB: layers of width 256 (under 20 MB) or 768, an
    embedding filling what the layers leave. More bytes bring more tensors, as in a real model."""
    dim = 256 if mb < 20 else 768
    ffn, kv = dim * 8 // 3, dim // 3
    layer = [("input_layernorm", (dim,)), ("self_attn.q_proj", (dim, dim)), ("self_attn.k_proj", (kv, dim)),
             ("self_attn.v_proj", (kv, dim)), ("self_attn.o_proj", (dim, dim)),
             ("post_attention_layernorm", (dim,)), ("mlp.gate_proj", (ffn, dim)), ("mlp.up_proj", (ffn, dim)),
             ("mlp.down_proj", (dim, ffn))]
    per_layer = 2 * sum(math.prod(s) for _, s in layer)
    target = int(mb * 1e6)
    layers = max(1, round(0.75 * target / per_layer))
    vocab = max(1, (target - layers * per_layer) // (2 * dim))
    meta = {"model.embed_tokens.weight": (torch.bfloat16, (vocab, dim))}
    for i in range(layers):
        meta |= {f"model.layers.{i}.{n}.weight": (torch.bfloat16, s) for n, s in layer}
    meta["model.norm.weight"] = (torch.bfloat16, (dim,))
    return meta


def points_of(rows: list[dict], world: int) -> list[dict]:
    """One point per timed push from RankMesh.push_rows' rows (one per push and rank): the slowest
    rank's figures, as the push waits for it."""
    by_push: dict[int, list[dict]] = {}
    for r in rows:
        by_push.setdefault(r["version"], []).append(r)
    return [{"bytes_per_rank": max(r["bytes"] for r in rs), "transfers_per_rank": max(r["buckets"] for r in rs),
             "pack_s": max(r["pack_s"] for r in rs), "push_s": max(r["push_s"] for r in rs),
             "pull_s": rs[0]["pull_s"], "e2e_s": rs[0]["e2e_s"]} for rs in by_push.values() if len(rs) == world]


def cmd_measure(a) -> int:
    out = Path(a.out)
    data = json.loads(out.read_text()) if out.exists() else {"points": []}
    done: dict[tuple, int] = {}
    for p in data["points"]:
        k = (p["transport"], p["ranks"], p["size_mb"], p["bucket_mb"])
        done[k] = done.get(k, 0) + 1
    t_start = time.monotonic()
    for world in [int(x) for x in a.ranks.split(",")]:
        cases = [(t, world, s, b) for s in [float(x) for x in a.sizes.split(",")] for t in a.transports.split(",")
                 for b in [int(x) for x in a.buckets.split(",")] if done.get((t, world, s, b), 0) < a.reps]
        if not cases:
            continue
        mesh = RankMesh(world)
        try:
            for t, _, s, b in cases:
                if time.monotonic() - t_start > a.budget_s:
                    print(f"budget of {a.budget_s:.0f} s spent; run again to go on", flush=True)
                    return 0
                meta = sized_meta(s)
                t0 = time.monotonic()
                rows, _ = mesh.push_rows(meta, t, b, a.reps)
                pts = points_of(rows, world)
                total = sum(2 * math.prod(shape) for _, shape in meta.values())
                for i, p in enumerate(pts):
                    data["points"].append(dict(p, transport=t, ranks=world, size_mb=s, bucket_mb=b,
                                               rep=done.get((t, world, s, b), 0) + i,
                                               total_bytes=total, measured=time.strftime("%Y-%m-%d %H:%M")))
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, indent=1))  # after every case: a stopped chunk keeps its points
                print(f"{t:<10} {world} rank(s) {s:6.0f} MB {b:3d} MiB buckets: e2e median "
                      f"{statistics.median(p['e2e_s'] for p in pts) * 1e3:8.1f} ms "
                      f"({len(pts)} pushes, case {time.monotonic() - t0:.1f} s)", flush=True)
        finally:
            mesh.stop()
    print(f"all cases in {out} have {a.reps} points", flush=True)
    return 0


def cmd_fit(a) -> int:
    points = load_points(a.points)
    fits = {}
    for t in dict.fromkeys(p["transport"] for p in points):
        pts = [p for p in points if p["transport"] == t]
        fits[t] = dict(fit_transport(pts), spread=bootstrap(pts, a.resamples, a.seed))
    text = fit_table(fits, a.resamples)
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": f"tools/bench/sync_cost.py fit --points {a.points}", "fits": fits}, indent=1))
    out.with_suffix(".md").write_text(text)
    plot_fit(points, fits, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0


UNITS = {"fixed_s": ("fixed ms", 1e3), "per_rank_s": ("per rank ms", 1e3),
         "per_transfer_s": ("per transfer µs", 1e6), "per_rank_byte_s": ("rank GB/s", None),
         "per_byte_s": ("receiver GB/s", None)}
"""How each coefficient is shown: a time in its unit, or a per-byte cost as its bandwidth (None)."""


def _show(k: str, v: float) -> str:
    name, scale = UNITS[k]
    if scale is None:  # seconds per byte as GB/s; 0 s/B is a term the fit dropped
        return "–" if v <= 0 else f"{1e-9 / v:.2f}"
    return f"{v * scale:.3g}"


def fit_table(fits: dict, resamples: int) -> str:
    """Markdown: per transport the coefficients, (bootstrap 5..95%) [per-repeat min..max], and the fit's
    quality beside the short form's."""
    lines = ["| transport | cases (pushes) | " + " | ".join(UNITS[k][0] for k in FEATURES) +
             " | R² | rel. error median / max | short form (no per-rank, no receiver term): R², max error |",
             "|---|---:|" + "---:|" * len(FEATURES) + "---:|---:|---:|"]
    for t, f in fits.items():
        cells = []
        for k in FEATURES:
            lo, hi = f["spread"][k]
            rlo, rhi = f["per_repeat"][k]
            # a bandwidth's interval runs the other way round: the larger cost is the lower bandwidth
            a, b = (_show(k, hi), _show(k, lo)) if UNITS[k][1] is None else (_show(k, lo), _show(k, hi))
            ra, rb = (_show(k, rhi), _show(k, rlo)) if UNITS[k][1] is None else (_show(k, rlo), _show(k, rhi))
            cells.append(f"{_show(k, f['params'][k])} ({a}..{b}) [{ra}..{rb}]")
        ro = f["short_form"]
        lines.append(f"| {t} | {f['cases']} ({f['pushes']}) | " + " | ".join(cells) +
                     f" | {f['r2']:.3f} | {f['rel_err_median']:.0%} / {f['rel_err_max']:.0%} | "
                     f"{ro['r2']:.3f}, {ro['rel_err_max']:.0%} |")
    lines.append(f"\n(x..y): 5th..95th percentile over {resamples} bootstrap resamples of each case's pushes; "
                 "[x..y]: range over fits of each repeat alone; –: the term fitted to 0 (no measurable cost).")
    return "\n".join(lines) + "\n"


def plot_fit(points: list[dict], fits: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(fits), figsize=(4.6 * len(fits), 4.2), squeeze=False)
    for ax, (t, fit) in zip(axes[0], fits.items()):
        for n, marker in ((1, "o"), (2, "s"), (4, "^")):
            pts = [p for p in fit["cases_table"] if p["ranks"] == n]
            ax.errorbar([p["fitted_s"] * 1e3 for p in pts], [p["median_s"] * 1e3 for p in pts],
                        yerr=[[(p["median_s"] - p["min_s"]) * 1e3 for p in pts],
                              [(p["max_s"] - p["median_s"]) * 1e3 for p in pts]],
                        fmt=marker, ms=4, label=f"{n} rank(s)", alpha=0.8)
        lo = min(p["fitted_s"] for p in fit["cases_table"]) * 1e3 * 0.8
        hi = max(p["max_s"] for p in fit["cases_table"]) * 1e3 * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = fitted")
        ax.set(xscale="log", yscale="log", xlabel="fitted push ms", ylabel="measured push ms (median, min..max)",
               title=f"{t}: R² {fit['r2']:.3f}, max rel err {fit['rel_err_max']:.0%}")
        ax.legend(fontsize=7)
    fig.suptitle("weight push on this machine (CPU, 2 cores; rdma = Monarch's TCP fallback): measured vs fitted",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_project(a) -> int:
    cluster = load_cluster(a.cluster)
    rows = project(cluster)
    text = projection_table(cluster, rows, PUBLISHED)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
        for r in rows:  # the planner's push section for each row (python -m tools.plan simulate --costs ...)
            r["planner_push"] = planner_push(cluster, r)
            if r["shadow_stall_s"] is not None:
                r["planner_push_shadow"] = planner_push(cluster, r, shadow=True)
        Path(a.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="heavy: run the push grid (hold /tmp/rl-heavy.lock)")
    m.add_argument("--transports", default="shm,rdma,collective")
    m.add_argument("--ranks", default="1,2,4")
    m.add_argument("--sizes", default="4,20,100,400", help="dict sizes, MB of bf16")
    m.add_argument("--buckets", default="1,8,64", help="bucket sizes, MiB")
    m.add_argument("--reps", type=int, default=3, help="timed pushes per case, after one warm-up")
    m.add_argument("--budget-s", type=float, default=420.0, help="start no new case after this many seconds")
    m.add_argument("--out", default=str(OUT / "points.json"))
    f = sub.add_parser("fit", help="pure: fit the measured points")
    f.add_argument("--points", default=str(OUT / "points.json"))
    f.add_argument("--resamples", type=int, default=200, help="bootstrap resamples of the cases")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--out", default=str(OUT / "fit.json"))
    p = sub.add_parser("project", help="pure: project to a GPU cluster")
    p.add_argument("--cluster", default=str(REPO / "tools" / "plan" / "data" / "cluster_h100.json"))
    p.add_argument("--out", default=str(OUT / "projection.md"))
    a = ap.parse_args(argv)
    return {"measure": cmd_measure, "fit": cmd_fit, "project": cmd_project}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
