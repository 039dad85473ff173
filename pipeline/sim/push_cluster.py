"""The push cost model (push_model.py) on paper for a stated GPU cluster: 8B, 70B and 1T models.

The cluster file (JSON, every key required, extra keys refused; `load_cluster` names the file and
the key) states the hardware and the layout, each figure with where it comes from:

    name, source                free text
    gpus_per_node               GPUs per node (NVLink inside a node, the NIC across)
    hbm_bytes                   memory per GPU
    hbm_Bps                     achievable HBM traffic per GPU (read + write bytes per second)
    nic_Bps                     network bandwidth per GPU, one direction (InfiniBand / RoCE)
    nvlink_Bps                  NVLink bandwidth per GPU, one direction (only the rank-0 gather uses it)
    link_efficiency             fraction of nic_Bps a bulk transfer reaches
    per_transfer_s, fixed_s     the model's per-bucket and per-push costs on this network
    bucket_bytes                bytes per transfer (a rank's bucket)
    load_Bps                    an engine's weight load (vLLM's load_weights: per-parameter loaders) per GPU
    swap_s                      the shadow-weights swap between two engine steps
    dtype_bytes, master_bytes   bytes per element in the engines (bf16: 2) and the trainer's master (fp32: 4)
    delta_elem_bytes            bytes per changed element in a delta (int32 index + bf16 value: 6)
    delta_fractions             the fractions of elements that change per step to project (e.g. 0.01, 0.03)
    models                      name -> {params, trainer_gpus, engines, engine_gpus}

Per model, trainer GPU r holds params / trainer_gpus elements (FSDP) and sends its shard to each of
the `engines` generator engines; an engine's GPU e receives its slice (params / engine_gpus
elements: the ShardPlan's `reads`, received straight into GPU memory). The push, in the fitted
form, with the network's figures in place of the local ones:

    pack   = elements_per_rank * pack_traffic / hbm_Bps          (full: read fp32 4 + write bf16 2 B;
                                                                  delta: + read and update the last bf16)
    wire   = fixed_s + transfers * per_transfer_s + max(out_bytes_per_rank, in_bytes_per_engine_gpu) / bw
             with bw = nic_Bps * link_efficiency, out = engines * shard bytes, transfers = the larger of
             a rank's buckets to all engines and an engine GPU's sources (every rank: the local
             fit's per-rank term) or buckets;
             the fitted form's two byte terms, but as a max: here both ends are copies by the same
             CPU cores and add up, there a byte leaves one NIC while it enters the other
    apply  = full: elements_per_engine_gpu * dtype_bytes / load_Bps   (vLLM's load, the engine paused)
             delta: changed elements * (delta_elem_bytes + 2 * dtype_bytes) / hbm_Bps (scatter in place)
    push   = pack + wire + apply;   stall = apply (today) | swap_s (shadow weights: the engine receives
             and applies into a second copy while it generates; needs 2x the weights per GPU)

and the rank-0 gather this project did before the sharded push, for comparison: the whole model to
one GPU (NVLink from its node, the NIC from the others), then `engines` copies out of its one NIC;
it needs the whole bf16 model in that GPU's memory.

Example:
    cluster = load_cluster("tools/plan/data/cluster_h100.json")
    rows = project(cluster)            # a dict per (model, mode): bytes, seconds, fits in memory
    print(projection_table(cluster, rows, PUBLISHED))
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from pipeline.sim.costs import PushCosts

__all__ = ["ClusterFileError", "CLUSTER_KEYS", "MODEL_KEYS", "PUBLISHED", "load_cluster", "check_cluster",
           "project", "projection_table", "planner_push"]

CLUSTER_KEYS = ("name", "source", "gpus_per_node", "hbm_bytes", "hbm_Bps", "nic_Bps", "nvlink_Bps",
                "link_efficiency", "per_transfer_s", "fixed_s", "bucket_bytes", "load_Bps", "swap_s",
                "dtype_bytes", "master_bytes", "delta_elem_bytes", "delta_fractions", "models")
MODEL_KEYS = ("params", "trainer_gpus", "engines", "engine_gpus")

PUBLISHED = [
    ("vLLM sharded RDT engine", "Kimi-K2 1T, bf16, every trainer rank sends its own shards", "1T",
     "7.5 s per push, ~1 TB/s aggregate"),
    ("prime-rl NIXL", "RDMA reads into each inference GPU", "any", "~44 GB/s per inference GPU"),
    ("verl sparse sync", "235B: only changed bf16 values", "235B",
     "11-15 s sparse vs ~250 s full broadcast (~21x); flat from 32B to 235B"),
    ("cosmos-rl", "receive into a second copy, swap at a safe point", "any", "stall 10 s -> about 0"),
]
"""Published figures (issue 26), set beside the projection: (system, what, model, figure)."""


class ClusterFileError(ValueError):
    """A cluster file that cannot be used; the message names the file and the key."""


def check_cluster(d: dict, where: str = "cluster") -> dict:
    """`d` checked: every CLUSTER_KEYS and MODEL_KEYS present, nothing else, numbers positive."""
    if not isinstance(d, dict):
        raise ClusterFileError(f"{where}: a mapping of {list(CLUSTER_KEYS)} expected")
    gone = [k for k in CLUSTER_KEYS if k not in d]
    if gone:
        raise ClusterFileError(f"{where}: missing field(s) {gone}; every one of {list(CLUSTER_KEYS)} is required")
    extra = sorted(set(d) - set(CLUSTER_KEYS))
    if extra:
        raise ClusterFileError(f"{where}: unknown field(s) {extra}")
    for k in CLUSTER_KEYS:
        if k in ("name", "source"):
            if not isinstance(d[k], str) or not d[k].strip():
                raise ClusterFileError(f"{where}: {k} must be a non-empty string")
        elif k == "delta_fractions":
            if not d[k] or any(not isinstance(f, (int, float)) or not 0 < f < 1 for f in d[k]):
                raise ClusterFileError(f"{where}: delta_fractions={d[k]!r}; a list of fractions in (0, 1) expected")
        elif k == "models":
            if not isinstance(d[k], dict) or not d[k]:
                raise ClusterFileError(f"{where}: models must map a name to {list(MODEL_KEYS)}")
            for name, m in d[k].items():
                gone = [f"models.{name}.{f}" for f in MODEL_KEYS if f not in m]
                if gone:
                    raise ClusterFileError(f"{where}: missing field(s) {gone}")
                extra = sorted(f"models.{name}.{f}" for f in set(m) - set(MODEL_KEYS))
                if extra:
                    raise ClusterFileError(f"{where}: unknown field(s) {extra}")
                for f in MODEL_KEYS:
                    _positive(m[f], f"models.{name}.{f}", where)
        else:
            _positive(d[k], k, where)
    if d["link_efficiency"] > 1:
        raise ClusterFileError(f"{where}: link_efficiency={d['link_efficiency']} must be <= 1")
    return d


def _positive(v, key: str, where: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ClusterFileError(f"{where}: {key}={v!r}; a finite number > 0 expected")


def load_cluster(path: str | Path) -> dict:
    """Read and check a cluster file; ClusterFileError names the file and what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise ClusterFileError(f"cluster file {p} does not exist")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ClusterFileError(f"cluster file {p}: not valid JSON: {e}") from None
    return check_cluster(d, str(p))


