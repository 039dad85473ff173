"""An OpenEnv tool environment written as a user would: MCP tools (FastMCP) behind `MCPEnvironment`.

Each episode is a sum of three numbers. The model may call `add(a, b)` as often as it likes and ends
the episode with `submit(answer)`; the rubric (`Gate(Correct(), threshold=1.0)` inside a
`WeightedSum` with a small format credit for a well-formed submit) scores the submitted answer:

    reset(seed)                                   -> "What is 12 + 7 + 30? ..."
    <tool_call>{"name": "add", "arguments": {"a": 12, "b": 7}}</tool_call>      -> "19"     reward 0
    <tool_call>{"name": "submit", "arguments": {"answer": 49}}</tool_call>     -> done     reward 1.0

The model's tool calls are parsed from the Hermes/Qwen format above (pipeline/tasks/openenv.py's
default action adapter for an MCP environment); the tools are listed in the system message.

    python -m pipeline.run --config configs/tiny.yaml task.name=pipeline.tasks.openenv \\
        task.openenv.env=examples.envs.calc_tools.CalcToolsEnvironment task.openenv.serve=local
"""

from __future__ import annotations

import random
from typing import Any, Optional
from uuid import uuid4

from fastmcp import FastMCP
from pydantic import Field

from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State
from openenv.core.rubrics import Gate, Rubric, WeightedSum


class TaskObservation(Observation):
    prompt: str = Field(default="", description="The question")


class Correct(Rubric):
    def forward(self, action: Any, observation: Any) -> float:
        return float(observation.metadata.get("submitted") == observation.metadata.get("answer"))


class WellFormed(Rubric):
    def forward(self, action: Any, observation: Any) -> float:
        return float(observation.metadata.get("submitted") is not None)


class CalcToolsEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calc")
        env = self

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the final answer; ends the episode."""
            env.submitted = answer
            return "submitted"

        super().__init__(mcp)
        self.rubric = WeightedSum([Gate(Correct(), threshold=1.0), WellFormed()], [0.9, 0.1])
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.numbers: list[int] = []
        self.submitted: int | None = None

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> TaskObservation:
        rng = random.Random(seed)
        self.numbers = [rng.randint(1, 60) for _ in range(3)]
        self.submitted = None
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        q = " + ".join(map(str, self.numbers))
        return TaskObservation(prompt=f"What is {q}? Use the tools; finish with submit.", reward=0.0, done=False)

    # An MCP environment's served WebSocket route calls step_async, in-process code calls step: score in both.
    def step(self, action: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _scored(self, action: Any, obs: Observation) -> Observation:
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and isinstance(obs, CallToolObservation):
            obs.metadata = {**obs.metadata, "submitted": self.submitted, "answer": sum(self.numbers)}
            obs.done = action.tool_name == "submit" and self.submitted is not None
            obs.reward = self.rubric(action, obs) if obs.done else 0.0
        return obs

    def _step_impl(self, action: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return TaskObservation(prompt="error: only tool calls are accepted", reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


def app():
    from openenv.core.env_server import create_app
    return create_app(CalcToolsEnvironment, CallToolAction, CallToolObservation, env_name="calc_tools",
                      max_concurrent_envs=64)
