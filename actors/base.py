"""PipelineActor: what every actor of the pipeline does in its own proc, whatever its role.

    class TrainerActor(PipelineActor):
        def __init__(self, cfg):
            super().__init__(cfg.run.log_level)

It configures the proc's logging (pipeline/logs.py) and makes a clean stop quick: Monarch calls
`__cleanup__` when it stops the actor, and a proc whose actors were stopped cleanly leaves without
the interpreter's teardown (pipeline/procs.py `exit_fast_when_stopped`)."""

from __future__ import annotations

from monarch.actor import Actor

from pipeline import logs, procs


class PipelineActor(Actor):
    def __init__(self, log_level: str) -> None:
        logs.configure(log_level)
        procs.exit_fast_when_stopped()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        procs.stopped(exc)
