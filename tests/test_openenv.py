"""OpenEnv environments as a task (pipeline/tasks/openenv.py): the package's own classes, run in-process
and served by a real uvicorn server process over WebSocket sessions; rewards and `done` from its rubric
classes; a killed, a stalled and a malformed server failing one episode alone; and a CLI run that serves
the environment itself, survives its server's SIGKILL and SIGSTOP, and evaluates held-out episodes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.tasks import RewardRejected, TaskError, load_task
from pipeline.tasks.openenv import parse_tool_call, render_observation, seed_of

REPO = Path(__file__).resolve().parents[1]
KEYVAULT = "examples.envs.keyvault.KeyVaultEnvironment"
CALC = "examples.envs.calc_tools.CalcToolsEnvironment"

sys.path.insert(0, str(REPO))  # the examples package, as `python -m` from the repository root has it
from examples.envs.keyvault import code_of  # noqa: E402


def task_of(*overrides: str):
    cfg = load_config(REPO / "configs/tiny.yaml", ["task.name=pipeline.tasks.openenv", *overrides])
    return load_task(cfg.task.name, cfg.task)


def serve(env: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """A real server process of `env` (pipeline/tasks/openenv_server.py), its output in tmp_path."""
    from pipeline.tasks.openenv_server import spawn
    return spawn(env, open(tmp_path / "server.log", "a"))


@pytest.fixture
def servers(tmp_path):
    started: list[subprocess.Popen] = []

    def start(env: str) -> tuple[subprocess.Popen, str]:
        p, url = serve(env, tmp_path)
        started.append(p)
        return p, url
    yield start
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)


def play_keyvault(task, item, answer: str | None = None) -> tuple[list, float]:
    """Look the code up, then answer (the right code unless `answer`); the observations and the reward."""
    ep = task.env(item)
    try:
        seen = [ep.step("?")]
        code = seen[0][1:-1]
        seen.append(ep.step(code if answer is None else answer))
        return seen, ep.reward()
    finally:
        ep.close()


def test_keyvault_in_process_and_served_give_the_same_episodes_and_rubric_rewards(servers):
    """The same seeds give the same prompts and episodes in-process and over a WebSocket session; the
    rubric (WeightedSum of ExactCode 0.7 and DigitShare 0.3) scores the answer turn, the lookup 0; train
    and held-out seeds are disjoint."""
    local = task_of(f"task.openenv.env={KEYVAULT}", "task.openenv.chat=false")
    _, url = servers(KEYVAULT)
    remote = task_of(f"task.openenv.url={url}", "task.openenv.chat=false")
    items = [it for it, _ in zip(local.prompts(5, "train"), range(3))]
    assert [it.prompt for it in items] == [it.prompt for it, _ in zip(remote.prompts(5, "train"), range(3))]
    assert all(re.fullmatch(r"key [a-z]{3}=", it.prompt) for it in items)
    held = [int(dict(it.columns)["seed"]) for it, _ in zip(local.prompts(5, "eval"), range(50))]
    train = [int(dict(it.columns)["seed"]) for it, _ in zip(local.prompts(5, "train"), range(50))]
    assert not set(held) & set(train) and held[0] == seed_of(5, "eval", 0)
    for task in (local, remote):
        key = items[0].prompt[4:-1]
        seen, r = play_keyvault(task, items[0])
        assert seen == [f":{code_of(key)};", None] and r == pytest.approx(1.0)
        wrong = code_of(key)[:2] + str((int(code_of(key)[2]) + 1) % 10)  # two digits of three right
        _, r = play_keyvault(task, items[0], wrong)
        assert r == pytest.approx(0.3 * 2 / 3)
        ep = task.env(items[0])
        assert ep.step("?") == f":{code_of(key)};" and ep.turn_rewards == [0.0]
        ep.close()


def test_a_websocket_session_keeps_its_state_across_turns_and_sessions_do_not_share_it(servers):
    _, url = servers(KEYVAULT)
    task = task_of(f"task.openenv.url={url}", "task.openenv.chat=false")
    a, b = [it for it, _ in zip(task.prompts(0, "train"), range(2))]
    ea, eb = task.env(a), task.env(b)
    try:
        # each session answers about its own reset's key, three turns in a row
        assert ea.step("?") == f":{code_of(a.prompt[4:-1])};" and eb.step("?") == f":{code_of(b.prompt[4:-1])};"
        assert ea.step("?zzz") == f":{code_of('zzz')};"
        assert ea.step(code_of(a.prompt[4:-1])) is None and ea.done and ea.reward() == pytest.approx(1.0)
        assert eb.step("000") is None and eb.reward() < 0.5
    finally:
        ea.close()
        eb.close()


def test_mcp_tools_in_process_and_served_from_tool_calls(servers):
    """An MCPEnvironment: the tools are listed in the system message; `<tool_call>` JSON becomes a
    CallToolAction; a turn without a call gets an error observation and reward 0 without reaching the
    environment; submit ends the episode with the rubric's reward (Gate on the exact answer)."""
    _, url = servers(CALC)
    for task in (task_of(f"task.openenv.env={CALC}"), task_of(f"task.openenv.url={url}")):
        item = next(iter(task.prompts(0, "train")))
        system, user = item.prompt
        assert system["role"] == "system" and "- add(a: integer, b: integer): Add two integers." in system["content"]
        nums = [int(x) for x in re.findall(r"\d+", user["content"])]
        ep = task.env(item)
        try:
            assert ep.step('<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>' % tuple(nums[:2])) \
                == str(nums[0] + nums[1])
            assert ep.step("the answer is 7").startswith("error: no tool call found")
            assert ep.step('<tool_call>{"name": "nope", "arguments": {}}</tool_call>').startswith("error")
            assert ep.step('<tool_call>{"name": "submit", "arguments": {"answer": %d}}</tool_call>' % sum(nums)) is None
            assert ep.reward() == pytest.approx(1.0) and ep.turn_rewards[1] == 0.0
        finally:
            ep.close()
        ep = task.env(item)
        ep.step('<tool_call>{"name": "submit", "arguments": {"answer": %d}}</tool_call>' % (sum(nums) + 1))
        assert ep.reward() == pytest.approx(0.1)  # the Gate holds back the correctness part; format credit only
        ep.close()


