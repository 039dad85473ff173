"""Entry point: `python -m pipeline.run --config configs/tiny.yaml key=value ...`.

Runs the whole job (generators, replay buffer, trainer, weight sync) as described by the config.
Under torchrun every rank joins one Monarch job and rank 0 drives it, on one host
(`torchrun --nproc-per-node K -m pipeline.run ...`) or several (one launcher per node with
`--nnodes N --node-rank R --master-addr A --master-port P`; see pipeline/driver/torchrun.py).
Exit codes: 0 done (run.steps, or the end of data with run.epochs), 2 bad config, arguments or task
(one that does not load, an empty train split, a bad data file), 1 the run failed, 3 the run stopped
early without a learning signal (run.stop_without_signal; its summary and checkpoint are written as
at a normal end); stopped by a
signal, once its shutdown has run: 130 SIGINT, 143 SIGTERM, 129 SIGHUP (128 + signum, also after a
second signal or a shutdown past its grace period, which kill the run's process tree instead; see
pipeline/cleanup.py).
Nothing of the run outlives it: at start the segments of dead runs are swept from /dev/shm; at exit
whatever of this process's tree survived the shutdown is killed and its segments unlinked.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from typing import Any

from pipeline import cleanup, logs, procs
from pipeline.checkpoint import prepare_resume
from pipeline.config import Config, ConfigError, load_config
from pipeline.driver.calls import RunError
from pipeline.models import ModelError
from pipeline.models.hf import check_model, resolved
from pipeline.placement import check_host
from pipeline.tasks import TaskError

log = logging.getLogger("pipeline")

# After a signal, how long the run may take to stop before its process tree is killed: here the last
# checkpoint (30 s at most after an interrupt) and the shutdown (60 s at most) with margin; under
# torchrun less than the 30 s after which torchrun SIGKILLs its ranks (its --shutdown-timeout).
GRACE_S = 120.0
TORCHRUN_GRACE_S = 25.0

NO_SIGNAL_EXIT = 3
"""Exit code of a run that run.stop_without_signal ended early (summary["ended"] == "no_signal")."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pipeline.run", description="Asynchronous RL post-training job.")
    ap.add_argument("--config", default=None, help="YAML file overriding the dataclass defaults (e.g. configs/tiny.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    return ap.parse_args(argv)


def print_summary(cfg: Config, summary: dict) -> None:
    curve = summary.get("eval_curve") or []
    print(f"\n== done: {summary['steps']} steps in {summary['elapsed_s']:.1f}s "
          f"({summary['samples_per_s']:.2f} samples/s), trainer version {summary['version']}")
    if summary.get("ended") == "data":
        print(f"   end of data: {summary['stats']['buffer']['data_epoch']:g} epochs of prompts drawn "
              f"(run.epochs={cfg.run.epochs}), before run.steps={cfg.run.steps}")
    if summary.get("ended") == "control":
        print(f"   stopped by pipeline.control at trainer version {summary['version']}, before run.steps={cfg.run.steps}")
    buf = (summary.get("stats") or {}).get("buffer") or {}
    if buf.get("prompts_set_aside"):
        print(f"   difficulty filter: {buf['prompts_set_aside']} times a prompt was set aside (its groups kept one "
              f"reward), {buf['prompts_retried']} retries, {buf['prompts_aside']} set aside at the end; "
              f"{buf['groups_with_signal']} of {buf['groups_observed']} groups had a reward spread")
    if summary.get("ended") == "no_signal":
        print(f"   stopped early, exit code {NO_SIGNAL_EXIT}: {summary['no_signal']}")
    warm = summary.get("warm_start")
    if warm and warm["mode"] == "fixed":
        print(f"   warm start: {warm['steps']} supervised steps on task demonstrations before RL "
              f"(held-out rewards below are measured after it)")
    elif warm:
        after = warm.get("after") or {}
        print(f"   warm start (auto): {warm['steps']} supervised steps on task demonstrations before RL, stopped: "
              f"{warm['reason']}" + (f"; held-out sampled reward {warm['before']['mean_reward']:.3f} -> "
                                     f"{after['mean_reward']:.3f}" if after.get("prompts") else "")
              + " (the held-out rewards below are measured after it)")
    if summary.get("preflight"):
        print(f"   {summary['preflight']}")
    zs = summary.get("zero_signal")
    if zs and not summary.get("preflight") and (zs["setting"] == "auto" or zs["dynamic_sampling"]):
        # (the pre-flight line, when there was one, says it)
        print(f"   dynamic sampling {'on' if zs['dynamic_sampling'] else 'off'}: {zs['why']}")
    if curve:
        print(f"   held-out reward (sampled): {curve[0][1]:.3f} (step {curve[0][0]}) -> {curve[-1][1]:.3f} "
              f"(step {curve[-1][0]}); greedy: {curve[0][2]:.3f} -> {curve[-1][2]:.3f}")
    print(f"   metrics: {cfg.run.out_dir}/metrics.jsonl, tensorboard: {cfg.run.out_dir}/tensorboard, "
          f"plot: {cfg.run.out_dir}/summary.png")
    if cfg.run.log_rollouts:
        print(f"   trained samples ({cfg.run.log_rollouts} per step): {cfg.run.out_dir}/rollouts.jsonl")
    if cfg.run.wandb == "offline":
        print(f"   wandb (offline): {cfg.run.out_dir}/wandb; upload with `wandb sync {cfg.run.out_dir}/wandb/offline-run-*`")
    print(f"   HF checkpoint: {summary.get('checkpoint')}")


def drive(cfg: Config, host: Any = None, grace_s: float = GRACE_S, roles: Any = None) -> int:
    """Run the job from this process on `host` (a host mesh; None: this host) or on `roles` (a host
    mesh per role, pipeline/cluster/roles.py), print its summary and return its exit code (0, or
    NO_SIGNAL_EXIT). SIGINT, SIGTERM or SIGHUP stop it through the controller's shutdown
    (cleanup.run_until_signalled)."""
    from pipeline.driver.loop import run

    summary = cleanup.run_until_signalled(run(cfg, host=host, roles=roles), grace_s)
    print_summary(cfg, summary)
    return NO_SIGNAL_EXIT if summary.get("ended") == "no_signal" else 0


def launch(cfg: Config) -> int:
    """Local run; under torchrun, every rank joins one Monarch job and rank 0 drives it; with
    run.launcher=monarch, this process asks a scheduler for hosts per role and drives them."""
    # torchrun sets all of these; LOCAL_WORLD_SIZE alone is no sign (vLLM's CPU platform sets it in
    # the process that builds an engine, and a child of that process inherits it)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    if cfg.run.launcher == "torchrun" and not under_torchrun:
        raise ConfigError("config: run.launcher='torchrun' is invalid; allowed: under torchrun only (torchrun "
                          "--nproc-per-node K -m pipeline.run ...), or run.launcher=local / monarch")
    if cfg.run.launcher in ("local", "monarch") and under_torchrun:
        raise ConfigError(f"config: run.launcher={cfg.run.launcher!r} is invalid; allowed: 'auto' or 'torchrun' "
                          "under torchrun (this process is one of torchrun's ranks)")
    if cfg.run.launcher == "monarch":
        from pipeline.cluster.launch import run_under_monarch

        if cfg.launcher.job == "process":
            loopback_only()  # every host is a process of this machine
        return run_under_monarch(cfg, functools.partial(drive, cfg))
    if not under_torchrun or os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE"):
        loopback_only()  # before any proc starts: they inherit this environment
    if under_torchrun:
        from pipeline.driver.torchrun import run_under_torchrun

        return run_under_torchrun(cfg, functools.partial(drive, cfg, grace_s=TORCHRUN_GRACE_S))
    return drive(cfg)


def loopback_only() -> None:
    """One host: every socket of the run listens on loopback. Ours bind 127.0.0.1 already; gloo
    groups that pick their interface from the host name (vLLM's inside each engine) would bind the
    address it resolves to, and vLLM's own address would be the default route's."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def main(argv: list[str] | None = None) -> int:
    """The program. It owns this process: the run's processes stay in its tree, and at exit whatever
    of that tree outlived the shutdown is killed (cleanup.stop_tree)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=logs.FORMAT)  # run.log_level once the config is read
    cleanup.become_subreaper()
    cleanup.raise_on_signals()
    try:
        cfg = load_config(args.config, args.overrides)
        check_host(cfg)  # the values are checked; now what needs this host and the disk, before any proc
        cfg = resolved(cfg)  # a builtin: model.hf_dir -> the folder it builds once (pipeline/models BUILTIN)
        check_model(cfg.model)  # a model_type or config.json field this build cannot train (pipeline/models)
        cfg = prepare_resume(cfg)
        logs.configure(cfg.run.log_level)  # before any proc starts: they inherit VLLM_LOGGING_LEVEL
        swept = cleanup.sweep_segments()
        if swept:
            log.info("removed %d shared-memory segments of dead runs: %s", len(swept), " ".join(swept))
        return launch(cfg)
    except (ConfigError, TaskError, ModelError) as e:  # the file, the job's shape (trainer.num_ranks vs hosts), or the
        print(f"error: {e}", file=sys.stderr)  # task (the Job checks it before any mesh starts)
        return 2
    except Exception as e:  # the run failed: its cause in one line (the traceback at run.log_level=debug)
        if not isinstance(e, RunError) and type(e).__name__ != "SupervisionError":  # an actor's proc died
            raise
        log.debug("the run failed", exc_info=True)
        print(f"error: the run failed: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # SIGINT; cleanup.Interrupted for SIGTERM and SIGHUP
        print(f"interrupted ({e or 'SIGINT'}); exit code {cleanup.exit_code(e)}", file=sys.stderr)
        return cleanup.exit_code(e)
    finally:
        left = cleanup.stop_tree()  # under torchrun: this rank's Monarch worker; else what a shutdown missed
        cleanup.sweep_dead_weight_sync()  # a killed trainer's packed slots; LoRA directories of dead generators
        if left:
            log.info("stopped %d processes still running after the shutdown: %s", len(left), left)


if __name__ == "__main__":
    procs.exit_now(main())
