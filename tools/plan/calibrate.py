"""`python -m tools.plan calibrate`: measure the simulator's component costs on this machine, write a cost file.

    flock /tmp/rl-heavy.lock env PYTHONPATH=$PWD .venv/bin/python -m tools.plan calibrate \
        --out tools/plan/data/costs_here.json            # ~4 min on 2 cores; heavy: hold the lock

Each component with the project's real pieces, placed as tools/bench/pipeline_bench.py places them
(`--placement disjoint`: trainer on the first core, generator on the others):

  generator   the GeneratorActor (vLLM engine, scheduler, rewards, Monarch) fed by a timing source
              actor (tools/gen_bench.ListSource with timestamps): waves of n equal-length samples
              (n = 4..32 concurrent, 4..96 tokens, short and long prompts), each timed from the first
              admit to the last rollout received. Fitted, non-negative least squares, per wave:
                  T = n·p·prefill + L·(base + n·per_seq + n·(p + L/2)·per_ctx) + n·overhead
              and admit_s, the median gap between a wave's consecutive admit calls
  trainer     the Trainer actor (actors/trainer.py) on synthetic batches (tools/bench/trainer_bench.py's),
              N=32 samples of T=16..112 tokens, trainer.epochs 1 and 3: step = base + epochs·(epoch
              + per_token·N·T); and its push call (trainer_bench's push_overlap), the push's pack_base_s
  push        tools/bench/sync_bench.py (shm or the configured transport) on the tiny model (loaded into
              vLLM) and a ~100M dict (200 MB, no vLLM): pack and transfer against bytes; the vLLM load
              of the tiny model; its per-byte term is taken as the transfer's (a 100M load into vLLM
              does not fit beside the benchmark here: docs/results/benchmarks.md)
  contention  the two measured together, against alone (tools/plan/contention.py): each side timed
              while the other is kept fully busy; recorded as an upper bound (the cost file's
              factors are fitted to a short async run, below)
  in a run    a short real run of the CLI (CONTROLLER_RUN: sync, long-tail lengths capped at 64,
              8 steps), simulated with the fits above: the generator's engine terms are scaled by
              the run's batch wait over the simulated one, and the train call's excess over the
              simulated one is added per call (the fits give each cost's shape, the run its level:
              the buffer's messages on the generator's cores, the batch's way to the trainer); the
              controller's per-step time (neither batch wait, train call nor push); the whole push
              as the run saw it (sync/latency_s) and the generator's pause in it
              (sync/update_pause_s: engine paused, load, resumed): the pause is the load
              (load_base_s; vLLM's load alone is shorter), the rest beyond the pack the transfer
              (transfer_base_s: staging and round trips, generation going on)
  async run   the same run in async mode: the contention factors whose simulation matches its
              train call and batch wait (fit_contention_in_run)

Writes the cost file (JSON) and <name>_calibration.json beside it (every raw measurement, the fits,
their residuals); the runs' own outputs go to bench_out/plan_calibration/.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

from pipeline.config import Config, load_config
from pipeline.config import GeneratorConfig
from pipeline.sim.costs import GeneratorCosts, costs_from_dict
from pipeline.sim.fit import nnls
from pipeline.sim.generator import SimGenerator, SimSample
from pipeline.trainer.synthetic import synthetic_batch
from pipeline.types import PromptItem
from tools.lib.cli import REPO, disjoint_cores, run_module
from tools.lib.push import push_overlap
from tools.lib.sources import TimedSource, wait_wave
from tools.plan.contention import fit_contention, measure_contention
from tools.plan.inrun import as_in_run, fit_contention_in_run, measure_async, measure_controller, say, whole_push


GEN_CASES = [(n, L, long) for n in (4, 8, 16, 32) for L in (4, 32, 96) for long in (False,)] + \
            [(32, 4, True), (16, 32, True)]
"""(concurrent samples, tokens each, long prompts) per measured wave."""
TRAIN_SHAPES = [(32, 16), (32, 48), (32, 112), (8, 112)]


async def measure_generator(cfg: Config, reps: int) -> list[dict]:
    from monarch.actor import this_host

    from actors.generator import GeneratorActor
    from pipeline.models.hf import model_dir
    from pipeline.tokens import encode_prompt, load_tokenizer

    G = 4
    g = dataclasses.replace(cfg.generator, concurrency=32, max_new_tokens=96, ignore_eos=True)
    cfg = dataclasses.replace(cfg, generator=g)
    tok = load_tokenizer(model_dir(cfg.model))
    gprocs = this_host().spawn_procs(per_host={"procs": 1})
    sprocs = this_host().spawn_procs(per_host={"procs": 1})
    gen = gprocs.spawn("gen", GeneratorActor, cfg, 0)
    src = sprocs.spawn("src", TimedSource, G, cfg)
    rows = []
    try:
        say(f"generator: starting the engine (generator.cpus={cfg.generator.cpus or 'unpinned'})")
        await asyncio.wait_for(gen.setup.call_one(), cfg.generator.start_timeout_s)
        await gen.start_generation.call_one(src)
        uid = 0
        for rep in range(reps + 1):  # the first pass warms up
            for n, L, long in GEN_CASES:
                prompt = "rev " + ("abcdefgh" * 14 if long else "abcdef") + "="
                items = [PromptItem(uid=(uid := uid + 1), prompt=prompt, answer="x", max_new_tokens=L)
                         for _ in range(n // G)]
                await src.feed.call_one(items)
                c = await wait_wave(src, n, 120, f"generator wave n={n} L={L}")
                if rep:
                    rows.append({"n": n, "L": L, "prompt_tokens": len(encode_prompt(tok, prompt, None)), "s": c[1],
                                 "admit_gaps_s": c[2]})
            say(f"generator: pass {rep}/{reps} done")
        await gen.end_stage.call_one("keep")
        await gen.shutdown.call_one()
    finally:
        await gprocs.stop()
        await sprocs.stop()
    return rows


def _median_per_case(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One row per case with the median time over its repeats: a burst of other work on the shared
    cores slows one repeat, not all."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault(tuple(r[k] for k in keys), []).append(r)
    return [{**rs[0], "s": statistics.median(r["s"] for r in rs)} for rs in cases.values()]


def fit_generator(rows: list[dict], G: int = 4) -> tuple[dict, float]:
    """Non-negative least squares of the wave times; the admission of a wave's groups one by one
    (admit_s each, the median gap between consecutive admits) is taken out first, since the
    simulator adds it itself. The error is the simulator's own: each wave simulated with the fit
    against its measured time (median relative error)."""
    gaps = [g for r in rows for g in r["admit_gaps_s"]]
    admit_s = statistics.median(gaps) if gaps else 0.0
    X, y = [], []
    for r in _median_per_case(rows, ("n", "L", "prompt_tokens")):
        n, L, p = r["n"], r["L"], r["prompt_tokens"]
        X.append([n * p, L, L * n, L * n * (p + L / 2), n])
        y.append(max(r["s"] - (n // G) * admit_s, 1e-4))
    coef = nnls(np.array(X, dtype=float), np.array(y))
    keys = ["prefill_per_token_s", "iter_base_s", "iter_per_seq_s", "iter_per_ctx_token_s", "request_overhead_s"]
    fit = dict(zip(keys, map(float, coef))) | {"admit_s": float(admit_s)}
    costs = GeneratorCosts(**fit)
    errs = [abs(simulate_wave(costs, r["n"], r["L"], r["prompt_tokens"], G) / r["s"] - 1)
            for r in _median_per_case(rows, ("n", "L", "prompt_tokens"))]
    return fit, float(statistics.median(errs))


def simulate_wave(costs: GeneratorCosts, n: int, L: int, prompt_tokens: int, G: int = 4) -> float:
    """A calibration wave on SimGenerator: n/G groups of G samples of L tokens, arriving one admit
    round trip apart; seconds until the last finishes (and its request overhead is paid)."""
    gen = SimGenerator(0, GeneratorConfig(concurrency=32, max_new_tokens=max(L, 1)), costs)
    arrivals = [(k + 1) * costs.admit_s for k in range(n // G)]
    now, left = 0.0, n
    while left:
        while arrivals and arrivals[0] <= now + 1e-12:
            arrivals.pop(0)
            gen.enqueue([SimSample(0, i, prompt_tokens, L, 0.0, (0, 0)) for i in range(G)])
            gen.refill(now)
        cands = [x for x in (gen.next_event(now), arrivals[0] if arrivals else None) if x is not None]
        t = min(cands)
        left -= len(gen.advance(now, t))
        now = t
        gen.refill(now)
    return now + gen.debt  # the last requests' overhead


async def measure_trainer(cfg: Config, reps: int) -> list[dict]:
    from actors.trainer import Trainer
    from pipeline.models.hf import model_dir, read_hf_config

    vocab = read_hf_config(model_dir(cfg.model))["vocab_size"]
    rows = []
    for epochs in (1, 3):
        c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, epochs=epochs))
        say(f"trainer: starting (trainer.cpus={c.trainer.cpus or 'unpinned'}), epochs={epochs}")
        trainer = await Trainer.start(c, name=f"cal{epochs}")
        try:
            await trainer.train_step(synthetic_batch(32, 48, 8, vocab, 0))  # warm-up
            for rep in range(reps):
                for n, T in TRAIN_SHAPES:
                    t0 = time.perf_counter()
                    await trainer.train_step(synthetic_batch(n, T, 8, vocab, rep + 1))
                    rows.append({"epochs": epochs, "n": n, "T": T, "s": time.perf_counter() - t0})
            if epochs == 1:  # the trainer's push call (snapshot, pack, actor round trip), as WeightSync.start awaits it
                pushes = await push_overlap(trainer, [synthetic_batch(32, 48, 8, vocab, 9)] * 4, lambda msg: None)
        finally:
            await trainer.close()
    return rows, pushes["push_s_median"]


def fit_trainer(rows: list[dict]) -> tuple[dict, float]:
    """step = base + step_per_token·N·T + epochs·(epoch_base + per_token·N·T), non-negative least
    squares over the median of each (epochs, N, T): shapes at 1 and 3 epochs separate the work done
    once per step from the work of each epoch."""
    rows = _median_per_case(rows, ("epochs", "n", "T"))
    X = np.array([[1.0, r["n"] * r["T"], r["epochs"], r["epochs"] * r["n"] * r["T"]] for r in rows])
    y = np.array([r["s"] for r in rows])
    coef = nnls(X, y)
    err = float(np.median(np.abs(X @ coef - y) / y))
    return {"step_base_s": float(coef[0]), "step_per_token_s": float(coef[1]), "epoch_base_s": float(coef[2]),
            "per_token_s": float(coef[3]), "padding": "max"}, err


def measure_push(cfg: Config, out: Path) -> dict:
    ws = cfg.weight_sync
    args = ["--sizes", "tiny,100m", "--transports", ws.transport, "--buckets", str(ws.bucket_mb), "--reps", "3",
            "--out", str(out / "sync_bench")]
    say("push: python -m tools.bench.sync_bench " + " ".join(args))
    code = run_module("tools.bench.sync_bench", args, out / "sync_bench.log")
    if code:
        raise RuntimeError(f"sync_bench exited with {code}; see {out / 'sync_bench.log'}")
    res = {r["model"]: r for r in json.loads((out / "sync_bench" / "results.json").read_text())["results"]}
    tiny, big = res["tiny"], res["100m"]
    dbytes = big["bytes"] - tiny["bytes"]
    per = {k: max(0.0, (big[f"{k}_s"] - tiny[f"{k}_s"]) / dbytes) for k in ("pack", "transfer")}
    return {"bytes": float(tiny["bytes"]),
            "pack_base_s": max(0.0, tiny["pack_s"] - per["pack"] * tiny["bytes"]), "pack_per_byte_s": per["pack"],
            "transfer_base_s": max(0.0, tiny["transfer_s"] - per["transfer"] * tiny["bytes"]),
            "transfer_per_byte_s": per["transfer"],
            "load_base_s": max(0.0, tiny["load_s"] - per["transfer"] * tiny["bytes"]),
            "load_per_byte_s": per["transfer"], "_raw": res}


def refit(out_file: Path) -> dict:
    """Fit again from the measurements recorded beside `out_file` (no measurement: the fit changed):
    the generator's waves, the trainer's steps and, when recorded, what the calibration run saw
    (the push, and the levels of the generator's and trainer's costs). Rewrites both files."""
    record = out_file.with_name(out_file.stem + "_calibration.json")
    rec = json.loads(record.read_text())
    gen, err = fit_generator(rec["generator"]["rows"])
    tr, tr_err = fit_trainer(rec["trainer"]["rows"])
    costs = json.loads(out_file.read_text())
    costs.update(generator=gen, trainer=tr)
    if "push_in_run_s" in rec["push"]:
        costs["push"] = whole_push(rec["push"].get("measured", rec["push"]["fit"]), rec["push"]["push_in_run_s"],
                                   rec["push"].get("pause_in_run_s"))
        rec["push"]["fit"] = costs["push"]
    if "in_run" in rec:
        c, r = rec["controller"], rec["in_run"]
        costs, r["factors"] = as_in_run(costs, c["config"], c["overrides"], r["seen"])
        if "seen_async" in r:
            costs["contention"] = r["contention"] = fit_contention_in_run(costs, c["config"], c["overrides"],
                                                                          r["seen_async"])
    costs["source"] += "; refitted from the recorded measurements"
    costs_from_dict(costs, str(out_file))
    rec["generator"].update(fit=gen, median_rel_error=err)
    rec["trainer"].update(fit=tr, median_rel_error=tr_err)
    out_file.write_text(json.dumps(costs, indent=1))
    record.write_text(json.dumps(rec, indent=1, default=str))
    say(f"refit: generator {costs['generator']} (waves simulated with the fit: median error {err:.1%}), trainer "
        f"{costs['trainer']} (median error {tr_err:.1%}); wrote {out_file}")
    return costs


def calibrate(config: str, overrides: list[str], out_file: Path, reps: int = 2) -> dict:
    """Measure every component (module docstring); write the cost file and calibration.json beside it."""
    overrides = [*disjoint_cores(), *overrides]
    cfg = load_config(config, overrides)
    out = REPO / "bench_out" / "plan_calibration" / out_file.stem  # raw runs (checkpoints, logs): not committed
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    gen_rows = asyncio.run(measure_generator(cfg, reps))
    gen, gen_err = fit_generator(gen_rows)
    say(f"generator fit {gen} (waves simulated with it: median error {gen_err:.1%})")
    tr_rows, push_call_s = asyncio.run(measure_trainer(cfg, reps))
    tr, tr_err = fit_trainer(tr_rows)
    say(f"trainer fit {tr} (median error {tr_err:.1%})")
    cont_rows = asyncio.run(measure_contention(cfg, reps))
    cont = fit_contention(cont_rows)
    say(f"contention {cont}")
    push = measure_push(cfg, out)
    raw_push = push.pop("_raw")
    # the trainer waits for its whole push call, not only the pack sync_bench times
    push["pack_base_s"] = max(push["pack_base_s"], push_call_s - push["pack_per_byte_s"] * push["bytes"])
    ctl, seen = measure_controller(config, overrides, out)
    measured, push = push, whole_push(push, seen["push_s"], seen["pause_s"])
    say(f"push {push} (a whole push in the run: {seen['push_s'] * 1e3:.1f} ms, the generator paused "
        f"{seen['pause_s'] * 1e3:.1f} ms of it); controller {ctl}")
    costs = {"generator": gen, "trainer": tr, "push": push, "controller": ctl, "contention": cont,
             "source": f"python -m tools.plan calibrate --config {config} {' '.join(overrides)} on {time.strftime('%Y-%m-%d')}"}
    costs, factors = as_in_run(costs, config, overrides, seen)
    say(f"in the run: batch wait {seen['batch_wait_s']:.3f} s against {factors['simulated_batch_wait_s']:.3f} s "
        f"simulated from the waves (generator x{factors['generator']:.2f}), train call {seen['train_s']:.3f} s "
        f"against {factors['simulated_train_s']:.3f} s (+{factors['trainer_added_s'] * 1e3:.1f} ms per call)")
    seen_async = measure_async(config, overrides, out)
    costs["contention"] = fit_contention_in_run(costs, config, overrides, seen_async)
    say(f"contention in the async run (batch wait {seen_async['batch_wait_s']:.3f} s, train call "
        f"{seen_async['train_s']:.3f} s): {costs['contention']} (alone against a fully busy other side: {cont})")
    costs_from_dict(costs, str(out_file))  # checked before it is written
    out_file.write_text(json.dumps(costs, indent=1))
    record = out_file.with_name(out_file.stem + "_calibration.json")
    record.write_text(json.dumps(
        {"generator": {"rows": gen_rows, "fit": gen, "median_rel_error": gen_err},
         "trainer": {"rows": tr_rows, "fit": tr, "median_rel_error": tr_err, "push_call_s": push_call_s},
         "push": {"fit": push, "measured": measured, "sync_bench": raw_push, "push_in_run_s": seen["push_s"],
                  "pause_in_run_s": seen["pause_s"]},
         "controller": {"fit": ctl, "overrides": overrides, "config": config},
         "in_run": {"seen": seen, "factors": factors, "seen_async": seen_async,
                    "contention": costs["contention"]},
         "contention": {"rows": cont_rows, "isolated": cont, "fit": costs["contention"]},
         "seconds": time.monotonic() - t0}, indent=1, default=str))
    say(f"wrote {out_file} and {record} in {time.monotonic() - t0:.0f} s")
    return costs
