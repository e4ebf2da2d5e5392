"""Start `latentserve serve` in a subprocess on a free loopback port (verify-sleep, bench, tests)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from ..net import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerExited(RuntimeError):
    """The server process ended before it became healthy."""


class ServerProcess:
    """An HTTP server in a subprocess of its own session (a hung one is killed together with the
    processes it started) on a free loopback port: its log, the wait for /health, the stop."""

    name = "the server"

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _spawn(self, cmd: list[str], cwd: str, env: dict, log_path: str) -> None:
        self.cmd, self.log_path = cmd, log_path
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.started = time.monotonic()

    def log(self, tail: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:]

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Seconds until /health answered 200; raises with the log's tail if it died or never did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerExited(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy within {timeout:g}s:\n{self.log()}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of its session is left (Ray workers that outlived it)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


class LocalServer(ServerProcess):
    """`latentserve serve ARGS` with a generated admin key; `stop()` ends it and its Ray children."""

    def __init__(self, serve_args: list[str], admin_key: str | None = "generated", env: dict | None = None,
                 log_path: str | None = None):
        super().__init__()
        self.admin_key = secrets.token_hex(12) if admin_key == "generated" else admin_key
        cmd = [sys.executable, "-m", "service.cli", "serve", *serve_args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        if self.admin_key:
            cmd += ["--admin-key", self.admin_key]
        full_env = {k: v for k, v in os.environ.items() if k != "LATENTSERVE_ADMIN_KEY"}
        full_env.update(env or {})
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="latentserve-", suffix=".log")
            os.close(fd)
        self._spawn(cmd, REPO, full_env, log_path)


def start_healthy(serve_args: list[str], timeout: float = 600.0, **kw) -> tuple[LocalServer, float]:
    """A healthy LocalServer and its startup seconds. One retry when the process dies during
    startup: a local Ray cluster can fail to come up while others start on the same machine."""
    for attempt in (1, 2):
        server = LocalServer(serve_args, **kw)
        try:
            return server, server.wait_ready(timeout)
        except ServerExited as e:
            server.stop()
            if attempt == 2:
                raise
            print(f"latentserve serve failed to start, retrying once: {str(e)[-2000:]}", file=sys.stderr)
    raise AssertionError("unreachable")