def _push(c: dict, m: dict, changed: float | None) -> dict:
    """One push of model `m` on cluster `c`: a full push (changed None) or a delta of that fraction."""
    n, engines, t = m["trainer_gpus"], m["engines"], m["engine_gpus"]
    rank_elems, engine_elems = m["params"] / n, m["params"] / t
    bw = c["nic_Bps"] * c["link_efficiency"]
    if changed is None:
        per_elem, pack_traffic = c["dtype_bytes"], c["master_bytes"] + c["dtype_bytes"]
        apply = engine_elems * c["dtype_bytes"] / c["load_Bps"]
    else:
        per_elem = changed * c["delta_elem_bytes"]
        # read the master and the last sent bf16, write the new bf16 and the changed (index, value) pairs
        pack_traffic = c["master_bytes"] + 2 * c["dtype_bytes"] + per_elem
        apply = engine_elems * changed * (c["delta_elem_bytes"] + 2 * c["dtype_bytes"]) / c["hbm_Bps"]
    out_bytes, in_bytes = engines * rank_elems * per_elem, engine_elems * per_elem
    # a rank sends at least one bucket to each engine; an engine GPU hears from every rank (its
    # slice of a column-split tensor spans every rank's rows)
    transfers = max(engines * math.ceil(rank_elems * per_elem / c["bucket_bytes"]), n,
                    math.ceil(in_bytes / c["bucket_bytes"]))
    pack = rank_elems * pack_traffic / c["hbm_Bps"]
    wire = c["fixed_s"] + transfers * c["per_transfer_s"] + max(out_bytes, in_bytes) / bw
    weights_per_gpu = engine_elems * c["dtype_bytes"]
    return dict(out_bytes_per_rank=out_bytes, in_bytes_per_engine_gpu=in_bytes, transfers_per_rank=transfers,
                pack_s=pack, wire_s=wire, apply_s=apply, push_s=pack + wire + apply,
                stall_s=apply, shadow_stall_s=c["swap_s"],
                aggregate_Bps=engines * m["params"] * c["dtype_bytes"] / (pack + wire + apply),
                per_engine_gpu_Bps=in_bytes / wire,
                fits=weights_per_gpu <= c["hbm_bytes"], shadow_fits=2 * weights_per_gpu <= c["hbm_bytes"],
                fits_note=f"{weights_per_gpu / 1e9:.0f} GB of weights per engine GPU, "
                          f"{2 * weights_per_gpu / 1e9:.0f} GB with shadow weights")


