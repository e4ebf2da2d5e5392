"""Faults through HTTP, against one TP-2 server: the seed's negative control (lost tail flags end
in a clear error, not a hang), a rank actor killed under load, and POST /restart."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from service.client import Client, ServiceError
from service.config import PRESETS
from service.weights import checkpoint_tensors, save_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
TAIL_DEADLINE_S = 5


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--enable-sleep-mode", "--sleep-preserve-parameter-names", "*", "--enable-test-hooks",
                          "--tail-deadline-s", str(TAIL_DEADLINE_S))


@pytest.fixture(scope="module")
def admin(server):
    # The client timeout bounds every call: a hung request fails the test instead of hanging it.
    with Client(server.url, server.admin_key, timeout=120) as c:
        yield c


def generate(c: Client, max_tokens: int = 8) -> tuple[list[list[int]], int]:
    r = c.completions(PROMPTS, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [ch["token_ids"] for ch in r["choices"]], r["weight_version"]


def wait_health(c: Client, status: str, timeout: float = 60.0) -> tuple[dict, float]:
    t0 = time.monotonic()
    while (h := c.health())["status"] != status:
        assert time.monotonic() - t0 < timeout, f"/health still {h} after {timeout}s"
        time.sleep(0.1)
    return h, time.monotonic() - t0


def test_negative_control_lost_tail_flags_error_instead_of_hanging(admin):
    reference = generate(admin)[0]
    admin.sleep(2)
    admin.wake_up(["weights"])
    zeroed = admin.collective_rpc("zero_tail_flags")
    assert len(zeroed) == 2
    admin.wake_up(["kv_cache"])  # the ranks agree on (zeroed) epochs: the wake is confirmed
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as e:
        generate(admin)
    print(f"negative control: HTTP {e.value.status} after {time.monotonic() - t0:.1f}s: {e.value.message}")
    assert e.value.status in (500, 503) and "TailTimeout" in e.value.message
    health, _ = wait_health(admin, "unhealthy")
    assert "TailTimeout" in health["reason"]
    with pytest.raises(ServiceError) as e:
        generate(admin)
    assert e.value.status == 503 and "restart" in e.value.message
    report = admin.restart()
    assert report["state"] == "running" and report["weights_reloaded_from"] is None
    wait_health(admin, "ok")
    assert generate(admin)[0] == reference


def test_rank_death_fails_requests_fast_and_restart_restores_the_last_weights(admin, tmp_path):
    cfg = dataclasses.replace(PRESETS["tiny"], torch_dtype="float32")
    trained = str(tmp_path / "trained")
    save_checkpoint(cfg, trained, {n: (-t if n == "lm_head.weight" else t)
                                   for n, t in checkpoint_tensors(cfg, seed=0)})
    version = admin.update_weights(trained)["weight_version"]
    expected = generate(admin)
    assert expected[1] == version

    box: dict = {}

    def stream():
        try:
            for _ in admin.stream_completions([[20, 21, 22]], max_tokens=1500, temperature=0.0, ignore_eos=True):
                box.setdefault("first", time.monotonic())
        except ServiceError as e:
            box["error"], box["failed_at"] = e, time.monotonic()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    while "first" not in box:
        assert t.is_alive(), box
        time.sleep(0.05)
    victim = admin.collective_rpc("ping", ranks=[1])[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    t.join(60)
    assert not t.is_alive() and box["error"].status == 503, box
    health, _ = wait_health(admin, "unhealthy")
    print(f"rank 1 killed: the stream failed after {box['failed_at'] - killed:.2f}s, /health unhealthy "
          f"after {time.monotonic() - killed:.2f}s at most")
    assert "died" in health["reason"]
    with pytest.raises(ServiceError) as e:
        generate(admin)
    assert e.value.status == 503
    report = admin.restart()
    assert report["weights_reloaded_from"] == trained and report["weight_version"] == version
    wait_health(admin, "ok")
    assert generate(admin) == expected  # the trained weights, the same version
    assert all(r["weight_version"] == version for r in admin.status()["ranks"])
