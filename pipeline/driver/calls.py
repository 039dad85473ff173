"""What every driver role shares: its errors and the bound on a call to an actor.

    value = await call_within("buffer.stats", buffer.stats.call_one(), 60)   # RunError after 60 s
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

CALL_TIMEOUT_S = 600.0


class RunError(RuntimeError):
    """A loop or an actor failed; the message names which and why."""


class EndOfData(Exception):
    """The prompt stream ended (run.epochs) and the buffer holds no full batch any more: a normal end."""


async def call_within(what: str, aw: Awaitable[Any], timeout: float = CALL_TIMEOUT_S) -> Any:
    """Await `aw` for at most `timeout` seconds; a timeout raises RunError naming `what`, so a hung
    actor stops the run with a message that says which call hung (every wait has a timeout)."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise RunError(f"{what} did not answer within {timeout:.0f}s") from None
