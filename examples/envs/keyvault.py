"""An OpenEnv environment written as a user would, against the package's documented API: a multi-step
lookup whose reward comes from a rubric built of `openenv.core.rubrics` parts.

Each episode asks for the three-digit code of a three-letter key. The codes are a fixed pseudo-random
table (from the key alone), so the only way to the reward is to ask the vault and copy its answer:

    reset(seed)        -> "key qmz="                  (the key drawn from the seed)
    step("?")          -> ":417;"        reward 0      (a lookup: `?` for the asked key, `?abc` for any)
    step("417")        -> done           reward 1.0    (an answer: the rubric scores it, the episode ends)

The rubric (`KeyVaultEnvironment.rubric`) is `WeightedSum([ExactCode(), DigitShare()], [0.7, 0.3])`:
0.7 for the exact code, plus 0.3 x the share of digits in the right place; a lookup turn is worth 0. Run it in-process or served (both from the repository root):

    python -m pipeline.run --config configs/tiny.yaml task.name=pipeline.tasks.openenv \\
        task.openenv.env=examples.envs.keyvault.KeyVaultEnvironment task.openenv.chat=false \\
        task.openenv.demonstration=examples.envs.keyvault.demonstration
    python -m uvicorn --factory examples.envs.keyvault:app --port 8011     # served by hand, then
        ... task.openenv.url=http://127.0.0.1:8011                           # (or task.openenv.serve=local)
"""

from __future__ import annotations

import random
import re
import string
from typing import Any, Optional
from uuid import uuid4

from pydantic import Field

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric, WeightedSum

KEY = re.compile(r"[a-z]{3}")


class VaultAction(Action):
    message: str = Field(..., description="`?` (or `?abc`) to look a code up; anything else is the answer")


class VaultObservation(Observation):
    prompt: str = Field(default="", description="What the agent sees")


def code_of(key: str) -> str:
    return str(random.Random(f"keyvault/{key}").randint(100, 999))


class ExactCode(Rubric):
    def forward(self, action: VaultAction, observation: VaultObservation) -> float:
        return float(action.message.strip() == observation.metadata.get("code"))


class DigitShare(Rubric):
    def forward(self, action: VaultAction, observation: VaultObservation) -> float:
        got, code = action.message.strip(), observation.metadata.get("code", "")
        return sum(a == b for a, b in zip(got, code)) / len(code) if code else 0.0


class IsAnswer(Rubric):
    def __init__(self, inner: Rubric):
        super().__init__()
        self.inner = inner

    def forward(self, action: VaultAction, observation: VaultObservation) -> float:
        return 0.0 if action.message.strip().startswith("?") else self.inner(action, observation)


class KeyVaultEnvironment(Environment[VaultAction, VaultObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__(rubric=IsAnswer(WeightedSum([ExactCode(), DigitShare()], [0.7, 0.3])))
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.key = "aaa"

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> VaultObservation:
        rng = random.Random(seed)
        self.key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return VaultObservation(prompt=f"key {self.key}=", reward=0.0, done=False)

    def step(self, action: VaultAction, timeout_s: Optional[float] = None, **kwargs: Any) -> VaultObservation:
        self._state.step_count += 1
        text = action.message.strip()
        code = code_of(self.key)
        if text.startswith("?"):
            asked = text[1:].strip() or self.key
            shown = code_of(asked) if KEY.fullmatch(asked) else "error"
            obs = VaultObservation(prompt=f":{shown};", done=False, metadata={"code": code})
        else:
            obs = VaultObservation(prompt="", done=True, metadata={"code": code})
        obs.reward = self.rubric(action, obs)
        return obs

    @property
    def state(self) -> State:
        return self._state


def demonstration(first_observation: str, seed: int) -> list[str]:
    """The ideal episode for the warm start (task.openenv.demonstration): look up, then copy."""
    key = first_observation.strip()[4:-1]
    return ["?", f":{code_of(key)};", code_of(key)]


def app():
    """The served form (uvicorn --factory examples.envs.keyvault:app)."""
    from openenv.core.env_server import create_app
    return create_app(KeyVaultEnvironment, VaultAction, VaultObservation, env_name="keyvault", max_concurrent_envs=64)
