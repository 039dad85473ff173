"""Serve an OpenEnv environment class over HTTP/WebSocket (openenv's create_app under uvicorn), as
`task.openenv.serve=local` does for a run (pipeline/tasks/openenv.py LocalServer), or by hand:

    python -m pipeline.tasks.openenv_server examples.envs.keyvault.KeyVaultEnvironment --port 8011

It binds 127.0.0.1 only; `--max-concurrent` sessions at once (each a fresh environment).
"""

from __future__ import annotations

import argparse
import typing


def observation_class(env_cls: typing.Any) -> typing.Any:
    """The Observation class of an environment (an MCP environment's: CallToolObservation), else Observation."""
    from openenv.core.env_server import CallToolObservation, Observation
    from pipeline.tasks.openenv import is_mcp, model_class

    if is_mcp(env_cls):
        return CallToolObservation
    return model_class(env_cls, Observation, "return") or Observation


def watch_parent(pid: int, period_s: float = 1.0) -> None:
    """A daemon thread that ends this server once process `pid` has exited (its parent is then init)."""
    import os
    import threading
    import time

    def run() -> None:
        while os.getppid() == pid:
            time.sleep(period_s)
        os._exit(0)
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def build_app(path: str, max_concurrent: int):
    from openenv.core.env_server import create_app
    from pipeline.tasks.openenv import _action_class, _environment_class

    env_cls = _environment_class(path)
    return create_app(env_cls, _action_class(env_cls), observation_class(env_cls), env_name=path.rsplit(".", 1)[-1],
                      max_concurrent_envs=max_concurrent)


def spawn(env: str, log: typing.Any = None, timeout_s: float = 60.0) -> tuple[typing.Any, str]:
    """This module's server of `env` as a process of its own on a free loopback port (the repository
    and the caller's PYTHONPATH on its path), once it accepts connections: (the process, its base URL).
    For tests and tools; a run's own server is pipeline/tasks/openenv.py's LocalServer."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join([repo, os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    p = subprocess.Popen([sys.executable, "-m", "pipeline.tasks.openenv_server", env, "--port", str(port)], cwd=repo,
                         stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
                         env={**os.environ, "PYTHONPATH": path})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p, f"http://127.0.0.1:{port}"
        except OSError:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                raise RuntimeError(f"the server of {env} did not accept connections within {timeout_s:g}s "
                                   f"(exit code {p.poll()})") from None
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("env", help="dotted path of an openenv Environment subclass")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-concurrent", type=int, default=64)
    p.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process (the run) is gone, however it ended (a kill -9 included)")
    a = p.parse_args(argv)
    import uvicorn

    if a.parent_pid:
        watch_parent(a.parent_pid)

    uvicorn.run(build_app(a.env, a.max_concurrent), host="127.0.0.1", port=a.port, log_level="warning",
                ws_max_size=64 * 1024 * 1024)


if __name__ == "__main__":
    main()
