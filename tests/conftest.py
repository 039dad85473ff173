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
