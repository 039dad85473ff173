"""Leaving nothing behind: signals, the run's process tree and its shared-memory segments (Linux).

    become_subreaper()                     # main(): orphans of the run's processes re-parent here
    sweep_segments()                       # at start: unlink /dev/shm segments of dead runs
    sweep_dead_weight_sync()               # a proc died: unlink its mrl-ws-* segments nobody maps
    summary = run_until_signalled(run(cfg), grace_s=120)  # a signal: shutdown, then Interrupted
    stop_tree()                            # at exit: SIGKILL what is left of our tree, unlink its segments
    exit_with_parent()                     # in vLLM's engine core: die with the generator proc
    segment_name("slot0")                  # mrl-ws-slot0-<pid>-<random>, for weightsync/segment.py

Signals. The first SIGINT, SIGTERM or SIGHUP cancels the run, so its `finally:` runs the controller's
shutdown (close -> cancel -> stop every proc mesh); then `Interrupted(signum)` is raised and the
program exits 128 + signum (130, 143, 129). A second signal, or a shutdown still running after
`grace_s`, kills the whole process tree with SIGKILL, unlinks its segments and exits at once with the
same code. The Monarch procs sit in process groups of their own (vLLM's engine core and workers in
their proc's), so a terminal's Ctrl-C reaches the controller only and the shutdown finds its procs
alive.

Which segments are a dead run's (`sweep_segments`); never one that a live process maps or holds open:
- `mrl-ws-<tag>-<pid>-<random>` (weight sync, `segment_name`) whose creator pid is dead;
- `psm_*` (multiprocessing.shared_memory: vLLM's message queues) and `sem.mp-*` (multiprocessing's
  named semaphores) older than `min_age_s`: nothing names their creator, so "no live process maps it
  or holds it open" is the criterion (a creator holds its segment open from shm_open on).
Only this user's segments are considered: another user's processes can neither open a 0600 segment
nor be inspected in /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, Coroutine, Iterable

from pipeline.procs import alive, descendants, kill

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SHM_DIR = "/dev/shm"
WS_PREFIX = "mrl-ws-"  # weight-sync segments (pipeline/weightsync/segment.py)
ANONYMOUS = ("psm_", "sem.mp-")  # multiprocessing's segments: no creator in the name
MIN_AGE_S = 30.0
KILL_WAIT_S = 10.0
_watching = False  # exit_with_parent's thread runs


class Interrupted(KeyboardInterrupt):
    """The run was stopped by SIGINT, SIGTERM or SIGHUP (after its shutdown ran); exit 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(e: KeyboardInterrupt) -> int:
    return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)


# ---------------------------------------------------------------------- signals


def raise_on_signals() -> None:
    """SIGTERM and SIGHUP raise Interrupted, as SIGINT raises KeyboardInterrupt (outside an event loop)."""

    def handler(signum, frame):
        raise Interrupted(signum)

    for s in SIGNALS[1:]:
        signal.signal(s, handler)


