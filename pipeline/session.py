"""Interactive sessions: start the meshes from a REPL or notebook and step the pipeline by hand.

    >>> from pipeline.session import Session
    >>> s = Session.start("configs/tiny.yaml", ["run.out_dir=outputs/session"])
    >>> s.generate()              # generators start filling the buffer
    >>> s.train_step()            # one batch -> one optimizer step; returns the trainer's metrics
    >>> s.sync()                  # push the new weights to every generator; returns seconds
    >>> s.versions()              # {'trainer': 1, 'generator0': 1}
    >>> s.add_generators(1)       # [1]: generator1 joins on the trainer's weights
    >>> s.remove_generator(0)     # generator0 leaves; its groups go back to the buffer
    >>> s.buffer_stats()          # occupancy, in-flight groups, drops by reason, Δ ...
    >>> s.call("trainer", "version")   # any endpoint of any actor
    >>> s.stop()

Every method blocks until done (with the controller's timeouts) so it reads naturally at a prompt;
the meshes live on a private event loop thread. `s.pipe` is the underlying `Job` (pipeline/driver/job.py:
trainer, buffer, fleet, sync, evaluation) for async use. No supervisor runs: a generator that fails
fails the call that reached it (a push included), and nothing restarts it.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any, Sequence

from pipeline.config import Config, load_config
from pipeline.driver.calls import CALL_TIMEOUT_S, call_within
from pipeline.driver.hooks import Hooks, buffer_metrics
from pipeline.driver.job import Job
from pipeline.driver.loop import TrainLoop, finish_step
from pipeline.driver.shutdown import shut_down
from pipeline.models.hf import resolved
from pipeline.placement import check_host
from pipeline.run import loopback_only


class Session:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pipeline-session", daemon=True)
        self._thread.start()
        self.pipe = Job(cfg)
        # steps by hand: the session announces a version (train_step) and pushes it (sync) itself
        self._steps = TrainLoop(self.pipe, None, Hooks([]))
        self._generating = False
        atexit.register(self.stop)  # a session left open stops its meshes when the interpreter exits

    @classmethod
    def start(cls, config: str | Config | None = None, overrides: Sequence[str] = ()) -> "Session":
        cfg = config if isinstance(config, Config) else load_config(config, overrides)
        check_host(cfg)  # as the CLI does: a core this host lacks is a ConfigError before any proc
        cfg = resolved(cfg)  # as the CLI does: a builtin: model.hf_dir -> its folder, built once
        loopback_only()  # one host: every listener of the session on loopback, as in a CLI run
        s = cls(cfg)
        try:
            s._run(s.pipe.start(), timeout=None)
        except BaseException:
            s.stop()
            raise
        return s

    def _run(self, coro, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ stepping

    def generate(self) -> None:
        """Start generation in every generator actor (idempotent)."""
        if not self._generating:
            self._run(self.pipe.start_generation())
            self._generating = True

    def train_step(self) -> dict:
        """One batch from the buffer, one optimizer step (starts generation if needed); the buffer
        learns the new version at once, the generators with `sync()`."""
        self.generate()

        async def go() -> dict:
            _, metrics = await self._steps.train_once()
            metrics.update(buffer_metrics(await finish_step(self.pipe, self.pipe.version, metrics["reward/mean"])))
            return metrics

        return self._run(go(), timeout=None)

    def sync(self) -> float:
        """Push the trainer's weights to every generator; returns the end-to-end seconds."""
        return self._run(self.pipe.sync.push(self.pipe.version), timeout=None)

    def evaluate(self) -> dict[str, float]:
        return self._run(self.pipe.evaluation.evaluate())

    def add_generators(self, n: int = 1) -> list[int]:
        """n more generators, serving the trainer's current weights (pipeline/driver/pool.py); their indices."""
        return self._run(self.pipe.add_generators(n), timeout=None)

    def remove_generator(self, i: int) -> dict:
        """Generator i leaves (drained or aborted by generator.on_update, its groups requeued); its event."""
        return self._run(self.pipe.remove_generator(i), timeout=None)

    # ------------------------------------------------------------------ inspection

    def _generator(self, i: int) -> Any:
        return self.pipe.fleet.generators[i].handle

    def versions(self) -> dict[str, int]:
        async def get():
            out = {"trainer": await self.pipe.trainer.version()}
            for i, _ in self.pipe.fleet.live_generators():
                out[f"generator{i}"] = await call_within(f"generator{i}.version", self._generator(i).version.call_one())
            return out

        return self._run(get())

    def buffer_stats(self) -> dict:
        return self._run(call_within("buffer.stats", self.pipe.buffer.stats.call_one()))

    def stats(self) -> dict:
        return self._run(self.pipe.stats())

    def call(self, actor: str, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        """Call any endpoint: actor is 'trainer', 'buffer', 'generatorN', or a side mesh the config has
        ('reward_model', 'teacher'); trainer calls return rank 0's value."""
        n = len(self.pipe.fleet.generators)
        sides = {s.name: s for s in self.pipe.fleet.sides()}
        if actor in sides and sides[actor].handle is not None:
            mesh = sides[actor].handle
        elif actor == "trainer":
            mesh = self.pipe.trainer.mesh
        elif actor == "buffer":
            mesh = self.pipe.buffer
        elif actor.startswith("generator") and actor[9:].isdigit() and int(actor[9:]) < n:
            mesh = self._generator(int(actor[9:]))
        else:
            raise ValueError(f"unknown actor {actor!r}; use 'trainer', 'buffer', generator0..{n - 1}"
                             + "".join(f" or {k!r}" for k in sides))
        ep = getattr(mesh, endpoint, None)
        if ep is None or not hasattr(ep, "call_one"):
            raise ValueError(f"{actor} has no endpoint {endpoint!r}")

        async def go():
            if actor == "trainer":  # every trainer endpoint is a collective over all ranks
                return await self.pipe.trainer.call_all(endpoint, *args)
            return await call_within(f"{actor}.{endpoint}", ep.call_one(*args, **kwargs))

        return self._run(go())

    def stop(self) -> None:
        """Stop every proc mesh (the controller's bounded shutdown) and the session's loop; safe to
        call twice, and called at interpreter exit if never called."""
        atexit.unregister(self.stop)
        if self._loop.is_running():
            try:
                self._run(shut_down(self.pipe), timeout=300)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
