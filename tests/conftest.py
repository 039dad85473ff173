"""Shared fixtures: the tiny checkpoint is built once per machine under .cache/tiny-model."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from pipeline.config import ModelConfig
    from pipeline.model import ensure_tiny_assets

    return ensure_tiny_assets(ModelConfig(cache_dir=str(REPO / ".cache" / "tiny-model")))


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module, for modules that drive Monarch meshes from sync tests."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()



# A hung test must fail the run with its name and stack, not run CI into its time limit. No single
# test here takes more than a few minutes; RL_TEST_LIMIT_S raises the bound on a slow machine.
TEST_LIMIT_S = float(os.environ.get("RL_TEST_LIMIT_S", "900"))


def _hung(item) -> None:
    import faulthandler
    import sys

    import psutil

    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # the test's output is being captured: write to the real terminal
        capture.suspend_global_capture(in_=False)
    nodeid = item.nodeid
    sys.__stderr__.write(f"\n[watchdog] {nodeid} still running after {TEST_LIMIT_S:.0f}s; its stacks:\n")
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    for child in psutil.Process().children(recursive=True):  # Monarch procs, vLLM engine cores
        child.kill()
    sys.__stderr__.flush()
    os._exit(70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler
    import sys
    import threading

    timer = threading.Timer(TEST_LIMIT_S, _hung, args=(item,))
    timer.daemon = True
    timer.start()
    # backstop for a hang that holds the GIL: faulthandler's own thread needs none
    faulthandler.dump_traceback_later(TEST_LIMIT_S + 60, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
