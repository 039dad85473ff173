"""Id sets in cpuset syntax: the cores and GPUs a config key names (trainer.cpus, generator.devices, ...).

    parse_ids("0,2,4-7")      # (0, 2, 4, 5, 6, 7), in the order written; "" -> () (not pinned)
    format_ids({5, 0, 1, 2})  # '0-2,5'

Pure syntax: whether this host has the ids is pipeline/placement.py's business, at start-up.
"""

from __future__ import annotations

import re
from typing import Iterable

MAX_ID = 65535
_ITEM = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")


def parse_ids(spec: str, what: str = "core") -> tuple[int, ...]:
    """'0', '0-3', '0,2,4-7' -> the ids in the order written; '' -> (). ValueError on bad syntax,
    an id above MAX_ID or an id listed twice."""
    if not spec.strip():
        return ()
    out: list[int] = []
    for item in spec.split(","):
        m = _ITEM.fullmatch(item)
        if m is None:
            raise ValueError(f"{item.strip()!r} is not a {what} id or a range a-b of them")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo or hi > MAX_ID:
            raise ValueError(f"range {item.strip()!r} is empty or goes past {MAX_ID}")
        for i in range(lo, hi + 1):
            if i in out:
                raise ValueError(f"{what} {i} is listed twice")
            out.append(i)
    return tuple(out)


def format_ids(ids: Iterable[int]) -> str:
    """Sorted ids as cpuset syntax: [0, 1, 2, 5] -> '0-2,5'."""
    parts: list[list[int]] = []
    for i in sorted(ids):
        if parts and parts[-1][1] == i - 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
