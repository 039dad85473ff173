"""Stand-ins for tests/test_signals.py, where the real thing would cost an engine start per case.

    python -m tests.signal_standins GRACE_S      # a run whose shutdown never ends

The run: pipeline.run's signal path (cleanup.run_until_signalled) around a job whose shutdown
hangs, so the second-signal and grace-period paths run in seconds. It becomes the subreaper of its
tree like pipeline.run, starts a child that maps an `mrl-ws-` segment named with its pid and an
anonymous `psm_` one (as a vLLM engine core would), and an orphan (its parent exits at once, so it
re-parents here). Prints one JSON line {"pids": [...], "segments": [...]} then "running", and on
the first signal "shutdown"; exits the way pipeline.run does.

`engine_core` is the target of a multiprocessing process named like vLLM's engine core: it binds
its life to its parent's (cleanup.exit_with_parent, as the vLLM plugin does in the real one).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from pipeline import cleanup

HOLDER = """
import mmap, os, sys, time, uuid
names = [f"mrl-ws-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", f"psm_{uuid.uuid4().hex[:8]}"]
maps = []
for n in names:
    fd = os.open(f"/dev/shm/{n}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
print(" ".join(names), flush=True)
time.sleep(3600)
"""
ORPHAN_PARENT = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
print(p.pid, flush=True)
"""


def engine_core() -> None:
    cleanup.exit_with_parent()
    print("engine core up", flush=True)
    time.sleep(3600)


async def job() -> None:
    try:
        print("running", flush=True)
        await asyncio.Event().wait()
    finally:
        print("shutdown", flush=True)
        await asyncio.Event().wait()  # a shutdown that hangs


def main() -> int:
    cleanup.become_subreaper()
    cleanup.raise_on_signals()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    segments = holder.stdout.readline().split()
    orphan_parent = subprocess.run([sys.executable, "-c", ORPHAN_PARENT], capture_output=True, text=True, check=True)
    orphan = int(orphan_parent.stdout)
    print(json.dumps({"pids": [holder.pid, orphan], "segments": segments}), flush=True)
    try:
        cleanup.run_until_signalled(job(), float(sys.argv[1]))
    except KeyboardInterrupt as e:
        return cleanup.exit_code(e)
    finally:
        cleanup.stop_tree()
    return 0


if __name__ == "__main__":
    sys.exit(main())