def run_until_signalled(coro: Coroutine, grace_s: float) -> Any:
    """`asyncio.run(coro)`, except that SIGINT, SIGTERM and SIGHUP cancel `coro` (its finally-blocks
    run) and then raise Interrupted(signum). A second signal, or `grace_s` without the shutdown
    finishing, calls `hard_exit`. An error of `coro` without a signal propagates unchanged."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(coro)
    got: list[int] = []
    timer: list[threading.Timer] = []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if got:
            log.error("%s during the shutdown: killing the run's processes", name)
            hard_exit(got[0])
        got.append(signum)
        log.warning("%s: shutting down (send it again to kill the run at once)", name)

        def overdue() -> None:  # on a thread of its own: works even if the loop is stuck
            log.error("shutdown still running after %.0fs: killing the run's processes", grace_s)
            hard_exit(signum)

        t = threading.Timer(grace_s, overdue)
        t.daemon = True
        t.start()
        timer.append(t)
        task.cancel()

    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        loop.add_signal_handler(s, on_signal, s)
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks, loop)
    try:
        return loop.run_until_complete(task)
    except BaseException as e:
        if got:
            raise Interrupted(got[0]) from (None if isinstance(e, asyncio.CancelledError) else e)
        raise
    finally:
        try:
            for s in SIGNALS:
                loop.remove_signal_handler(s)
                signal.signal(s, previous[s])
            loop.remove_signal_handler(signal.SIGUSR1)
            _close(loop)
        finally:
            for t in timer:  # only now: closing the loop is bounded by the grace period too
                t.cancel()


def dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """SIGUSR1: every pending task of the driver's loop and where it waits, to stderr (what a run
    that makes no progress is waiting for; `kill -USR1 <pid>`)."""
    tasks = asyncio.all_tasks(loop)
    print(f"== SIGUSR1: {len(tasks)} pending tasks", file=sys.stderr, flush=True)
    for t in tasks:
        print(f"-- {t.get_name()}", file=sys.stderr)
        aw, depth = t.get_coro(), 0
        while aw is not None and depth < 40:  # the chain of awaits, outermost first
            frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None) or getattr(aw, "gi_frame", None)
            if frame is not None:
                print(f"   {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=sys.stderr)
            elif not hasattr(aw, "cr_await"):
                print(f"   {aw!r}"[:200], file=sys.stderr)
            aw, depth = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None) or getattr(aw, "gi_yieldfrom", None), depth + 1
    sys.stderr.flush()


def _close(loop: asyncio.AbstractEventLoop) -> None:
    try:
        rest = asyncio.all_tasks(loop)
        for t in rest:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


AT_HARD_EXIT: list = []
"""Callables `hard_exit` runs first, each bounded by itself (pipeline/cluster/launch.py: release the
scheduler's hosts, which are not in this process's tree)."""


def hard_exit(signum: int) -> None:
    """Kill this process's tree with SIGKILL, unlink its segments and exit 128 + signum, now."""
    try:
        for release in AT_HARD_EXIT:
            try:
                release()
            except Exception as e:  # noqa: BLE001 - exiting anyway
                log.error("while exiting: %s", e)
        killed = stop_tree()
        log.error("killed %d processes of the run; exiting %d", len(killed), 128 + signum)
    finally:
        sys.stderr.flush()
        os._exit(128 + signum)


# ---------------------------------------------------------------------- process tree


def become_subreaper() -> None:
    """Make this process the child subreaper of its tree: a process orphaned inside it (a vLLM engine
    core whose proc was killed) re-parents here instead of to init, so `stop_tree` still finds it."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed (errno %d): orphans of the run re-parent to init",
                    ctypes.get_errno())


def stop_tree(timeout_s: float = KILL_WAIT_S) -> list[int]:
    """SIGKILL every descendant of this process, wait (up to timeout_s) until they are gone, then
    unlink the segments they created or held that no live process maps any more. Returns the pids
    signalled."""
    tree = descendants(os.getpid())
    if not tree:
        return []
    pids = {p for p, _ in tree}
    held = {name for name, users in segment_users().items() if users & pids}
    killed = kill(tree)
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)  # a killed grandchild is not ours to wait for; /proc is the only way to see it go
    created = {n for n in _own_segments() if creator_pid(n) in pids}
    _unlink_unused(held | created)
    return killed


def exit_with_parent() -> None:
    """In vLLM's engine core: SIGKILL this process once its parent (the generator proc) has exited,
    however it exited. The engine core does not watch its parent, so a generator proc killed with
    SIGKILL would leave it running, holding its psm_ segments (its own workers do watch the engine
    core). A no-op in any other process; idempotent. Called from the vLLM plugin's register()."""
    import multiprocessing

    global _watching
    parent = multiprocessing.parent_process()
    if parent is None or not multiprocessing.current_process().name.startswith("EngineCore") or _watching:
        return
    _watching = True

    def watch() -> None:
        parent.join()  # multiprocessing's sentinel: readable once the parent has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# ---------------------------------------------------------------------- segments


