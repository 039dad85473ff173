"""The wire of an OpenEnv episode (pipeline/tasks/openenv.py): one environment in this process, or one
WebSocket session on a served one, each answering reset/step with the observation's wire form
({"observation": {...}, "reward": ..., "done": ...}); `checked` reads it. Failures are RewardRejected
with the reason the episode is counted under (env_unreachable, env_timeout, env_bad_observation).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Callable

from pipeline.tasks import RewardRejected, check_reward

__all__ = ["EnvUnreachable", "InProcess", "Served", "checked", "first_line"]


class EnvUnreachable(RewardRejected):
    """A served environment that refused a session within task.openenv.connect_timeout_s, or dropped it."""

    def __init__(self, message: str):
        super().__init__("env_unreachable", message)

    def __reduce__(self):
        return (type(self), (self.message,))



class InProcess:
    """One environment instance in this process; observations as their wire form (serialize_observation)."""

    def __init__(self, factory: Callable[[], Any], action_cls: Any):
        self.env, self.action_cls = factory(), action_cls

    def reset(self, seed: int) -> dict:
        from openenv.core.env_server import serialize_observation
        return serialize_observation(self.env.reset(seed=seed, episode_id=uuid.uuid4().hex))

    def step(self, payload: dict) -> dict | str:
        """The observation; a str: the action did not validate (the model's error, shown to it)."""
        from openenv.core.env_server import deserialize_action, serialize_observation
        from pydantic import ValidationError
        try:
            action = deserialize_action(payload, self.action_cls)
        except (ValidationError, ValueError) as e:
            return f"error: invalid action: {first_line(e)}"
        return serialize_observation(self.env.step(action))

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class Served:
    """One WebSocket session on a served environment's /ws route (the protocol of openenv's EnvClient:
    {"type": "reset"|"step"|"close", "data": ...} -> {"type": "observation", "data": {...}})."""

    def __init__(self, url: str, connect_timeout_s: float, timeout_s: float):
        from websockets.sync.client import connect

        ws_url = re.sub(r"^http", "ws", url.rstrip("/")) + "/ws"
        self.timeout_s, deadline, last = timeout_s, time.monotonic() + connect_timeout_s, None
        while True:  # a restarting local server refuses for a second or two
            try:
                self.ws = connect(ws_url, open_timeout=max(1.0, min(5.0, deadline - time.monotonic())),
                                  max_size=64 * 1024 * 1024, proxy=None, close_timeout=2).__enter__()  # closed in close()
                break
            except Exception as e:
                last = e
                if time.monotonic() >= deadline:
                    raise EnvUnreachable(f"{ws_url} did not accept a session within task.openenv.connect_timeout_s="
                                         f"{connect_timeout_s:g}s: {type(e).__name__}: {first_line(e)}") from None
                time.sleep(0.2)
        del last

    def _call(self, message: dict) -> dict:
        from websockets.exceptions import ConnectionClosed
        try:
            try:
                self.ws.send(json.dumps(message))
            except ConnectionClosed:
                pass  # a refused session (at capacity) sends an error frame, then closes: read it
            raw = self.ws.recv(timeout=self.timeout_s)
        except ConnectionClosed as e:
            raise EnvUnreachable(f"the server closed the session during {message['type']}: {first_line(e)}") from None
        except TimeoutError:
            raise RewardRejected("env_timeout", f"the server did not answer {message['type']} within "
                                 f"task.env_timeout_s={self.timeout_s:g}s") from None
        try:
            reply = json.loads(raw)
        except (TypeError, json.JSONDecodeError):
            raise RewardRejected("env_bad_observation", f"the server answered {str(raw)[:120]!r}, not JSON") from None
        if not isinstance(reply, dict):
            raise RewardRejected("env_bad_observation", f"the server answered {str(raw)[:120]!r}, not a message")
        return reply

    def reset(self, seed: int) -> dict:
        reply = self._call({"type": "reset", "data": {"seed": seed, "episode_id": uuid.uuid4().hex}})
        if reply.get("type") == "error":
            code = (reply.get("data") or {}).get("code")
            if code in ("CAPACITY_REACHED", "SESSION_ERROR", "FACTORY_ERROR"):
                raise EnvUnreachable(f"the server refused the session: {_error_text(reply)}")
            raise RuntimeError(f"reset failed on the server: {_error_text(reply)}")
        return reply.get("data")

    def step(self, payload: dict) -> dict | str:
        reply = self._call({"type": "step", "data": payload})
        if reply.get("type") == "error":
            if reply.get("data", {}).get("code") == "VALIDATION_ERROR":
                return f"error: invalid action: {_error_text(reply)}"
            raise RuntimeError(f"step failed on the server: {_error_text(reply)}")
        return reply.get("data")

    def close(self) -> None:
        try:
            self.ws.send(json.dumps({"type": "close"}))
        except Exception:
            pass
        self.ws.close()


def _error_text(reply: dict) -> str:
    data = reply.get("data") or {}
    return f"{data.get('message', data)} ({data.get('code', 'no code')})"


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def checked(obs: Any, what: str) -> tuple[dict, float | None, bool]:
    """(observation fields, reward, done) of a wire-form observation; RewardRejected (env_bad_observation,
    or the reward's own reason) if it is not one."""
    if not isinstance(obs, dict) or not isinstance(obs.get("observation", {}), dict):
        raise RewardRejected("env_bad_observation", f"{what} returned {str(obs)[:120]!r}, not an observation")
    reward, done = obs.get("reward"), obs.get("done", False)
    if reward is not None:
        if isinstance(reward, bool):
            reward = float(reward)
        try:
            reward = check_reward(reward)
        except RewardRejected as e:
            raise RewardRejected(e.reason, f"{what}: the observation's reward {e.message}") from None
    if not isinstance(done, bool):
        raise RewardRejected("env_bad_observation", f"{what} returned done={done!r}, not a bool")
    return obs.get("observation", {}), reward, done
