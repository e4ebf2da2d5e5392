"""Shared fixtures: `latentserve serve` subprocesses on free loopback ports."""

from __future__ import annotations

import pytest

from service.server.launch import LocalServer, start_healthy


def start_server(*extra: str, tp: int = 2, admin_key: str | None = "generated", timeout: float = 600.0,
                 env: dict | None = None) -> LocalServer:
    """`latentserve serve --model tiny --tp TP EXTRA...`, healthy."""
    return start_healthy(["--model", "tiny", "--tp", str(tp), *extra], timeout, admin_key=admin_key, env=env)[0]


@pytest.fixture
def one_thread():
    """Tiny matmuls in the test process: extra threads only contend with other jobs on a 2-core box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def server_factory():
    """Start servers for one test module; all are stopped at its end."""
    started: list[LocalServer] = []

    def make(*extra: str, **kw) -> LocalServer:
        s = start_server(*extra, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
