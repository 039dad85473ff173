"""OpenEnv environments as a task: `task.name=pipeline.tasks.openenv` with `task.openenv.*` (docs/openenv.md).

An OpenEnv `Environment` (the `openenv` package: `reset(seed) -> Observation`, `step(Action) ->
Observation`, pydantic models whose observations carry `reward` and `done`) runs in-process
(`task.openenv.env`, made per episode on the generator's environment workers) or served
(`task.openenv.url`, or `serve=local` for a server the run starts, pipeline/tasks/openenv_server.py);
a served episode is one WebSocket session on the server's /ws route.

What maps to what:

    prompts(seed, split)  one item per episode seed: train seeds 2i, held-out 2i+1 (offset by
                          task.seed), so held-out episodes are reproducible and never trained on.
                          The item's prompt is the reset observation rendered (`observation`),
                          after task.openenv.system, as a chat user turn (chat=true) or plain text.
    env(item)             an Episode: a fresh environment (or session), reset(seed=the item's seed).
                          Its first observation must be the item's prompt again (a group's samples
                          share that prompt): an environment that is not deterministic in its seed
                          fails the episode (env_bad_observation), never trains on a wrong prompt.
    Episode.step(turn)    the completion's text -> Action (`action`) -> step -> the observation's
                          text, shown as the next user turn; None once `done` (the episode ends).
                          A completion that does not parse as an action (no tool call) gets an
                          `error: ...` observation and reward 0 without reaching the environment.
    Episode.reward()      the last reward the episode returned, or their sum (task.openenv.reward);
                          the task's text reward is not used. Every step's reward is the rollout's
                          `turn_rewards`.

Faults stay with the episode: a server that refuses, dies, stalls past task.env_timeout_s or
answers with something that is not an observation fails that episode alone (env_unreachable,
env_raised, env_timeout, env_bad_observation), its group goes back to the buffer, and the run goes
on (pipeline/generator/episode.py). Sessions are closed on every exit path.

Example (a served environment):

    python -m pipeline.run --config configs/tiny.yaml task.name=pipeline.tasks.openenv \\
        task.openenv.env=examples.envs.keyvault.KeyVaultEnvironment task.openenv.serve=local task.openenv.chat=false
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
import typing
from typing import Any, Iterator

from pipeline.config import TaskConfig
from pipeline.tasks import RewardRejected, TaskError, _resolve
from pipeline.tasks.openenv_wire import EnvUnreachable, InProcess, Served, checked, first_line
from pipeline.types import PromptItem

__all__ = ["from_config", "OpenEnvTask", "Episode", "seed_of", "parse_tool_call", "EnvUnreachable"]

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
OBS_FIELDS = ("prompt", "text", "message", "content", "output", "question", "result")
TEXT_FIELDS = ("message", "text", "content", "response", "answer", "action", "command", "code")
RESERVED = ("reward", "done", "metadata")

def seed_of(base: int, split: str, i: int) -> int:
    """Episode i's seed: train 2i, held-out 2i + 1, offset by the run's task.seed (disjoint splits)."""
    return base * 1_000_000_007 + 2 * i + (1 if split == "eval" else 0)


def parse_tool_call(text: str) -> dict | None:
    """The last `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a completion (the Hermes /
    Qwen tool-call format) as a CallToolAction payload, or None without one that parses."""
    for m in reversed(TOOL_CALL.findall(text)):
        try:
            call = json.loads(m)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", call.get("parameters", {}))
            return {"type": "call_tool", "tool_name": call["name"], "arguments": args if isinstance(args, dict) else {}}
    return None


def _is_tool_schema(schema: dict) -> bool:
    props = schema.get("properties", {})
    return "tool_name" in props and "arguments" in props


def _text_field(schema: dict, name: str) -> str:
    """The action field that gets the completion's text: its one required str field, else a usual name."""
    props = schema.get("properties", {})
    strs = [k for k, v in props.items() if v.get("type") == "string" and k not in ("type",)]
    required = [k for k in schema.get("required", []) if k in strs]
    if len(required) == 1:
        return required[0]
    if not required:
        for k in TEXT_FIELDS:
            if k in strs:
                return k
        if len(strs) == 1:
            return strs[0]
    raise TaskError(f"task.openenv.action: cannot tell which field of {name}'s action gets the completion "
                    f"(string fields: {', '.join(strs) or 'none'}; required: {', '.join(schema.get('required', [])) or 'none'}); "
                    "name it (task.openenv.action=<field>) or give an adapter (a dotted path)")


def render_observation(obs: dict) -> str:
    """The default text of an observation (its fields but reward/done/metadata): an MCP tool's result or
    error, the tools of a tool listing, a lone string field, a usual field name, else JSON."""
    fields = {k: v for k, v in obs.items() if k not in RESERVED}
    if "tool_name" in fields and ("result" in fields or "error" in fields):
        if fields.get("error"):
            err = fields["error"]
            return f"error: {err.get('message', err) if isinstance(err, dict) else err}"
        return _tool_result_text(fields.get("result"))
    if "tools" in fields and isinstance(fields["tools"], list):
        return tools_text(fields["tools"])
    strs = {k: v for k, v in fields.items() if isinstance(v, str)}
    if len(strs) == 1:
        return next(iter(strs.values()))
    for k in OBS_FIELDS:
        if isinstance(fields.get(k), str):
            return fields[k]
    return json.dumps(fields, sort_keys=True, default=str)


def _tool_result_text(result: Any) -> str:
    """A tool's result as text: MCP content blocks' text joined, `data`/structured content, else JSON."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        if result.get("data") is not None and not isinstance(result["data"], (dict, list)):
            return str(result["data"])
        blocks = result.get("content")
        if isinstance(blocks, list):
            texts = [b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
            if texts:
                return "\n".join(texts)
        for k in ("structured_content", "structuredContent"):
            if result.get(k):
                sc = result[k]
                return str(sc.get("result", sc)) if isinstance(sc, dict) else str(sc)
    return json.dumps(result, default=str)


def tools_text(tools: list) -> str:
    lines = []
    for t in tools:
        t = t if isinstance(t, dict) else t.model_dump()
        params = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in t.get("input_schema", {}).get("properties", {}).items())
        lines.append(f"- {t['name']}({params}): {t.get('description', '').strip()}")
    return ("Tools (call one as <tool_call>{\"name\": \"<tool>\", \"arguments\": {...}}</tool_call>):\n"
            + "\n".join(lines))


def model_class(env_cls: Any, base: type, hint: str) -> type | None:
    """The `base` subclass (Action, Observation) an environment's step names: its annotation `hint`
    ("action", "return"), else the first such type argument of its Environment[Act, Obs, State] base."""
    cls = env_cls if isinstance(env_cls, type) else type(env_cls)
    try:
        found = typing.get_type_hints(cls.step).get(hint)
    except Exception:
        found = None
    if isinstance(found, type) and issubclass(found, base) and found is not base:
        return found
    for b in getattr(cls, "__orig_bases__", ()):
        for arg in typing.get_args(b):
            if isinstance(arg, type) and issubclass(arg, base):
                return arg
    return None


def is_mcp(env_cls: Any) -> bool:
    from openenv.core.env_server import MCPEnvironment
    return MCPEnvironment is not None and isinstance(env_cls, type) and issubclass(env_cls, MCPEnvironment)


def _action_class(env_cls: Any) -> Any:
    """The Action class an in-process environment's step takes (an MCP environment's: CallToolAction)."""
    from openenv.core.env_server import Action, CallToolAction

    if is_mcp(env_cls):
        return CallToolAction
    found = model_class(env_cls, Action, "action")
    if found is None:
        name = getattr(env_cls, "__name__", type(env_cls).__name__)
        raise TaskError(f"task.openenv.env: cannot tell the Action class of {name}: annotate its step "
                        "(def step(self, action: MyAction)) or subclass Environment[MyAction, MyObservation, State]")
    return found


def _environment_class(path: str) -> Any:
    try:
        obj = _resolve(path)
    except TaskError as e:
        raise TaskError(f"task.openenv.env={path!r}: {e}") from None
    from openenv.core.env_server import Environment
    if isinstance(obj, type) and not issubclass(obj, Environment):
        raise TaskError(f"task.openenv.env={path!r} is {obj.__name__}, not an openenv Environment subclass")
    if not callable(obj):
        raise TaskError(f"task.openenv.env={path!r} is not a class or factory of an openenv Environment")
    return obj


# ---------------------------------------------------------------------- the task


class OpenEnvTask:
    """The task: prompts, the episodes' environments; see the module docstring."""

    def __init__(self, tc: TaskConfig):
        self.tc, self.oc = tc, tc.openenv
        oc = self.oc
        if not oc.env and not oc.url:
            raise TaskError("task.name=pipeline.tasks.openenv needs task.openenv.env (an Environment class) or "
                            "task.openenv.url (a served one)")
        self.served = bool(oc.url)
        # the class itself wherever it is importable (in-process, and serve=local): the prompt stream makes
        # its prompts from a local instance, with no network call in the buffer's event loop
        self.factory = _environment_class(oc.env) if oc.env else None
        self.action_cls = _action_class(self.factory) if self.factory is not None else None
        schema = (self.action_cls.model_json_schema() if self.action_cls is not None else self._schema()["action"])
        self.tools = _is_tool_schema(schema)
        self.name = oc.env or oc.url
        if oc.action and "." in oc.action:
            adapter = _resolve(oc.action)
            self.to_action = lambda text: adapter(text, schema)
        elif self.tools and not oc.action:
            self.to_action = parse_tool_call
        else:
            field = oc.action or _text_field(schema, self.name)
            if field not in schema.get("properties", {}):
                raise TaskError(f"task.openenv.action={field!r}: the action has no such field (fields: "
                                f"{', '.join(schema.get('properties', {}))})")
            self.to_action = lambda text: {field: text}
        if oc.observation and "." in oc.observation:
            self.render = _resolve(oc.observation)
        elif oc.observation:
            key = oc.observation
            self.render = lambda obs: obs[key] if isinstance(obs.get(key), str) else json.dumps(obs.get(key), default=str)
        else:
            self.render = render_observation
        self.demo = _resolve(oc.demonstration) if oc.demonstration else None
        if not self.demo:  # the warm start finds no demonstration() (load_task reads the attribute)
            self.demonstration = None
        self._tools_text: str | None = None
        self._lock = threading.Lock()

    def _schema(self) -> dict:
        import urllib.request
        url = self.oc.url.rstrip("/") + "/schema"
        deadline = time.monotonic() + self.oc.connect_timeout_s
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    schema = json.loads(r.read())
                break
            except Exception as e:
                if time.monotonic() >= deadline:
                    raise TaskError(f"task.openenv.url={self.oc.url!r}: {url} did not answer within "
                                    f"task.openenv.connect_timeout_s={self.oc.connect_timeout_s:g}s: {first_line(e)}") from None
                time.sleep(0.3)
        if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
            raise TaskError(f"task.openenv.url={self.oc.url!r}: {url} is not an OpenEnv server's schema")
        return schema

    def session(self, local: bool = False) -> InProcess | Served:
        if self.served and not (local and self.factory is not None):
            return Served(self.oc.url, self.oc.connect_timeout_s, self.tc.env_timeout_s)
        return InProcess(self.factory, self.action_cls)

    # the task contract

    def prompts(self, seed: int, split: str) -> Iterator[PromptItem]:
        n = self.oc.episodes if split == "train" else 0
        for i in (range(n) if n else itertools.count()):
            s = seed_of(seed, split, i)
            first = self.first_observation(s)
            yield PromptItem(uid=i, prompt=self.prompt_of(first),
                             columns=(("seed", str(s)), ("split", split), ("observation", first)))

    def first_observation(self, seed: int) -> str:
        """The reset observation's text for `seed` (a session opened and closed for it). A served one that
        fails to answer (a server restarting) is asked again for task.openenv.connect_timeout_s."""
        deadline = time.monotonic() + self.oc.connect_timeout_s
        while True:
            try:
                return self._first_observation(seed)
            except RewardRejected as e:
                if not self.served or e.reason not in ("env_unreachable", "env_timeout") or time.monotonic() >= deadline:
                    raise TaskError(f"task.openenv: the first observation of episode seed {seed}: {e}") from None
                time.sleep(0.5)

    def _first_observation(self, seed: int) -> str:
        sess = self.session(local=True)
        try:
            obs, _, _ = checked(sess.reset(seed), "reset")
            if self.tools and self._tools_text is None:
                listed = sess.step({"type": "list_tools"})
                with self._lock:
                    self._tools_text = render_observation(checked(listed, "list_tools")[0]) if isinstance(listed, dict) else ""
            return self.render(obs)
        finally:
            sess.close()

    def prompt_of(self, text: str) -> Any:
        system = "\n\n".join(s for s in (self.oc.system, self._tools_text or "") if s)
        if not self.oc.chat:
            return f"{system}\n{text}" if system else text
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]

    def reward(self, prompt: Any, completion: str) -> float:
        raise TaskError("pipeline.tasks.openenv: an episode's reward comes from its environment (Episode.reward), "
                        "not from the completion's text")

    def demonstration(self, item: PromptItem) -> list[str]:
        """The warm start's ideal episode (task.openenv.demonstration: `demo(first_observation, seed)`)."""
        if self.demo is None:
            raise TaskError("pipeline.tasks.openenv has no demonstrations without task.openenv.demonstration")
        fields = dict(item.columns)
        return self.demo(fields["observation"], int(fields["seed"]))

    def env(self, item: PromptItem) -> "Episode":
        return Episode(self, item)


class Episode:
    """One rollout's environment (pipeline/generator/envs.py's Env, with reward() and close())."""

    def __init__(self, task: OpenEnvTask, item: PromptItem):
        self.task, self.item = task, item
        fields = dict(item.columns)
        if "seed" not in fields:
            raise ValueError(f"item {item.uid} has no episode seed (not from pipeline.tasks.openenv's prompts)")
        self.turn_rewards: list[float | None] = []
        self.done = False
        self.sess = task.session()
        try:
            obs, _, self.done = checked(self.sess.reset(int(fields["seed"])), "reset")
            first = task.render(obs)
            if first != fields.get("observation"):
                raise RewardRejected("env_bad_observation", f"reset(seed={fields['seed']}) gave {first[:80]!r}, not the "
                                     "observation the group's prompt was made from: the environment must be "
                                     "deterministic in its seed")
        except BaseException:
            self.close()
            raise

    def step(self, turn: str) -> str | None:
        if self.done:
            return None
        payload = self.task.to_action(turn)
        if payload is None:
            self.turn_rewards.append(0.0)
            return ("error: no tool call found; call a tool as <tool_call>{\"name\": \"<tool>\", \"arguments\": "
                    "{...}}</tool_call>")
        out = self.sess.step(payload)
        if isinstance(out, str):  # the action did not validate: shown to the model, reward 0
            self.turn_rewards.append(0.0)
            return out
        obs, reward, self.done = checked(out, "step")
        self.turn_rewards.append(reward)
        return None if self.done else self.task.render(obs)

    def reward(self) -> float:
        got = [r for r in self.turn_rewards if r is not None]
        if not got:
            raise RewardRejected("reward_not_a_number", f"the environment gave no reward in {len(self.turn_rewards)} "
                                 "steps (every observation's reward was None)")
        return got[-1] if self.task.oc.reward == "last" else float(sum(got))

    def close(self) -> None:
        sess, self.sess = getattr(self, "sess", None), None
        if sess is not None:
            try:
                sess.close()
            except Exception:
                pass


def from_config(cfg: TaskConfig) -> OpenEnvTask:
    try:
        import openenv  # noqa: F401
    except ImportError:
        raise TaskError("pipeline.tasks.openenv needs the openenv package: make setup installs it "
                        "(or pip install --no-deps openenv==0.10.0 and its requirements, docs/openenv.md)") from None
    return OpenEnvTask(cfg)
