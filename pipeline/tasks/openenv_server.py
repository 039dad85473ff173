"""Serve an OpenEnv environment class over HTTP/WebSocket (openenv's create_app under uvicorn), as
`task.openenv.serve=local` does for a run (`LocalServer` below), or by hand:

    python -m pipeline.tasks.openenv_server examples.envs.keyvault.KeyVaultEnvironment --port 8011

It binds 127.0.0.1 only; `--max-concurrent` sessions at once (each a fresh environment).
"""

from __future__ import annotations

import argparse
import time
import typing
from typing import Callable

from pipeline.config import TaskConfig
from pipeline.tasks import TaskError


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
    For tests and tools; a run's own server is LocalServer's."""
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


class LocalServer:
    """task.openenv.serve=local: the run's own server of task.openenv.env (pipeline/tasks/openenv_server.py)
    on a free loopback port, in a process of its own (its output in out_dir/openenv_server.log).
    `start` sets task.openenv.url; `watch` restarts a dead server on the same port (the episodes it
    held fail alone, new ones wait for it within task.openenv.connect_timeout_s), at most
    task.openenv.max_restarts times; `stop` ends it on every exit path of the run.

        srv = LocalServer(cfg.task, out_dir); srv.start()   # cfg.task.openenv.url = "http://127.0.0.1:PORT"
        await srv.watch(on_fatal)                           # a task of the driver's loop
        srv.stop()
    """

    def __init__(self, tc: TaskConfig, out_dir: str, sessions: int, on_spawn: Callable[[int, int], None] = lambda pid, port: None):
        import os
        self.tc, self.out_dir, self.sessions, self.on_spawn = tc, out_dir, sessions, on_spawn
        self.proc = None
        self.port = 0
        self.restarts = 0
        self.stopping = False
        self.log_path = os.path.join(out_dir, "openenv_server.log")

    def start(self) -> str:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._spawn()
        self.tc.openenv.url = url = f"http://127.0.0.1:{self.port}"
        return url

    def _spawn(self) -> None:
        import os
        import subprocess
        import sys
        import urllib.request

        os.makedirs(self.out_dir, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.tasks.openenv_server", self.tc.openenv.env,
                                      "--port", str(self.port), "--max-concurrent", str(self.sessions),
                                      "--parent-pid", str(os.getpid())],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                tail = open(self.log_path, errors="replace").read()[-1500:]
                raise TaskError(f"task.openenv.serve=local: the server of {self.tc.openenv.env} exited with "
                                f"{self.proc.returncode} before serving ({self.log_path}):\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    self.on_spawn(self.proc.pid, self.port)
                    return
            except Exception:
                if time.monotonic() >= deadline:
                    self.stop()
                    raise TaskError(f"task.openenv.serve=local: the server of {self.tc.openenv.env} did not answer "
                                    f"/health within 60s ({self.log_path})") from None
                time.sleep(0.2)

    async def watch(self, on_fatal: Callable[[str], None]) -> None:
        """Restart the server when it dies, until `stop` (a task of the driver's event loop)."""
        import asyncio
        import logging
        log = logging.getLogger(__name__)
        while not self.stopping:
            await asyncio.sleep(0.5)
            if self.stopping or self.proc is None or self.proc.poll() is None:
                continue
            code = self.proc.returncode
            if self.restarts >= self.tc.openenv.max_restarts:
                on_fatal(f"the OpenEnv server of {self.tc.openenv.env} died (exit {code}) after "
                         f"task.openenv.max_restarts={self.tc.openenv.max_restarts} restarts ({self.log_path})")
                return
            self.restarts += 1
            log.warning("the OpenEnv server of %s died (exit %s): restart %d of %d on port %d; its episodes in "
                        "flight fail alone", self.tc.openenv.env, code, self.restarts, self.tc.openenv.max_restarts, self.port)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._spawn)
            except TaskError as e:
                on_fatal(str(e))
                return

    def stop(self) -> None:
        self.stopping = True
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(5)
        except Exception:
            p.kill()
            p.wait(5)


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
