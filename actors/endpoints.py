"""Two endpoint kinds Monarch 0.7 does not give as such, for actors that must keep answering.

    class A(Actor):
        @serial                      # one at a time with A's other serial endpoints, in arrival order,
        async def apply(self, v): ...  # without holding up Monarch's queue (a probe still answers)

        @reply_droppable(concurrent=True)   # if the caller died before the reply, the reply is dropped
        async def admit(self, wait_s): ...  # instead of failing this actor

Why:
  * An actor's plain `@endpoint` is awaited by Monarch's dispatch loop, so every message that arrives
    after it, a `@concurrent_endpoint` probe included, waits until it returns. A generator's
    held-out eval on a loaded machine ran for minutes and its `stats` went unanswered for 3 x 60 s:
    the supervisor restarted a healthy generator. A `serial` endpoint is a concurrent one (spawned
    as a task, the queue moves on) whose body takes the actor's own asyncio.Lock first: the tasks
    start in arrival order and the lock is FIFO, so serial endpoints keep the one-at-a-time order
    plain endpoints had, while concurrent ones (`stats`, `watch`) answer beside them.
  * A reply to a caller whose actor was stopped (not killed: a supervisor's graceful restart) bounces
    ("invalid reference ... actor stopped"), and Monarch 0.7 fails the REPLYING actor for it without
    calling its `_handle_undeliverable_message`. For the replay buffer that ends the run. A
    `reply_droppable` endpoint answers on an explicit port with `return_undeliverable = False`: a
    reply nobody can take is dropped. The caller's errors still reach it (`port.exception`).
Checked against Monarch itself in tests/test_endpoints.py.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Callable

from monarch.actor import ActorError, concurrent_endpoint, endpoint

__all__ = ["serial", "reply_droppable"]

_LOCK = "_serial_endpoint_lock"


def _lock(actor: Any) -> asyncio.Lock:
    lock = actor.__dict__.get(_LOCK)
    if lock is None:
        lock = asyncio.Lock()
        setattr(actor, _LOCK, lock)
    return lock


def serial(fn: Callable) -> Any:
    """A concurrent endpoint that runs holding the actor's serial lock (module docstring)."""
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"serial: {fn.__qualname__} must be async")

    @functools.wraps(fn)
    async def body(self, *args, **kwargs):
        async with _lock(self):
            return await fn(self, *args, **kwargs)

    return concurrent_endpoint(body)


def reply_droppable(fn: Callable | None = None, *, concurrent: bool = False) -> Any:
    """An endpoint whose reply is dropped, not bounced, when its caller is gone (module docstring)."""
    if fn is None:
        return functools.partial(reply_droppable, concurrent=concurrent)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"reply_droppable: {fn.__qualname__} must be async")

    async def body(self, port, *args, **kwargs):
        port.return_undeliverable = False
        try:
            result = await fn(self, *args, **kwargs)
        except Exception as e:  # the caller's error, as a plain endpoint would forward it
            port.exception(ActorError(e, f"Actor call {type(self).__name__}.{fn.__name__} failed."))
        else:
            port.send(result)

    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    port = inspect.Parameter("port", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    body.__signature__ = sig.replace(parameters=[params[0], port, *params[1:]], return_annotation=None)
    body.__name__, body.__qualname__, body.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    body.__module__ = fn.__module__
    deco = concurrent_endpoint if concurrent else endpoint
    return deco(body, explicit_response_port=True)