def test_parse_tool_call_and_render_observation():
    assert parse_tool_call('x <tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call> <tool_call>{"name": "b"}'
                           '</tool_call>') == {"type": "call_tool", "tool_name": "b", "arguments": {}}
    assert parse_tool_call("<tool_call>{not json}</tool_call>") is None and parse_tool_call("plain") is None
    assert render_observation({"prompt": "hi", "reward": 1, "done": False, "metadata": {}}) == "hi"
    assert render_observation({"a": 1, "b": [2]}) == '{"a": 1, "b": [2]}'
    assert render_observation({"tool_name": "t", "result": {"content": [{"type": "text", "text": "42"}]}}) == "42"
    assert render_observation({"tool_name": "t", "result": None, "error": {"message": "boom"}}) == "error: boom"


def test_a_killed_or_stalled_server_fails_the_episode_alone_with_its_reason(servers):
    """SIGKILL of the server mid-episode: the next step fails as env_unreachable; a new episode on the
    dead URL too (after task.openenv.connect_timeout_s). SIGSTOP: a step fails as env_timeout after
    task.env_timeout_s, and the server serves new sessions again once continued."""
    p, url = servers(KEYVAULT)
    task = task_of(f"task.openenv.url={url}", "task.openenv.chat=false", "task.env_timeout_s=2",
                   "task.openenv.connect_timeout_s=2")
    item = next(iter(task.prompts(0, "train")))
    ep = task.env(item)
    os.kill(p.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(RewardRejected) as e:
        ep.step("?")
    assert e.value.reason == "env_timeout" and 1.5 < time.monotonic() - t0 < 15
    ep.close()
    os.kill(p.pid, signal.SIGCONT)
    ep = task.env(item)
    assert ep.step("?").startswith(":")
    p.kill()
    p.wait(10)
    with pytest.raises(RewardRejected) as e:
        ep.step("?")
    assert e.value.reason == "env_unreachable"
    ep.close()
    with pytest.raises(RewardRejected) as e:
        task.env(item)
    assert e.value.reason == "env_unreachable" and "connect_timeout_s=2" in str(e.value)


BAD_ENV = textwrap.dedent('''
    from typing import Any, Optional
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class Say(Action):
        message: str

    class Seen(Observation):
        prompt: str = ""

    class Flaky(Environment[Say, Seen, State]):
        """Deterministic prompts; `nan` makes the reward NaN, `drift` answers with another seed's text,
        `boom` raises."""
        SUPPORTS_CONCURRENT_SESSIONS = True
        calls = 0

        def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kw: Any) -> Seen:
            Flaky.calls += 1
            return Seen(prompt=f"seed {seed}" + (f" call {Flaky.calls}" if seed == 99 else ""))

        def step(self, action: Say, timeout_s: Optional[float] = None, **kw: Any) -> Seen:
            if action.message == "boom":
                raise RuntimeError("the tool crashed")
            return Seen(prompt="ok", done=True, reward=float("nan") if action.message == "nan" else 1.0)

        @property
        def state(self) -> State:
            return State()
''')


def test_bad_environments_fail_the_episode_with_a_counted_reason(tmp_path, monkeypatch):
    """A NaN reward is reward_nan, a step that raises is env_raised, and an environment whose reset is
    not deterministic in the seed is env_bad_observation (the group's prompt would be wrong)."""
    (tmp_path / "flaky_env.py").write_text(BAD_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = task_of("task.openenv.env=flaky_env.Flaky", "task.openenv.chat=false")
    item = next(iter(task.prompts(0, "train")))
    ep = task.env(item)
    with pytest.raises(RewardRejected) as e:
        ep.step("nan")
    assert e.value.reason == "reward_nan"
    ep.close()
    ep = task.env(item)
    with pytest.raises(RuntimeError, match="the tool crashed"):  # the episode loop counts it as env_raised
        ep.step("boom")
    ep.close()
    drifting = next(it for it in task.prompts(0, "train") if dict(it.columns)["seed"] == "99") if False else None
    from pipeline.types import PromptItem
    moved = PromptItem(uid=0, prompt="seed 99 call 1", columns=(("seed", "99"), ("observation", "seed 99 call 1")))
    with pytest.raises(RewardRejected) as e:
        task.env(moved)
    assert e.value.reason == "env_bad_observation" and "deterministic in its seed" in str(e.value)


def test_config_errors_name_the_key_and_exit_2(tmp_path):
    """Bad task.openenv values stop the CLI with exit 2 and one line naming the key, before any engine;
    the other refusals are the same errors, raised by the config and the task's loader."""
    from pipeline.config import ConfigError
    p = subprocess.run([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
                        "task.name=pipeline.tasks.openenv", f"task.openenv.env={KEYVAULT}", "task.openenv.action=nope",
                        f"run.out_dir={tmp_path}/r"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "task.openenv.action='nope': the action has no such field (fields: metadata, message)" \
        in p.stderr, p.stderr[-1500:]
    for override, needle in [("task.openenv.reward=max", "task.openenv.reward='max' is invalid"),
                             ("task.openenv.serve=local", "local needs task.openenv.env")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            task_of(override)
    with pytest.raises(TaskError, match="task.openenv.env='examples.envs.keyvault.NoSuchEnv'"):
        task_of("task.openenv.env=examples.envs.keyvault.NoSuchEnv")
    with pytest.raises(TaskError, match="needs task.openenv.env .* or task.openenv.url"):
        task_of()


def test_cli_run_serves_the_environment_survives_its_server_killed_and_stalled_and_evaluates(tmp_path):
    """task.openenv.serve=local on the tiny model: the run starts its own server, its pid in
    placement.json; SIGKILL of it mid-run, then SIGSTOP of its successor for 8 s. The run finishes every
    step, exit 0: the server was restarted, the episodes it held failed alone (counted, their groups
    given back), held-out episodes were evaluated at the start and the end, and no server is left."""
    out = tmp_path / "run"
    steps = 16
    log = open(tmp_path / "log", "w")
    p = subprocess.Popen([sys.executable, "-m", "pipeline.run", "--config", "configs/tiny.yaml",
                          "task.name=pipeline.tasks.openenv", f"task.openenv.env={KEYVAULT}", "task.openenv.serve=local",
                          "task.openenv.chat=false", "task.openenv.demonstration=examples.envs.keyvault.demonstration",
                          "run.warm_start_steps=10",
                          "task.max_turns=2", "task.max_total_tokens=24", f"run.steps={steps}", "run.eval_every=100",
                          "task.eval_prompts=16", "run.checkpoint_every=0", "run.progress=false", "task.env_timeout_s=4",
                          "task.max_reject_frac=0.5", f"run.out_dir={out}"],
                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        def rows() -> int:
            m = out / "metrics.jsonl"
            return sum('"step": ' in line for line in m.read_text().splitlines()) if m.exists() else 0

        deadline = time.monotonic() + 400
        while rows() < 4:
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.5)
        first = json.loads((out / "placement.json").read_text())["openenv_server"]
        os.kill(first["pid"], signal.SIGKILL)
        while (now := json.loads((out / "placement.json").read_text())["openenv_server"])["pid"] == first["pid"]:
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.3)
        assert now["port"] == first["port"] and now["restarts"] == 1
        os.kill(now["pid"], signal.SIGSTOP)
        time.sleep(8)
        os.kill(now["pid"], signal.SIGCONT)
        assert p.wait(timeout=400) == 0, (tmp_path / "log").read_text()[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
        log.close()
    text = (tmp_path / "log").read_text()
    assert "the OpenEnv server of examples.envs.keyvault.KeyVaultEnvironment died (exit -9): restart 1 of 3" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/reward" in m] == [0, steps]
    lost = sum(m.get(f"rejected/{r}", 0) for m in metrics for r in ("env_unreachable", "env_timeout", "env_raised"))
    assert lost >= 1  # the killed and the stalled server's episodes, each failed alone
    assert subprocess.run(["pgrep", "-f", f"openenv_server {KEYVAULT} --port {now['port']}"]).returncode == 1


def test_a_served_environment_ends_when_its_run_is_killed(tmp_path):
    """The run's own server (serve=local) is given the run's pid: when the run dies by SIGKILL, with no
    chance to stop it, the server exits by itself within seconds instead of outliving it."""
    code = textwrap.dedent(f'''
        import os, socket, subprocess, sys, time
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        p = subprocess.Popen([sys.executable, "-m", "pipeline.tasks.openenv_server", "{KEYVAULT}", "--port", str(port),
                              "--parent-pid", str(os.getpid())], start_new_session=True)
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close(); break
            except OSError:
                time.sleep(0.2)
        print(p.pid, flush=True)
        os.kill(os.getpid(), 9)
    ''')
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    server = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    gone = not Path(f"/proc/{server}").exists()
    if not gone:
        os.kill(server, signal.SIGKILL)
    assert gone, "the server outlived its run"