def _gather(c: dict, m: dict) -> dict:
    """Rank 0 gathers the whole model (NVLink from its node, the NIC from the rest), then sends it out."""
    n, engines, t = m["trainer_gpus"], m["engines"], m["engine_gpus"]
    model = m["params"] * c["dtype_bytes"]
    bw = c["nic_Bps"] * c["link_efficiency"]
    local = min(n, c["gpus_per_node"]) - 1
    gather = max(local * model / n / c["nvlink_Bps"], (n - 1 - local) * model / n / bw)
    transfers = math.ceil(engines * model / c["bucket_bytes"])
    wire = c["fixed_s"] + transfers * c["per_transfer_s"] + max(engines * model, model / t) / bw
    apply = m["params"] / t * c["dtype_bytes"] / c["load_Bps"]
    pack = m["params"] * (c["master_bytes"] + c["dtype_bytes"]) / c["hbm_Bps"]
    total = gather + pack + wire + apply
    return dict(out_bytes_per_rank=engines * model, in_bytes_per_engine_gpu=model / t, transfers_per_rank=transfers,
                pack_s=gather + pack, wire_s=wire, apply_s=apply, push_s=total, stall_s=apply,
                shadow_stall_s=None, shadow_fits=False,
                aggregate_Bps=engines * model / total, per_engine_gpu_Bps=model / t / wire,
                fits=model <= c["hbm_bytes"], fits_note=f"{model / 1e9:.0f} GB on rank 0")


def project(c: dict) -> list[dict]:
    """A row per model and mode: rank-0 gather, full, delta at each fraction; `stall_s` without
    shadow weights, `shadow_stall_s` with them (None for the gather: it has no second copy)."""
    rows = []
    for name, m in c["models"].items():
        head = dict(model=name, params=m["params"], trainer_gpus=m["trainer_gpus"], engines=m["engines"],
                    engine_gpus=m["engine_gpus"])
        rows.append(dict(head, mode="rank-0 gather, full", **_gather(c, m)))
        for changed in (None, *c["delta_fractions"]):
            mode = "sharded, full" if changed is None else f"sharded, delta {changed:.0%}"
            rows.append(dict(head, mode=mode, **_push(c, m, changed)))
    return rows


