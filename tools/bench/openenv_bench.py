"""Environment-side cost of an OpenEnv episode: this project's session (pipeline/tasks/openenv.py)
against openenv's own client (`GenericEnvClient(...).sync()`, what TRL and torchforge use), on one
server process of the same environment, plus the in-process path; printed as a table of medians over
repeats, with the ratio measured in each repeat.

    python -m tools.bench.openenv_bench --episodes 200 --repeats 5

An episode is the keyvault example's (examples/envs/keyvault.py): connect, reset, `?`, the answer,
close; a step is one WebSocket round trip. Each repeat runs every path once, in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time
from tools.lib.cli import REPO

ENV = "examples.envs.keyvault.KeyVaultEnvironment"


def ours(task, items) -> float:
    t0 = time.perf_counter()
    for it in items:
        ep = task.env(it)
        code = ep.step("?")[1:-1]
        ep.step(code)
        ep.reward()
        ep.close()
    return time.perf_counter() - t0


def theirs(url: str, seeds: list[int]) -> float:
    from openenv.core import GenericEnvClient

    t0 = time.perf_counter()
    for s in seeds:
        env = GenericEnvClient(base_url=url).sync()
        with env:
            env.reset(seed=s)
            r = env.step({"message": "?"})
            code = r.observation["prompt"][1:-1]
            env.step({"message": code})
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from pipeline.config import load_config
    from pipeline.tasks import load_task

    from pipeline.tasks.openenv_server import spawn

    proc, url = spawn(ENV)
    try:
        def task(*o):
            cfg = load_config(REPO / "configs/tiny.yaml", ["task.name=pipeline.tasks.openenv", "task.openenv.chat=false", *o])
            return load_task(cfg.task.name, cfg.task)
        served, local = task(f"task.openenv.url={url}"), task(f"task.openenv.env={ENV}")
        items = [it for it, _ in zip(local.prompts(0, "train"), range(a.episodes))]
        seeds = [int(dict(it.columns)["seed"]) for it in items]
        ours(served, items[:10]), theirs(url, seeds[:10])  # warm both paths
        rows = {"ours (served)": [], "openenv GenericEnvClient (served)": [], "ours (in-process)": []}
        ratio = []
        for r in range(a.repeats):
            t_ours, t_theirs, t_local = ours(served, items), theirs(url, seeds), ours(local, items)
            rows["ours (served)"].append(t_ours / a.episodes * 1e3)
            rows["openenv GenericEnvClient (served)"].append(t_theirs / a.episodes * 1e3)
            rows["ours (in-process)"].append(t_local / a.episodes * 1e3)
            ratio.append(t_ours / t_theirs)
            print(f"repeat {r + 1}/{a.repeats}: ours {t_ours:.2f}s, openenv client {t_theirs:.2f}s, in-process {t_local:.2f}s",
                  flush=True)
        print(f"\n{a.episodes} keyvault episodes (connect, reset, 2 steps, close), {a.repeats} repeats; ms per episode:")
        print("| path | median | min | max |\n|---|---|---|---|")
        for k, v in rows.items():
            print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
        print(f"ours / openenv client, per repeat: {', '.join(f'{x:.2f}' for x in ratio)} "
              f"(median {statistics.median(ratio):.2f})")
    finally:
        proc.kill()
        proc.wait(10)


if __name__ == "__main__":
    main()
