"""Launching the project's CLI from a tool: one place for the command line, the log, the timeout and
the exit code.

    code = run_cli("configs/tiny.yaml", ["run.steps=4", f"run.out_dir={d}"], log=d.with_suffix(".log"))
    proc = start_cli("configs/tiny.yaml", overrides, log, new_session=True)   # to kill or watch it
    run = run_to_dir(run_dir, overrides, "configs/tiny.yaml", timeout=3600, reuse=True, label="sweep")

Every run starts in the repository with this interpreter, so a relative config or out_dir is taken
from the repository; pass absolute paths for anything else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.lib.metrics import read_rows, read_summary

REPO = Path(__file__).resolve().parents[2]


def command(module: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def cli_args(config: str | Path, overrides: list[str]) -> list[str]:
    return ["--config", str(config), *overrides]


def run_module(module: str, args: list[str], log: Path | None, timeout: float | None = None,
               env: dict | None = None) -> int:
    """`python -m module args` in the repository, stdout and stderr to `log` (None: discarded), within
    `timeout` seconds (subprocess.TimeoutExpired past it); its exit code."""
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.run(command(module, args), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, env=env).returncode
    finally:
        if log is not None:
            out.close()


def run_cli(config: str | Path, overrides: list[str], log: Path | None, timeout: float | None = None,
            env: dict | None = None) -> int:
    """One whole run of `python -m pipeline.run --config config overrides`; its exit code."""
    return run_module("pipeline.run", cli_args(config, overrides), log, timeout, env)


def check_cli(config: str | Path, overrides: list[str], log: Path, what: str, timeout: float | None = None) -> None:
    """run_cli, raising RuntimeError naming `what` and the log when the run fails."""
    code = run_cli(config, overrides, log, timeout)
    if code:
        raise RuntimeError(f"{what} exited with {code}; see {log}")


def start_cli(config: str | Path, overrides: list[str], log: Path, env: dict | None = None,
              new_session: bool = False, module: str = "pipeline.run", args: list[str] | None = None
              ) -> subprocess.Popen:
    """The same run started, not waited for (its log file stays open with the process): for a tool that
    watches it, signals it or controls it. new_session: its own process group, to kill it whole."""
    f = open(log, "w")
    try:
        return subprocess.Popen(command(module, args if args is not None else cli_args(config, overrides)),
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=new_session)
    finally:
        f.close()  # the child holds its own descriptor


def _but_out_dir(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("run.out_dir=")]


def resolve_config(config: str | Path) -> str:
    """A config named from where the tool runs, else from the repository, as an absolute path."""
    return str(Path(config).resolve() if Path(config).exists() else REPO / config)


def run_to_dir(run_dir: Path, overrides: list[str], config: str, timeout: float, reuse: bool, label: str) -> dict:
    """One whole CLI run into run_dir, its output in run_dir/run.log; with `reuse`, a finished run there
    with the same overrides (but for run.out_dir: a finished run may be copied) is read instead.
    Returns {"exit_code", "wall_s", "rows" (metrics.jsonl), "summary" (summary.json), "cfg"}. A bad
    override or task fails in load_config, before any run."""
    from pipeline.config import load_config

    config = resolve_config(config)
    cfg = load_config(config, overrides)
    done = run_dir / "sweep_run.json"
    prev = json.loads(done.read_text()) if reuse and done.exists() else {}
    same = bool(prev) and _but_out_dir(prev["overrides"]) == _but_out_dir(overrides)
    if prev and not same:
        print(f"[{label}] not reusing {run_dir}: it ran with other overrides", flush=True)
    if same:
        code, wall = prev["exit_code"], prev["wall_s"]
        print(f"[{label}] reusing the finished run in {run_dir}", flush=True)
    else:
        print(f"[{label}] {cfg.run.steps} steps ({run_dir / 'run.log'})", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        code = run_cli(config, overrides, run_dir / "run.log", timeout)
        wall = time.monotonic() - t0
        done.write_text(json.dumps({"exit_code": code, "wall_s": wall, "overrides": overrides}))
    return {"exit_code": code, "wall_s": wall, "rows": read_rows(run_dir / "metrics.jsonl"),
            "summary": read_summary(run_dir), "cfg": cfg}


def disjoint_cores(kind: str = "disjoint") -> list[str]:
    """Overrides pinning the trainer to the first core and everything else to the rest ("shared": none)."""
    if kind == "shared":
        return []
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--placement disjoint needs 2 or more cores; use --placement shared")
    rest = ",".join(map(str, cores[1:]))
    return [f"trainer.cpus={cores[0]}", f"generator.cpus={rest}", f"buffer.cpus={rest}", "run.allow_shared_cpus=true"]


def wait_for(pred, timeout_s: float, what: str, proc: subprocess.Popen, every: float = 0.5):
    """Poll `pred` until it returns something true (returned), while the started run lives:
    RuntimeError when it exits first, TimeoutError past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited with {proc.returncode} while waiting for {what}")
        time.sleep(every)
    raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
