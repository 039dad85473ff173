"""Page-locked host slots for a trainer on CUDA.

A trainer rank on a GPU packs its weights into host memory for the shm and rdma transports (the
slots a receiver maps or reads). From pageable memory the copy device -> host runs through a bounce
buffer at a few GB/s (measured on an H200: 1.5-3.1 GB/s for Qwen3-0.6B's 1.1 GiB, docs/results/benchmarks.md);
page-locked, it is a DMA at the link's speed. The slots already exist (a /dev/shm mapping, or memory
registered with Monarch's RDMA), so they are registered with CUDA in place (cudaHostRegister) at the
first push from a CUDA tensor, and unregistered before they are unmapped. A registration the driver
refuses leaves that slot pageable (correct, slower) with one WARNING.
"""

from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger(__name__)
PAGE = mmap.PAGESIZE


class HostPins:
    """The page ranges registered with CUDA, to be released by `release()` (before the memory goes)."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}  # page-aligned start -> length
        self._refused = False

    def pin(self, t: torch.Tensor) -> bool:
        """Register the pages under `t` (a CPU tensor) with CUDA; True if they are page-locked now."""
        if t.is_cuda or t.numel() == 0 or not torch.cuda.is_available():
            return False
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = ptr & ~(PAGE - 1), -(-(ptr + n) // PAGE) * PAGE
        if any(s <= lo and hi <= s + ln for s, ln in self._ranges.items()):
            return True
        code = int(torch.cuda.cudart().cudaHostRegister(lo, hi - lo, 0))
        if code != 0:
            if not self._refused:
                log.warning("weight sync: CUDA refused to page-lock a %d-byte host slot (cudaError %d); it stays "
                            "pageable (a slower device->host copy)", hi - lo, code)
            self._refused = True
            return False
        self._ranges[lo] = hi - lo
        return True

    def release(self) -> None:
        for lo in list(self._ranges):
            torch.cuda.cudart().cudaHostUnregister(lo)
            del self._ranges[lo]
