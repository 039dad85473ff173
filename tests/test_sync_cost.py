"""The push cost model (pipeline/sim/push_model.py, push_cluster.py; tools/bench/sync_cost.py): the fit
recovers known costs from synthetic pushes, and bad points or cluster files are errors naming what is
wrong. Pure and fast: no Monarch, no transports."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from pipeline.sim.costs import PushCosts
from pipeline.sim.push_cluster import ClusterFileError, check_cluster, load_cluster, planner_push, project
from pipeline.sim.push_model import FEATURES, PointsError, bootstrap, fit_transport, load_points, predict

REPO = Path(__file__).resolve().parents[1]
TRUE = {"fixed_s": 0.004, "per_rank_s": 0.002, "per_transfer_s": 2e-4, "per_rank_byte_s": 1 / 2e9,
        "per_byte_s": 1 / 5e9}


def _points(noise: float = 0.0, reps: int = 3, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pts = []
    for n in (1, 2, 4):
        for mb in (4, 20, 100, 400):
            for bucket in (1, 8, 64):
                total = mb * 1e6
                per_rank = total / n
                transfers = math.ceil(per_rank / (bucket << 20))
                t = predict(TRUE, n, transfers, per_rank, total)
                for rep in range(reps):
                    pts.append(dict(transport="x", ranks=n, size_mb=mb, bucket_mb=bucket, rep=rep,
                                    bytes_per_rank=per_rank, transfers_per_rank=transfers, total_bytes=total,
                                    e2e_s=t * (1 + rng.uniform(-noise, noise))))
    return pts


def test_fit_recovers_known_overhead_and_bandwidth():
    fit = fit_transport(_points())
    for k in FEATURES:
        assert fit["params"][k] == pytest.approx(TRUE[k], rel=1e-6), k
    assert fit["bandwidth"]["rank_Bps"] == pytest.approx(2e9, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["rel_err_max"] < 1e-6
    # without the per-rank and receiver terms the same pushes fit worse: the comparison can tell
    assert fit["short_form"]["rel_err_max"] > 0.05


def test_noisy_fit_stays_close_and_its_spread_covers_the_truth():
    pts = _points(noise=0.03, reps=5, seed=1)
    fit = fit_transport(pts)
    spread = bootstrap(pts, resamples=60, seed=2)
    for k in ("per_transfer_s", "per_rank_byte_s", "per_byte_s"):
        assert fit["params"][k] == pytest.approx(TRUE[k], rel=0.25), k
        lo, hi = spread[k]
        assert lo <= TRUE[k] * 1.1 and hi >= TRUE[k] * 0.9, (k, lo, hi)
    assert fit["rel_err_max"] < 0.05


def test_points_missing_a_key_name_the_point_and_key(tmp_path):
    pts = _points()
    del pts[5]["transfers_per_rank"]
    f = tmp_path / "points.json"
    f.write_text(json.dumps({"points": pts}))
    with pytest.raises(PointsError, match=r"point 5 has no \['transfers_per_rank'\]"):
        load_points(f)


def test_cluster_file_missing_a_field_is_an_error_naming_it(tmp_path):
    good = json.loads((REPO / "tools" / "plan" / "data" / "cluster_h100.json").read_text())
    check_cluster(good)
    for drop in ("nic_Bps", "per_transfer_s"):
        bad = {k: v for k, v in good.items() if k != drop}
        f = tmp_path / "c.json"
        f.write_text(json.dumps(bad))
        with pytest.raises(ClusterFileError, match=rf"c\.json: missing field\(s\) \['{drop}'\]"):
            load_cluster(f)
    bad = json.loads(json.dumps(good))
    del bad["models"]["70B"]["engines"]
    with pytest.raises(ClusterFileError, match=r"models\.70B\.engines"):
        check_cluster(bad)
    with pytest.raises(ClusterFileError, match=r"unknown field\(s\) \['nic_bps'\]"):
        check_cluster(dict(good, nic_bps=1.0))
    with pytest.raises(ClusterFileError, match=r"link_efficiency=0"):
        check_cluster(dict(good, link_efficiency=0))


def test_projection_orders_the_modes_as_the_model_says():
    cluster = load_cluster(REPO / "tools" / "plan" / "data" / "cluster_h100.json")
    rows = {(r["model"], r["mode"]): r for r in project(cluster)}
    for m in cluster["models"]:
        full = rows[(m, "sharded, full")]
        d1, d3 = rows[(m, "sharded, delta 1%")], rows[(m, "sharded, delta 3%")]
        assert d1["push_s"] < d3["push_s"] < full["push_s"] < rows[(m, "rank-0 gather, full")]["push_s"]
        assert full["shadow_stall_s"] == cluster["swap_s"] < full["stall_s"]
        # every trainer GPU sends its 1/N share to each engine: bf16 bytes over N, times the engines
        mc = cluster["models"][m]
        assert full["out_bytes_per_rank"] == pytest.approx(2 * mc["params"] / mc["trainer_gpus"] * mc["engines"])
    # the whole 70B model in bf16 (140 GB) does not fit on one 80 GB GPU: the gather is flagged
    assert not rows[("70B", "rank-0 gather, full")]["fits"]
    # as the planner's push section, the same seconds: pack + transfer + load is the push, load the stall
    row = rows[("8B", "sharded, full")]
    for shadow, stall in ((False, row["stall_s"]), (True, cluster["swap_s"])):
        push = PushCosts(**planner_push(cluster, row, shadow))
        assert push.pack_s() + push.transfer_s() + push.load_s() == pytest.approx(row["push_s"] + shadow * stall)
        assert push.load_s() == pytest.approx(stall)