def planner_push(c: dict, row: dict, shadow: bool = False) -> dict:
    """A projected row as the planner's cost-file `push` section (pipeline/sim/costs.py), so that
    `python -m tools.plan simulate` can run the cluster with it: `bytes` the bf16 model, the pack and the
    wire as pack and transfer, the apply as the load (the engine stalls for it); with shadow weights
    the apply joins the transfer (generation goes on) and the load is the swap."""
    model = row["params"] * c["dtype_bytes"]
    base = c["fixed_s"] + row["transfers_per_rank"] * c["per_transfer_s"]
    moved = row["wire_s"] - base + (row["apply_s"] if shadow else 0.0)
    load = (c["swap_s"], 0.0) if shadow else (0.0, row["apply_s"] / model)
    return asdict(PushCosts(bytes=model, pack_base_s=0.0, pack_per_byte_s=row["pack_s"] / model,
                            transfer_base_s=base, transfer_per_byte_s=moved / model,
                            load_base_s=load[0], load_per_byte_s=load[1]))


def projection_table(c: dict, rows: list[dict], published: list[tuple]) -> str:
    """Markdown: the projection per model and mode, then the published figures beside ours."""
    lines = [f"Projected on paper for {c['name']} (every parameter and its source: the cluster file). "
             "Nothing in this table was measured.", "",
             "| model | trainer GPUs → engines × GPUs | mode | out GB / trainer GPU | in GB / engine GPU | "
             "pack s | wire s | apply s | push s | stall s: today / shadow | model TB/s delivered | "
             "wire GB/s per engine GPU | memory |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        shadow = "–" if r["shadow_stall_s"] is None else \
            (f"{r['shadow_stall_s']:.3f}" if r["shadow_fits"] else "no room")
        mem = "fits" if r["fits"] else "DOES NOT FIT"
        lines.append(
            f"| {r['model']} | {r['trainer_gpus']} → {r['engines']} × {r['engine_gpus']} | {r['mode']} | "
            f"{r['out_bytes_per_rank'] / 1e9:.2f} | {r['in_bytes_per_engine_gpu'] / 1e9:.2f} | {r['pack_s']:.3f} | "
            f"{r['wire_s']:.3f} | {r['apply_s']:.3f} | {r['push_s']:.2f} | {r['stall_s']:.3f} / {shadow} | "
            f"{r['aggregate_Bps'] / 1e12:.2f} | {r['per_engine_gpu_Bps'] / 1e9:.1f} | {mem}: {r['fits_note']} |")
    lines += ["", "pack s: for the rank-0 gather, the gather and its pack. model TB/s delivered: engines × the "
              "bf16 model over the push time (for a delta, the model it brings up to date). wire GB/s per engine "
              "GPU: what an engine GPU receives over the wire time.",
              "", "| published | what | model | figure | projected here |", "|---|---|---|---|---|"]
    by = {(r["model"], r["mode"]): r for r in rows}
    for system, what, model, figure in published:
        lines.append(f"| {system} | {what} | {model} | {figure} | {_beside(system, c, by)} |")
    return "\n".join(lines) + "\n"


def _beside(system: str, c: dict, by: dict) -> str:
    """Our projected figure that answers the published one."""
    names = list(c["models"])
    big = names[-1]
    if system.startswith("vLLM"):
        r = by.get((big, "sharded, full"))
        return f"{big} full push {r['push_s']:.2f} s, {r['aggregate_Bps'] / 1e12:.2f} TB/s aggregate" if r else "–"
    if system.startswith("prime-rl"):
        r = by.get((big, "sharded, full"))
        return f"{r['per_engine_gpu_Bps'] / 1e9:.1f} GB/s per engine GPU on the wire ({big})" if r else "–"
    if system.startswith("verl"):
        out = []
        for name in names[1:]:
            full = by[(name, "sharded, full")]["push_s"]
            gather = by[(name, "rank-0 gather, full")]["push_s"]
            deltas = [by[(name, f"sharded, delta {f:.0%}")]["push_s"] for f in c["delta_fractions"]]
            out.append(f"{name}: delta {min(deltas):.2f}-{max(deltas):.2f} s vs full {full:.2f} s "
                       f"({full / max(deltas):.0f}-{full / min(deltas):.0f}x), vs rank-0 gather {gather:.1f} s")
        return "; ".join(out)
    if system.startswith("cosmos"):
        rs = [(n, by[(n, "sharded, full")]["stall_s"]) for n in names]
        return ("stall today " + ", ".join(f"{n} {s:.2f} s" for n, s in rs) +
                f"; with shadow weights {c['swap_s'] * 1e3:.0f} ms (swap_s, assumed) at every size")
    return "–"
