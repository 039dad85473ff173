"""Over-commitment simulator: Δ = 0 vs fixed Δ vs adaptive Δ (OPPO) on the real ReplayBufferCore.

    .venv/bin/python -m tools.bench.overcommit_sim                       # defaults, a few seconds
    .venv/bin/python -m tools.bench.overcommit_sim --fixed-delta 8 --max-staleness 2 --len-sigma 1.4

Pure logic on a simulated clock; no engine, no Monarch. Prints a table (samples per simulated
second, mean staleness of trained samples, trainer wait, drops, mean Δ) and writes summary.json
and overcommit.png into --out. Model:

- Lengths are lognormal (median --len-median tokens, --len-sigma), capped at --max-len: a long tail.
- Each generator is a batched decoder that keeps up to --concurrency sequences in flight. One
  iteration advances every active sequence by --chunk tokens and takes
  chunk · (decode_base_ms + decode_per_seq_ms · active) ms, i.e. decoding is memory bound and
  extra sequences are nearly free, which is what over-commitment exploits. A generator pulls a new
  group whenever it has room for G more sequences and the buffer admits one.
- The trainer takes a batch when the buffer is ready, trains for --step-time s, moves to v+1; the
  generators load v+1 --sync-lag s later and keep their in-flight sequences (partial rollouts:
  later tokens carry the new version). Rollouts carry one token per chunk to keep tensors small.
- Reward of a sample ~ N(p(v), 0.15) clipped to [0, 1], p rising from 0.1 to 0.9 with time constant
  --reward-tau steps, so the adaptive controller sees a rising, then flat, reward curve.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.buffer import ReplayBufferCore
from pipeline.config import BufferConfig
from pipeline.types import PromptItem, Rollout


@dataclass
class SimConfig:
    steps: int = 100
    generators: int = 2
    concurrency: int = 64
    len_median: float = 256.0
    len_sigma: float = 1.0
    max_len: int = 4096
    chunk: int = 16
    decode_base_ms: float = 20.0
    decode_per_seq_ms: float = 0.2
    step_time: float = 10.0
    sync_lag: float = 0.5
    reward_tau: float = 20.0
    seed: int = 0


_HELP = {
    "steps": "trainer steps per mode", "generators": "generator engines",
    "concurrency": "N': sequences each generator keeps in flight at most",
    "len_median": "median completion length (tokens)", "len_sigma": "lognormal sigma (tail weight)",
    "max_len": "completion length cap (tokens)", "chunk": "tokens per simulated decode iteration",
    "decode_base_ms": "per-token decode cost of an iteration", "decode_per_seq_ms": "extra per-token cost per active sequence",
    "step_time": "trainer seconds per step", "sync_lag": "seconds from a trainer step to generators serving it",
    "reward_tau": "steps for the reward curve to rise (then it flattens)", "seed": "random seed",
}


@dataclass
class _Seq:
    group_id: int
    idx: int
    length: int  # in chunks
    reward: float
    versions: list[int] = field(default_factory=list)


@dataclass
class _Gen:
    version: int = 0
    active: list[_Seq] = field(default_factory=list)
    busy_until: float | None = None  # end of the running decode iteration


def simulate(sim: SimConfig, bcfg: BufferConfig, progress: bool = False, label: str = "") -> dict:
    rng = random.Random(sim.seed)
    buf = ReplayBufferCore(bcfg, pad_id=0)
    G = bcfg.group_size
    gens = [_Gen() for _ in range(sim.generators)]
    t, train_until, idle_since, load_at = 0.0, None, 0.0, None
    timeline: list[tuple[float, int]] = []  # (sim time, trained samples) after each step
    bar = _progress(sim.steps, label, progress)

    def pull_work(now: float) -> None:
        for gen in sorted(gens, key=lambda g: len(g.active)):
            while len(gen.active) + G <= sim.concurrency and buf.can_admit():
                grp = buf.admit(PromptItem(uid=buf.admitted_groups, prompt="p"))
                p = 0.1 + 0.8 * (1 - math.exp(-buf.version / sim.reward_tau))
                for i in range(G):
                    tokens = min(rng.lognormvariate(math.log(sim.len_median), sim.len_sigma), sim.max_len)
                    gen.active.append(_Seq(grp.group_id, i, max(1, math.ceil(tokens / sim.chunk)),
                                           min(max(rng.gauss(p, 0.15), 0.0), 1.0)))
            if gen.active and gen.busy_until is None:
                ms = sim.chunk * (sim.decode_base_ms + sim.decode_per_seq_ms * len(gen.active))
                gen.busy_until = now + ms / 1000

    while len(timeline) < sim.steps:
        if train_until is None and buf.batches < sim.steps and buf.ready():
            batch = buf.take_batch()
            buf.record_wait(t - idle_since)
            train_until, reward = t + sim.step_time, float(batch.rewards.mean())
        pull_work(t)
        events = [g.busy_until for g in gens if g.busy_until is not None]
        events += [x for x in (train_until, load_at) if x is not None]
        if not events:
            raise RuntimeError(f"simulation stalled at t={t:.1f}s: {buf.stats()}")
        t = min(events)
        if load_at is not None and t >= load_at:  # generators pick up the newest weights
            for g in gens:
                g.version = buf.version
            load_at = None
        if train_until is not None and t >= train_until:  # optimizer step done: v -> v+1
            buf.set_trainer_version(buf.version + 1)
            buf.end_step(reward)
            train_until, idle_since, load_at = None, t, t + sim.sync_lag
            timeline.append((t, buf.trained_groups * G))
            bar.update(1)
        for g in gens:
            if g.busy_until is not None and t >= g.busy_until:
                g.busy_until = None
                for s in list(g.active):
                    s.versions.append(g.version)
                    if len(s.versions) == s.length:
                        g.active.remove(s)
                        _add(buf, s)
    bar.close()
    st = buf.stats()
    hist = st["staleness_hist"]
    n = sum(hist.values())
    return {
        "samples_per_s": st["trained_samples"] / t, "mean_staleness": sum(k * v for k, v in hist.items()) / n,
        "trainer_wait_frac": st["trainer_wait_s_total"] / t, "sim_seconds": t,
        "dropped_groups": st["dropped_groups"], "deferred_groups": st["deferred_groups"],
        "mean_delta": sum(st["delta_history"]) / len(st["delta_history"]), "delta_history": st["delta_history"],
        "staleness_hist": {str(k): v for k, v in hist.items()}, "timeline": timeline,
    }


def _add(buf: ReplayBufferCore, s: _Seq) -> None:
    n = len(s.versions)
    buf.add(Rollout(group_id=s.group_id, sample_idx=s.idx, prompt="p", prompt_tokens=(1,), completion="",
                    completion_tokens=(2,) * n, logprobs=(-1.0,) * n, versions=tuple(s.versions),
                    finish_reason="stop", reward=s.reward))


class _NoBar:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, label: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=f"{label:>10}", unit="step", file=sys.stderr, leave=True)


def _plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in results.items():
        ts, ns = zip(*r["timeline"]) if r["timeline"] else ((), ())
        ax[0].plot(ts, ns, label=f"{name} ({r['samples_per_s']:.2f}/s)")
        ax[1].plot(r["delta_history"], label=name)
    ax[0].set(xlabel="simulated seconds", ylabel="trained samples", title="throughput")
    ax[1].set(xlabel="step", ylabel="Δ", title="over-commitment Δ per step")
    names = list(results)
    ax[2].bar(names, [r["mean_staleness"] for r in results.values()])
    ax[2].set(ylabel="mean staleness (versions)", title="staleness of trained samples")
    for a in ax[:2]:
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sim_defaults = SimConfig()
    for f, v in asdict(sim_defaults).items():
        p.add_argument("--" + f.replace("_", "-"), type=type(v), default=v, help=_HELP[f])
    p.add_argument("--batch-groups", type=int, default=8, help="B")
    p.add_argument("--group-size", type=int, default=4, help="G")
    p.add_argument("--max-staleness", type=int, default=2, help="η: useful Δ is at most η·B")
    p.add_argument("--fixed-delta", type=int, default=4, help="Δ of the 'fixed' mode")
    p.add_argument("--delta-start", type=int, default=2, help="starting Δ of the 'adaptive' mode")
    p.add_argument("--delta-min", type=int, default=0, help="adaptive Δ floor")
    p.add_argument("--delta-max", type=int, default=8, help="adaptive Δ cap")
    p.add_argument("--window", type=int, default=8, help="w: steps in the reward-slope window")
    p.add_argument("--slope-tstat", type=float, default=2.0,
                   help="Δ grows while the window's reward slope / its standard error exceeds this")
    p.add_argument("--modes", default="none,fixed,adaptive", help="comma list of none|fixed|adaptive")
    p.add_argument("--out", default="bench_out/overcommit", help="directory for summary.json and overcommit.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    sim = SimConfig(**{f: getattr(a, f) for f in asdict(sim_defaults)})
    results, t0 = {}, time.monotonic()
    for mode in a.modes.split(","):
        bcfg = BufferConfig(group_size=a.group_size, batch_groups=a.batch_groups, max_staleness=a.max_staleness,
                            overcommit=mode, delta=a.fixed_delta if mode == "fixed" else a.delta_start,
                            delta_min=a.delta_min, delta_max=a.delta_max, window=a.window,
                            slope_tstat=a.slope_tstat, zero_signal="keep")
        results[mode] = simulate(sim, bcfg, progress=not a.no_progress, label=mode)
    print(f"\n{'mode':<10}{'samples/s':>11}{'speedup':>9}{'staleness':>11}{'wait':>7}{'mean Δ':>8}"
          f"{'deferred':>10}  dropped groups")
    base = results.get("none", next(iter(results.values())))["samples_per_s"]
    for mode, r in results.items():
        print(f"{mode:<10}{r['samples_per_s']:>11.3f}{r['samples_per_s'] / base:>8.2f}x{r['mean_staleness']:>11.3f}"
              f"{r['trainer_wait_frac']:>7.0%}{r['mean_delta']:>8.2f}{r['deferred_groups']:>10}  {r['dropped_groups']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"sim": asdict(sim), "args": vars(a), "results": results}, indent=1))
    _plot(results, out / "overcommit.png")
    print(f"wrote {out / 'summary.json'} and {out / 'overcommit.png'} in {time.monotonic() - t0:.1f}s")
    return results


if __name__ == "__main__":
    main()