def segment_name(tag: str) -> str:
    """A weight-sync segment's name, `mrl-ws-<tag>-<creator pid>-<random>`: the pid in it tells a
    dead run's segment from a live one's."""
    return f"{WS_PREFIX}{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def creator_pid(name: str) -> int | None:
    """The pid a `segment_name` name was made in; None for any other name."""
    parts = name.rsplit("-", 2)
    if not name.startswith(WS_PREFIX) or len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def segment_users() -> dict[str, set[int]]:
    """Segment name -> pids that hold it open or map it. Each process's fds are read before its
    maps: a creator opens, maps, then may close, so one of the two always shows it. A mapping is
    named by its inode: glibc maps a named semaphore (sem.mp-*, a vLLM engine's worker lock) through
    the temporary file it creates it as, so maps shows that file's name, '(deleted)'."""
    users: dict[str, set[int]] = {}
    prefix = SHM_DIR + "/"
    by_inode = {}
    for e in os.scandir(SHM_DIR):
        by_inode[e.inode()] = e.name
    for d in os.scandir("/proc"):
        if not d.name.isdigit():
            continue
        pid = int(d.name)
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith(prefix):
                    users.setdefault(target[len(prefix):], set()).add(pid)
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:  # fields: address perms offset device inode path
                        name = by_inode.get(int(line.split()[4]), line[i + len(prefix):].rstrip("\n"))
                        users.setdefault(name, set()).add(pid)
        except OSError:  # gone meanwhile, or another user's
            continue
    return users


def sweep_segments(min_age_s: float = MIN_AGE_S, names: Iterable[str] | None = None) -> list[str]:
    """Unlink the segments of dead runs (see the module docstring), among `names` if given. Returns
    the names removed."""
    now = time.time()
    candidates = set()
    for name in _own_segments() if names is None else names:
        pid = creator_pid(name)
        if pid is not None:
            if not _pid_alive(pid):
                candidates.add(name)
        elif name.startswith(ANONYMOUS):
            try:
                if now - os.stat(os.path.join(SHM_DIR, name)).st_ctime >= min_age_s:
                    candidates.add(name)
            except FileNotFoundError:
                pass
    return _unlink_unused(candidates) + _sweep_lora_dirs()


def sweep_dead_weight_sync() -> list[str]:
    """Unlink the weight-sync segments (`mrl-ws-*`) whose creator died and that nobody maps any more:
    what a trainer proc killed hard leaves (its packed slots), removed by the surviving driver as
    soon as it learns of the death and again on its way out, not at the next run's start."""
    try:
        names = [n for n in _own_segments() if n.startswith(WS_PREFIX)]
    except FileNotFoundError:
        return []
    return sweep_segments(names=names)


def held_by(pids: Iterable[int]) -> set[str]:
    """The multiprocessing segments (psm_*, sem.mp-*) that any of `pids` maps or holds open: what a
    process tree killed hard leaves behind (a vLLM engine's message queues). Read them before the kill."""
    want = set(pids)
    return {name for name, users in segment_users().items() if users & want and name.startswith(ANONYMOUS)}


def unlink_orphaned(names: Iterable[str]) -> list[str]:
    """Unlink each of `names` that no live process maps or holds open any more (after the kill)."""
    return _unlink_unused(set(names))


def untrack(names: Iterable[str]) -> None:
    """Tell this process's multiprocessing resource tracker that segments it was tracking for a
    child killed hard (and unlinked since) are gone, so it does not warn of them as leaked at exit."""
    from multiprocessing import resource_tracker

    for name in names:
        sem = name.startswith("sem.")
        with contextlib.suppress(Exception):
            resource_tracker.unregister("/" + (name[4:] if sem else name), "semaphore" if sem else "shared_memory")


LORA_PREFIX = "mrl-lora-"  # a generator's LoRA adapter directories (generator Engine._start_lora): mrl-lora-<pid>-*


def _sweep_lora_dirs() -> list[str]:
    """Remove the LoRA adapter directories whose generator process is gone."""
    import shutil

    out = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except FileNotFoundError:
        return out
    for e in entries:
        parts = e.name[len(LORA_PREFIX):].split("-", 1)
        if e.name.startswith(LORA_PREFIX) and e.is_dir(follow_symlinks=False) and parts[0].isdigit() \
                and not _pid_alive(int(parts[0])):
            shutil.rmtree(e.path, ignore_errors=True)
            out.append(e.name)
    return out


def _own_segments() -> list[str]:
    uid = os.geteuid()
    out = []
    for e in os.scandir(SHM_DIR):
        try:
            if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid == uid:
                out.append(e.name)
        except FileNotFoundError:
            pass
    return out


def _unlink_unused(names: set[str]) -> list[str]:
    """Unlink each of `names` that no live process maps or holds open."""
    if not names:
        return []
    used = segment_users()
    removed = []
    for name in sorted(names - used.keys()):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    """A live (not zombie) process has this pid; a reused pid counts as alive (keeps a segment)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
