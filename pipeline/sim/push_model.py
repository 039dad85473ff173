"""The weight push's cost model: what one push of a sharded model costs, and its fit to measurements.

One push of `bytes` (the model in the engines' dtype) from N trainer ranks, each sending its own
shard (`bytes_per_rank` ~ bytes / N, cut into `transfers_per_rank` buckets), to a receiver that
assembles every rank's pieces:

    t = fixed_s + N * per_rank_s + transfers_per_rank * per_transfer_s
        + bytes_per_rank / rank_Bps + bytes / recv_Bps

    fixed_s          per push: the calls that start and finish it, round trips
    per_rank_s       per trainer rank: its call, its header written and checked, the receiver's
                     stream from it (a receiver hears from every rank)
    per_transfer_s   per bucket a rank sends: one read / broadcast / copy call and its completion
    rank_Bps         what one rank moves per second: its pack (a cast and copy into its slot) and its
                     side of the wire; the ranks run at once, so only the slowest rank's share counts
    recv_Bps         what one receiver takes in per second: its side of the wire and its assembly copy

The time is the one the trainer's driver sees, from the push call until every rank and the receiver
are done. Linear in its five coefficients (seconds; per rank; per transfer; per byte), fitted by
non-negative least squares on relative residuals (a 4 MB push counts as much as a 400 MB one) to
the median push of every case (ranks, size, bucket size), so one push slowed by other work on the
machine does not pull the fit. `fit_transport` also fits the short form, fixed + per transfer +
bytes per rank (no per-rank and no receiver term), to show what those two terms buy.

A point (tools/bench/sync_cost.py measure) is a mapping with at least POINT_KEYS; `load_points` checks them
and names the point and key that is missing.

Example:
    pts = load_points("bench_out/sync_cost/points.json")
    fit = fit_transport([p for p in pts if p["transport"] == "rdma"])
    fit["params"]["per_transfer_s"], fit["r2"], fit["rel_err_max"]
    predict(fit["params"], ranks=4, transfers_per_rank=13, bytes_per_rank=50e6, total_bytes=200e6)
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import numpy as np

from pipeline.sim.fit import nnls

__all__ = ["FEATURES", "SHORT_FORM", "POINT_KEYS", "PointsError", "load_points", "features", "predict", "fit_points",
           "fit_transport", "bootstrap", "per_repeat", "medians"]

FEATURES = ("fixed_s", "per_rank_s", "per_transfer_s", "per_rank_byte_s", "per_byte_s")
"""The coefficients, in order: seconds; per trainer rank; per transfer of a rank; per byte of the
slowest rank; per byte received."""
SHORT_FORM = ("fixed_s", "per_transfer_s", "per_rank_byte_s")
"""The short form: without the per-rank and the receiver's terms."""
POINT_KEYS = ("transport", "ranks", "size_mb", "bucket_mb", "rep", "bytes_per_rank", "transfers_per_rank",
              "total_bytes", "e2e_s")


class PointsError(ValueError):
    """A points file that cannot be fitted; the message names the file, the point and the key."""


def load_points(path: str | Path) -> list[dict]:
    """The points of a measure run, each checked to have POINT_KEYS with a time > 0."""
    p = Path(path)
    if not p.is_file():
        raise PointsError(f"points file {p} does not exist: run tools/bench/sync_cost.py measure first")
    pts = json.loads(p.read_text()).get("points")
    if not pts:
        raise PointsError(f"points file {p}: no 'points'")
    for i, pt in enumerate(pts):
        gone = [k for k in POINT_KEYS if k not in pt]
        if gone:
            raise PointsError(f"points file {p}: point {i} has no {gone}")
        if not pt["e2e_s"] > 0:
            raise PointsError(f"points file {p}: point {i} has e2e_s={pt['e2e_s']!r}; a time > 0 expected")
    return pts


def features(ranks: float, transfers_per_rank: float, bytes_per_rank: float, total_bytes: float) -> list[float]:
    return [1.0, float(ranks), float(transfers_per_rank), float(bytes_per_rank), float(total_bytes)]


def predict(params: dict[str, float], ranks: float, transfers_per_rank: float, bytes_per_rank: float,
            total_bytes: float) -> float:
    """The model's push time, seconds, for one push (params: FEATURES' coefficients)."""
    x = features(ranks, transfers_per_rank, bytes_per_rank, total_bytes)
    return sum(params[k] * v for k, v in zip(FEATURES, x))


def _fx(p: dict) -> list[float]:
    return features(p["ranks"], p["transfers_per_rank"], p["bytes_per_rank"], p["total_bytes"])


