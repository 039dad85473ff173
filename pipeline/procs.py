"""Process-tree helpers from /proc (Linux): who descends from a pid, and killing exactly those.

A process is named by (pid, start time in clock ticks), so a pid the kernel has reused since is
never killed by mistake.

    tree = [me(), *descendants(os.getpid())]   # this process and every live descendant
    kill(tree)                             # SIGKILL the ones still alive (same pid and start time)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

Proc = tuple[int, int]


def _fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (fields 3.. of proc(5)), or None once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of a live pid, or None."""
    fields = _fields(pid)
    return None if fields is None else (int(fields[1]), int(fields[19]), fields[0])


def parent(pid: int) -> int | None:
    """The parent pid of a live (not zombie) process, or None if it is gone."""
    st = _stat(pid)
    return st[0] if st is not None and st[2] != "Z" else None


def me() -> Proc:
    pid = os.getpid()
    return pid, _stat(pid)[1]


def start_time(pid: int) -> int | None:
    """The start time of a live (not zombie) pid, which with the pid names the process; None if gone."""
    st = _stat(pid)
    return st[1] if st is not None and st[2] != "Z" else None


def usage(pid: int) -> tuple[float, str] | None:
    """(CPU seconds, user + system, a live pid has used so far; its state letter: R running, S sleeping,
    D waiting in the kernel, T stopped, ...), from one read of /proc, or None once it is gone."""
    fields = _fields(pid)
    return None if fields is None else ((int(fields[11]) + int(fields[12])) / _TICKS, fields[0])


_TICKS = os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> str:
    """A process's command line (its first 160 characters), or "?" once it is gone: for messages
    that name what was left running."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def alive(proc: Proc) -> bool:
    st = _stat(proc[0])
    return st is not None and st[1] == proc[1] and st[2] != "Z"


def descendants(pid: int) -> list[Proc]:
    """Every live descendant of `pid` (children, their children, ...)."""
    children: dict[int, list[Proc]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None:
            children.setdefault(st[0], []).append((int(d.name), st[1]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def kill(procs: list[Proc]) -> list[int]:
    """SIGKILL each process that is still the one recorded; returns the pids signalled."""
    hit = []
    for p in procs:
        if alive(p):
            try:
                os.kill(p[0], signal.SIGKILL)
                hit.append(p[0])
            except OSError:
                pass
    return hit


_stopped_cleanly = False
_exit_registered = False


def exit_fast_when_stopped() -> None:
    """In a Monarch proc (called by each actor's __init__): when the proc exits after its actors were
    stopped cleanly (`stopped`, from the actor's __cleanup__), it flushes its streams and logs and
    leaves at once with code 0, skipping the interpreter's teardown (garbage-collecting torch,
    vLLM and every module: 1.5-4 s a proc on a loaded machine, on every run's stop and every
    restart). Exit handlers registered after this call (an engine's shutdown) still run first;
    a proc whose actor failed, or that exits for any other reason, exits as usual. Only in a proc
    Monarch spawned (HYPERACTOR_MESH_BOOTSTRAP_MODE set): never in a controller, whose exit code is
    the run's."""
    global _exit_registered
    if not _exit_registered and "HYPERACTOR_MESH_BOOTSTRAP_MODE" in os.environ:
        import atexit

        atexit.register(_exit_now)
        _exit_registered = True


def stopped(exc: BaseException | None) -> None:
    """An actor of this proc was stopped: cleanly when `exc` is None (Monarch's __cleanup__ argument)."""
    global _stopped_cleanly
    _stopped_cleanly = exc is None


def _exit_now() -> None:
    if not _stopped_cleanly:
        return
    import logging

    logging.shutdown()
    _flush_streams()
    os._exit(0)


def _flush_streams() -> None:
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to flush
            pass


def exit_now(code: int) -> None:
    """End the CLI with `code` once its run is over: the exit handlers run (Monarch's, logging's), the
    streams are flushed, then the process leaves without the interpreter's teardown, which takes
    2-3 s of garbage-collecting torch and Monarch for nothing at the end of every run."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        _flush_streams()
        os._exit(code)
