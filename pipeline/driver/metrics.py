"""Metrics sinks: JSONL + TensorBoard on disk (and W&B), a progress bar, the end-of-run summary plot.

    sink = MetricsSink(out_dir, wandb="off")
    sink.log(step, {"reward/mean": 0.4, "staleness/mean": 0.5})
    sink.log_rollouts(step, trained_samples(batch, tokenizer.decode, k=2, pad_id=special.pad))   # rollouts.jsonl
    sink.close()
    plot_summary(out_dir / "metrics.jsonl", out_dir / "summary.png")
    row.update(reward_metrics(generator_stats, job))   # reward latency, the reward model's and teacher's counters
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline.driver.wandb_sink import open_wandb

if TYPE_CHECKING:
    from pipeline.types import Batch


def _scalar(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line of a killed run: dropped


def _restart_log(path: Path, resume_step: int | None) -> None:
    """A fresh run (resume_step None) empties `path`; a resumed one keeps its rows up to resume_step."""
    keep = []
    if resume_step is not None and path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and _row_step(line) <= resume_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)  # a crash here leaves the old file or the kept rows, never half


def trained_samples(batch: Batch, decode: Callable[[list[int]], str], k: int, pad_id: int | None = None) -> list[dict]:
    """k rows of a trained batch, spread over it (rows j*N//k, so over several groups), for the rollouts
    log. Layout (pipeline/types.py): prompt tokens, completion tokens (loss_mask 1), then pad_id (the
    checkpoint's, Job.special.pad; None: a row without completion tokens is shown whole); a
    multi-turn completion runs from the first model token to the last, observations included
    (loss_mask 0, version -1). `versions` has one entry per completion token; staleness is
    trainer_version - min(model token versions)."""
    n, stale, rows = batch.num_samples, batch.staleness(), []
    k = min(k, n)
    for i in (j * n // k for j in range(k)):  # distinct and increasing, as k <= n
        ids, mask = batch.input_ids[i], batch.loss_mask[i] > 0
        done = mask.nonzero().flatten().tolist()
        span = slice(done[0], done[-1] + 1) if done else slice(0, 0)
        if done:
            prompt = ids[:done[0]].tolist()
        else:  # no completion token: the prompt is the row up to its padding
            prompt = ids.tolist()
            while pad_id is not None and prompt and prompt[-1] == pad_id:
                prompt.pop()
        rows.append({"group_id": batch.group_ids[i], "trainer_version": batch.trainer_version,
                     "staleness": int(stale[i]), "reward": float(batch.rewards[i]),
                     "advantage": float(batch.advantages[i]), "prompt": decode(prompt),
                     "completion": decode(ids[span].tolist()), "versions": batch.versions[i][span].tolist()})
    return rows


def rollouts_markdown(step: int, rows: list[dict]) -> str:
    """TensorBoard text of one step's logged samples (indented: shown as preformatted text)."""
    out = []
    for r in rows:
        out.append(f"step {step} · group {r['group_id']} · reward {r['reward']:.3f} · staleness {r['staleness']} "
                   f"(trainer version {r['trainer_version']})\n\n"
                   f"    prompt:     {r['prompt']!r}\n    completion: {r['completion']!r}\n"
                   f"    versions:   {r['versions']}")
    return "\n\n".join(out)


class MetricsSink:
    """One JSON line per `log` call (all values), TensorBoard scalars (numeric values), and with
    `log_rollouts` a few trained samples per step in rollouts.jsonl and TensorBoard text. With
    wandb=offline|online the same scalars and samples go to W&B as well (pipeline/driver/wandb_sink.py).

    A run owns its out_dir's metrics: a fresh run (`resume_step=None`) starts metrics.jsonl and
    rollouts.jsonl anew; a resumed one keeps the rows up to its checkpoint's step, drops the later ones
    (logged after that checkpoint by the run that died) and appends, so no step appears twice.
    TensorBoard events from `resume_step + 1` on are purged likewise.
    """

    def __init__(self, out_dir: str | Path, resume_step: int | None = None, wandb: str = "off",
                 config: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.rollouts_path = self.out_dir / "rollouts.jsonl"
        _restart_log(self.path, resume_step)
        if self.rollouts_path.exists():  # written from the first log_rollouts on; none with run.log_rollouts=0
            _restart_log(self.rollouts_path, resume_step)
        self._wandb = open_wandb(wandb, self.out_dir, config or {}, resume_step)
        self._f = self.path.open("a")
        self._rollouts = None
        self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"),
                                 purge_step=None if resume_step is None else resume_step + 1)
        self._t0 = time.monotonic()

    def log(self, step: int, metrics: dict[str, Any], at: float | None = None) -> None:
        """One row; `time_s` is when it was complete: `at` (time.monotonic()) or now."""
        rec = {"step": step, "time_s": round((time.monotonic() if at is None else at) - self._t0, 3), **metrics}
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()
        scalars = {k: s for k, v in rec.items() if k != "step" and (s := _scalar(v)) is not None}
        for k, s in scalars.items():
            if k != "time_s":
                self._tb.add_scalar(k, s, step)
        self._wandb.log(step, scalars)

    def log_rollouts(self, step: int, rows: list[dict]) -> None:
        """Rows of `trained_samples` for `step`: one JSON line each, one TensorBoard text, W&B table rows."""
        if not rows:
            return
        if self._rollouts is None:
            self._rollouts = self.rollouts_path.open("a")
        self._rollouts.write("".join(json.dumps({"step": step, **r}) + "\n" for r in rows))
        self._rollouts.flush()
        self._tb.add_text("rollouts", rollouts_markdown(step, rows), step)
        self._wandb.log_rollouts(step, rows)

    def close(self) -> None:
        self._f.close()
        if self._rollouts is not None:
            self._rollouts.close()
        self._tb.close()
        self._wandb.close()


class Progress:
    """tqdm bar over RL steps showing reward, staleness, tokens/s and version lag."""

    def __init__(self, total: int, enabled: bool, desc: str = "rl"):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)

    def update(self, metrics: dict[str, Any]) -> None:
        keys = {"reward": "reward/mean", "stale": "staleness/mean", "tok/s": "throughput/gen_tokens_per_s",
                "lag": "version/lag", "Δ": "buffer/delta"}
        self._bar.set_postfix({k: f"{metrics[m]:.3g}" for k, m in keys.items() if _scalar(metrics.get(m)) is not None})
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Rows of one shape as CSV (the benchmarks' tabular output)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


SUMMARY_PANELS = [
    ("reward", ["reward/mean", "eval/reward", "eval/reward_greedy"]),
    ("staleness", ["staleness/mean", "staleness/max"]),
    ("over-commitment Δ", ["buffer/delta"]),
    ("weight sync latency (s)", ["sync/latency_s"]),
    ("throughput", ["throughput/samples_per_s"]),
    ("trainer idle fraction", ["trainer/idle_frac"]),
    ("policy entropy (nats/token)", ["entropy"]),
    ("response length (tokens)", ["response/length_mean", "response/length_min"]),
    ("groups without signal", ["groups/zero_variance_frac", "collapse/active"]),
]


def plot_summary(jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
    """One panel per SUMMARY_PANELS entry, metric vs step; missing metrics leave a panel empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(jsonl)
    fig, axes = plt.subplots(3, 3, figsize=(14, 10))
    for ax, (name, keys) in zip(axes.flat, SUMMARY_PANELS):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if _scalar(r.get(k)) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="." if len(pts) < 50 else None, label=k)
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title or str(Path(jsonl).parent))
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def reward_metrics(gens: list[dict], job: Any) -> dict[str, float]:
    """Reward latency after EOS (median over the generators' recent samples) and, with a reward
    model or a teacher, its stream and restart counters (its stats as of the supervisor's last
    probe), the teacher's top-1 agreement, wait after EOS and overlap with generation."""
    lat = [x for g in gens for x in g.get("reward_latency_s", [])]
    out = {"reward/latency_after_eos_s": statistics.median(lat) if lat else float("nan")}
    rm = job.fleet.reward_model
    if rm is not None:
        rms = [g["reward_model"] for g in gens if g.get("reward_model")]
        rs = rm.stats or {}
        out.update({"reward_model/restarts": float(rm.incarnation),
                    "reward_model/score_mean": statistics.fmean([r["score_mean"] for r in rms]) if rms else float("nan"),
                    "reward_model/chunks": float(sum(r["chunks"] for r in rms)),
                    "reward_model/resent_whole": float(sum(r["resent_whole"] for r in rms)),
                    "reward_model/held_streams": float(rs.get("held", 0)),
                    "reward_model/busy_frac": float(rs.get("busy_frac", 0.0)),
                    "reward_model/ops_per_forward": float(rs.get("ops_per_forward", 0.0))})
    t = job.fleet.teacher
    if t is not None:
        ts = [g["teacher"] for g in gens if g.get("teacher")]
        st = t.stats or {}
        tok = sum(x["tokens"] for x in ts)
        scored = sum(x["scored"] for x in ts)
        streamed = float(st.get("prefill_tokens", 0))
        total = streamed + float(st.get("finish_tokens", 0)) + float(st.get("whole_tokens", 0))
        busy = float(st.get("busy_s", 0.0))
        out.update({"teacher/restarts": float(t.incarnation),
                    # the share of sampled tokens that are the teacher's most likely token
                    "teacher/top1_agreement": sum(x["top1"] for x in ts) / tok if tok else float("nan"),
                    # seconds from EOS to the teacher's log-probs, mean over the rollouts so far
                    "teacher/wait_after_eos_s": sum(x["wait_s"] for x in ts) / scored if scored else float("nan"),
                    # the share of the teacher's scored tokens that it took while the rollout was generated
                    "teacher/overlap_frac": streamed / total if total else float("nan"),
                    "teacher/busy_s": busy,
                    "teacher/resent_whole": float(sum(x["resent_whole"] for x in ts)),
                    "teacher/held_streams": float(st.get("held", 0))})
    return out
