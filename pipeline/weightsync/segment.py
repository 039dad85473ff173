"""POSIX shared-memory segments holding one version: a header page, then the plan's flat bytes.

We map `/dev/shm/<name>` ourselves instead of `multiprocessing.shared_memory`, whose resource
tracker (Python < 3.13) unlinks segments when any process that merely opened them exits.

Header (int64 words) is the publication point and a seqlock: the writer sets `version = WRITING`
before touching the bytes and the real version after; a reader checks the version before and after
it reads (versions only grow, so "still v afterwards" means the bytes were not rewritten).
"""

from __future__ import annotations

import mmap
import os
import weakref

import torch

# Segment names (`mrl-ws-<tag>-<creator pid>-<random>`) are made where the sweep reads them back.
from pipeline.cleanup import SHM_DIR, segment_name as new_name  # noqa: F401
from pipeline.weightsync.errors import PlanMismatchError, ShortBufferError, TornReadError, VersionRegressionError

HEADER_BYTES = 4096
HEADER_WORDS = 8
MAGIC = 0x4D524C5753  # "MRLWS"
EMPTY, WRITING = -2, -1
# header word indices; a trainer slot's H_BASE / H_DELTA: the version its delta is against (EMPTY: no
# delta offered, read the full bytes) and the delta's wire length (pipeline/weightsync/delta.py)
H_MAGIC, H_VERSION, H_PLAN, H_TOTAL, H_BASE, H_DELTA = 0, 1, 2, 3, 4, 5


class Segment:
    """One mapped segment: `.header` (int64[8]) and `.data` (uint8[size]) are views into it."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name, self.size, self.owner = name, size, create
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            raise ShortBufferError(f"shared-memory segment {name!r} does not exist (sender closed?)") from None
        try:
            if create:
                os.ftruncate(fd, HEADER_BYTES + size)
            have = os.fstat(fd).st_size - HEADER_BYTES
            if have < size:
                raise ShortBufferError(f"shared-memory segment {name!r} holds {have} data bytes, plan needs {size}")
            self._mm = mmap.mmap(fd, HEADER_BYTES + size)
        finally:
            os.close(fd)
        buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.header = buf[:HEADER_WORDS * 8].view(torch.int64)
        self.data = buf[HEADER_BYTES:HEADER_BYTES + size]
        if create:
            self.header.copy_(torch.tensor([MAGIC, EMPTY, 0, size, 0, 0, 0, 0]))
            # Unlink at GC / interpreter exit too if close() is never called (a killed proc still leaks).
            self._finalizer = weakref.finalize(self, _unlink, path)

    def close(self) -> None:
        self.header = self.data = None  # drop views before the map
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the map goes when it does
        if self.owner:
            self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def begin_write(header: torch.Tensor) -> None:
    header[H_VERSION] = WRITING


def end_write(header: torch.Tensor, version: int, plan_hash_int: int, total: int) -> None:
    header[H_MAGIC], header[H_PLAN], header[H_TOTAL] = MAGIC, plan_hash_int, total
    header[H_VERSION] = version  # last: publishes the bytes


def check_header(header: torch.Tensor, version: int, plan_hash_int: int, where: str, after_read: bool = False) -> None:
    """Raise unless `header` publishes exactly `version` under this plan."""
    magic, have, plan = (int(x) for x in header[:3].tolist())
    if magic != MAGIC:
        raise PlanMismatchError(f"version {version}: {where} has no weight-sync header (magic {magic:#x})")
    if have != version:
        if after_read:
            raise TornReadError(f"version {version}: {where} was overwritten (now {have}) while being read; "
                                "a push reused a slot a receiver was still reading")
        if have > version:
            raise VersionRegressionError(f"version {version}: {where} already holds newer version {have}")
        raise PlanMismatchError(f"version {version}: {where} holds version {have}")
    if plan != plan_hash_int:
        raise PlanMismatchError(f"version {version}: {where} was packed with plan {plan:x}, "
                                f"receiver expects {plan_hash_int:x} (bucket 0 onward)")