def medians(points: list[dict]) -> list[dict]:
    """One point per case (ranks, size, bucket size): its median push time."""
    return [dict(ps[0], e2e_s=statistics.median(p["e2e_s"] for p in ps)) for ps in _cases(points).values()]


def fit_points(points: list[dict], use: tuple[str, ...] = FEATURES) -> dict[str, float]:
    """Coefficients (>= 0) minimising the squared relative error over the case medians of `points`;
    those not in `use` are 0."""
    idx = [FEATURES.index(k) for k in use]
    cases = medians(points)
    X = np.array([[_fx(p)[i] for i in idx] for p in cases], dtype=float)
    y = np.array([p["e2e_s"] for p in cases], dtype=float)
    coef = nnls(X / y[:, None], np.ones(len(y)))
    out = dict.fromkeys(FEATURES, 0.0)
    out.update({k: float(c) for k, c in zip(use, coef)})
    return out


def _cases(points: list[dict]) -> dict[tuple, list[dict]]:
    cases: dict[tuple, list[dict]] = {}
    for p in points:
        cases.setdefault((p["ranks"], p["size_mb"], p["bucket_mb"]), []).append(p)
    return cases


def _quality(params: dict[str, float], points: list[dict]) -> dict:
    """R² of the case medians and the relative error of each case median, with a row per case."""
    rows = []
    for (n, mb, bucket), ps in sorted(_cases(points).items()):
        med = {k: statistics.median(p[k] for p in ps) for k in ("e2e_s", "transfers_per_rank", "bytes_per_rank",
                                                                 "total_bytes")}
        fitted = predict(params, n, med["transfers_per_rank"], med["bytes_per_rank"], med["total_bytes"])
        rows.append(dict(ranks=n, size_mb=mb, bucket_mb=bucket, pushes=len(ps), median_s=med["e2e_s"],
                         min_s=min(p["e2e_s"] for p in ps), max_s=max(p["e2e_s"] for p in ps), fitted_s=fitted,
                         rel_err=fitted / med["e2e_s"] - 1, bytes_per_rank=med["bytes_per_rank"],
                         transfers_per_rank=med["transfers_per_rank"], total_bytes=med["total_bytes"]))
    y = np.array([r["median_s"] for r in rows])
    res = np.array([r["fitted_s"] - r["median_s"] for r in rows])
    r2 = 1 - float((res ** 2).sum() / ((y - y.mean()) ** 2).sum()) if len(rows) > 1 else float("nan")
    errs = [abs(r["rel_err"]) for r in rows]
    return dict(r2=r2, rel_err_median=statistics.median(errs), rel_err_max=max(errs), cases_table=rows)


def fit_transport(points: list[dict]) -> dict:
    """The fit of one transport's points: params (FEATURES), derived bandwidths (bytes/s; inf when a
    per-byte term fits to 0), quality (R², relative errors of the case medians, a row per case), the
    short form's quality for comparison, and the per-repeat fits' range."""
    params = fit_points(points)
    q = _quality(params, points)
    short_form = _quality(fit_points(points, SHORT_FORM), points)
    bw = {"rank_Bps": 1 / params["per_rank_byte_s"] if params["per_rank_byte_s"] else math.inf,
          "recv_Bps": 1 / params["per_byte_s"] if params["per_byte_s"] else math.inf}
    return dict(params=params, bandwidth=bw, cases=len(q["cases_table"]), pushes=len(points), **q,
                short_form=dict(params=fit_points(points, SHORT_FORM), r2=short_form["r2"],
                               rel_err_median=short_form["rel_err_median"], rel_err_max=short_form["rel_err_max"]),
                per_repeat=per_repeat(points))


def bootstrap(points: list[dict], resamples: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """5th..95th percentile of every coefficient over fits to `resamples` resamples of the pushes
    (each case's pushes drawn with replacement, so every case stays in)."""
    rng = random.Random(seed)
    cases = list(_cases(points).values())
    fits = [fit_points([rng.choice(ps) for ps in cases for _ in ps]) for _ in range(resamples)]
    return {k: (float(np.percentile([f[k] for f in fits], 5)), float(np.percentile([f[k] for f in fits], 95)))
            for k in FEATURES}


def per_repeat(points: list[dict]) -> dict[str, tuple[float, float]]:
    """min..max of every coefficient over fits of each repeat's pushes alone (rep 0, 1, ...)."""
    reps = sorted({p["rep"] for p in points})
    fits = [fit_points([p for p in points if p["rep"] == r]) for r in reps]
    return {k: (min(f[k] for f in fits), max(f[k] for f in fits)) for k in FEATURES}
