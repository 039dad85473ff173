"""Control a running CLI job from another shell: resize its generator pool, ask how it stands, or stop it.

    python -m pipeline.control OUT_DIR generators=3        # grow or shrink to 3 generators; waits for it
    python -m pipeline.control OUT_DIR status              # the pool: each generator's state, version, pid
    python -m pipeline.control OUT_DIR generators=1 --timeout 120
    python -m pipeline.control OUT_DIR stop                # end after the step in flight, as at run.steps

OUT_DIR is the run's run.out_dir. The command writes a request file OUT_DIR/control/req-<id>.json
(written under a temporary name and renamed, so the run never reads half of one) and waits for the
reply OUT_DIR/control/rep-<id>.json. The run (`Control`, a task beside the train loop and the
supervisor in pipeline/driver/loop.py) looks for requests every POLL_S, applies each beside training
(pipeline/driver/pool.py: a joining generator starts on the trainer's weights and joins at the next
push boundary; a leaving one drains or aborts by generator.on_update) and writes the reply. Growing
removes nothing and shrinking removes the newest generators first. `stop` ends the run after the
step in flight as if it had reached run.steps (final eval, HF export, summary.json with "ended":
"control", exit 0); the reply comes at once. The run announces itself in OUT_DIR/control/driver.json
(its pid and host) while it runs.

Exit codes: 0 done (the reply is printed as JSON); 2 bad input (generators=0, a non-integer, an
unknown command); 1 no run is running in OUT_DIR, it did not answer within --timeout (default 600 s,
a vLLM engine's start included), or it refused the change (the reason is printed), e.g. the last
generator, or a host with no free share of generator.cpus / generator.devices.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5  # a file channel has no event to wait on; a request waits at most this long to be seen


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, default=str))
    tmp.replace(path)


class Control:
    """The run's side: serves OUT_DIR/control/ requests until cancelled. A request is answered in a
    task of its own (a status answers while an add waits for an engine); pool changes are serialised
    by the pool's lock. A refused or failed change is the reply's error, never the run's.

    Example:
        loops = {asyncio.create_task(loop.run(1)), asyncio.create_task(Control(job).run())}
    """

    def __init__(self, job: Any):
        self.job = job
        self.dir = Path(job.cfg.run.out_dir) / "control"
        self._serving: set[asyncio.Task] = set()

    async def run(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.iterdir():  # a previous run's requests are not this run's to answer
            old.unlink(missing_ok=True)
        _write(self.dir / "driver.json", {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        try:
            while True:
                for req in sorted(self.dir.glob("req-*.json")):
                    rid = req.stem[4:]
                    try:
                        body = json.loads(req.read_text())
                    except (OSError, ValueError) as e:
                        body = {"op": "invalid", "error": str(e)}
                    req.unlink(missing_ok=True)
                    task = asyncio.create_task(self._answer(rid, body), name=f"control-{rid}")
                    self._serving.add(task)
                    task.add_done_callback(self._serving.discard)
                await asyncio.sleep(POLL_S)
        finally:
            (self.dir / "driver.json").unlink(missing_ok=True)
            for t in list(self._serving):
                t.cancel()
            await asyncio.gather(*self._serving, return_exceptions=True)

    async def _answer(self, rid: str, body: dict) -> None:
        t0 = time.monotonic()
        try:
            reply = {"ok": True, **await self.apply(body)}
        except asyncio.CancelledError:
            reply = {"ok": False, "error": "the run ended before the change was made"}
            _write(self.dir / f"rep-{rid}.json", reply)
            raise
        except Exception as e:  # the command shows it; the run goes on (the supervisor owns failures)
            log.warning("control request %s failed: %s", body, e)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        reply["seconds"] = time.monotonic() - t0
        _write(self.dir / f"rep-{rid}.json", reply)

    async def apply(self, body: dict) -> dict:
        pool = self.job.pool
        if body.get("op") == "status":
            return {"status": pool.status()}
        if body.get("op") == "stop":
            log.warning("control: stop requested at version %d (run.steps=%d)", self.job.version,
                        self.job.cfg.run.steps)
            self.job.stop_requested = True
            return {"stopping": True, "version": self.job.version}
        if body.get("op") != "generators":
            raise ValueError(f"unknown request {body!r}")
        n = int(body["n"])
        if n < 1:
            raise ValueError(f"generators={n}: a run needs at least one generator")
        members = pool.members()
        log.warning("control: generators=%d requested (%d now)", n, len(members))
        added, removed = [], []
        if n > len(members):
            added = await self.job.add_generators(n - len(members))
        restarting = {i for i, s in self.job.fleet.active_generators() if self.job.supervisor.restarting(s)}
        leaving = sorted(members, key=lambda i: (i not in restarting, i), reverse=True)[:max(len(members) - n, 0)]
        for i in leaving:  # the newest leave first, one being restarted last (the pool refuses it)
            await self.job.remove_generator(i)
            removed.append(i)
        return {"added": added, "removed": removed, "status": pool.status()}


# ---------------------------------------------------------------------- the command


def running(out: Path) -> str | None:
    """Why no run answers in `out` (None: one does)."""
    info = out / "control" / "driver.json"
    if not info.exists():
        return f"no run is running in {out} ({info} does not exist)"
    try:
        d = json.loads(info.read_text())
    except ValueError as e:
        return f"{info} is unreadable: {e}"
    if d.get("host") == socket.gethostname():
        try:
            os.kill(int(d["pid"]), 0)
        except ProcessLookupError:
            return f"the run in {out} (pid {d['pid']}) is not running any more"
        except PermissionError:
            pass
    return None


def parse(argv: list[str]) -> tuple[Path, dict, float]:
    ap = argparse.ArgumentParser(prog="python -m pipeline.control",
                                 description="Resize a running job's generator pool, show it, or stop the job.")
    ap.add_argument("out_dir", help="the run's run.out_dir")
    ap.add_argument("command", help="generators=N | status | stop")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run's answer")
    a = ap.parse_args(argv)
    if a.command in ("status", "stop"):
        return Path(a.out_dir), {"op": a.command}, a.timeout
    key, sep, value = a.command.partition("=")
    if key != "generators" or not sep:
        raise SystemExit(f"pipeline.control: unknown command {a.command!r}; use generators=N, status or stop")
    try:
        n = int(value)
    except ValueError:
        raise SystemExit(f"pipeline.control: generators={value!r} is not an integer") from None
    if n < 1:
        raise SystemExit(f"pipeline.control: generators={n}; a run needs at least 1 generator")
    return Path(a.out_dir), {"op": "generators", "n": n}, a.timeout


def main(argv: list[str] | None = None) -> int:
    try:
        out, body, timeout_s = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        return int(e.code or 0) and 2
    if (why := running(out)) is not None:
        print(f"pipeline.control: {why}", file=sys.stderr)
        return 1
    rid = uuid.uuid4().hex[:12]
    _write(out / "control" / f"req-{rid}.json", body)
    reply_path = out / "control" / f"rep-{rid}.json"
    deadline = time.monotonic() + timeout_s
    while not reply_path.exists():
        if time.monotonic() > deadline or running(out) is not None:
            (out / "control" / f"req-{rid}.json").unlink(missing_ok=True)
            print(f"pipeline.control: the run in {out} did not answer within {timeout_s:.0f}s"
                  if time.monotonic() > deadline else f"pipeline.control: {running(out)}", file=sys.stderr)
            return 1
        time.sleep(0.2)
    reply = json.loads(reply_path.read_text())
    with contextlib.suppress(OSError):
        reply_path.unlink()
    print(json.dumps(reply, indent=2))
    if not reply.get("ok"):
        print(f"pipeline.control: the run refused: {reply.get('error')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
