"""Faults through HTTP, against one TP-2 server: the seed's negative control (lost tail flags end
in a clear error, not a hang, and the ranks re-arm and serve on without a restart), a rank actor
killed under load (its stream answers 503 within a second), and POST /restart (the weights of the
last group update come back, checked by tokens)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from service.client import Client, ServiceError
from service.config import PRESETS
from service.weights import checkpoint_tensors, save_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
TAIL_DEADLINE_S = 5


# Both engine orders: in order (the CPU default) and async output (the CUDA default), where a failed
# step surfaces when the next step collects it.
@pytest.fixture(scope="module", params=["off", "on"], ids=["in_order", "async_output"])
def server(server_factory, request):
    return server_factory("--enable-sleep-mode", "--sleep-preserve-parameter-names", "*", "--enable-test-hooks",
                          "--tail-deadline-s", str(TAIL_DEADLINE_S), "--weight-snapshot", "host",
                          "--async-output", request.param)


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


def test_lost_tail_flags_fail_one_request_then_the_ranks_rearm_and_serve_on(admin):
    """The seed's negative control, recovered in place: the request whose step meets the zeroed
    flags fails with the TailTimeout message; the request queued behind it, and every later one,
    gets the tokens of before, with no /restart and /health ok throughout."""
    reference = generate(admin)[0]
    zeroed = admin.collective_rpc("zero_tail_flags")  # mid-run, every rank
    assert len(zeroed) == 2
    behind: dict = {}

    def queued():
        time.sleep(1.0)  # arrives while the first request's step waits out the tail deadline
        t = time.monotonic()
        behind["tokens"], behind["seconds"] = generate(admin)[0], time.monotonic() - t

    t = threading.Thread(target=queued, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as e:
        admin.completions(PROMPTS[:1], max_tokens=8, temperature=0.0, ignore_eos=True)
    seconds = time.monotonic() - t0
    print(f"lost flags: HTTP {e.value.status} after {seconds:.1f}s: {e.value.message}")
    assert e.value.status == 500 and "TailTimeout" in e.value.message and "re-armed" in e.value.message
    error = e.value.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "engine_error"
    assert seconds < 3 * TAIL_DEADLINE_S + 30
    t.join(120)
    assert behind.get("tokens") == reference, behind  # queued behind the failure, served after it
    assert admin.health()["status"] == "ok"
    assert generate(admin)[0] == reference
    status = admin.status()
    assert status["state"] == "running" and status["failed"] is None
    assert [r["recoveries"] for r in status["ranks"]] == [1, 1]
    assert "TailTimeout" in status["ranks"][0]["last_failure"]
    assert len({repr(r["tail_epochs"]) for r in status["ranks"]}) == 1

    # verify-sleep's control: the flags lost across a level-2 sleep; recovered the same way.
    admin.sleep(2)
    admin.wake_up(["weights"])
    admin.collective_rpc("zero_tail_flags")
    admin.wake_up(["kv_cache"])  # the ranks agree on (zeroed) epochs: the wake is confirmed
    with pytest.raises(ServiceError) as e:
        generate(admin)
    assert e.value.status == 500 and "TailTimeout" in e.value.message
    assert generate(admin)[0] == reference
    assert admin.health()["status"] == "ok"


def test_rank_death_fails_requests_fast_and_restart_restores_the_last_weights(admin, tmp_path):
    """The trainer's policy survives a restart: a checkpoint (path) and then a group broadcast on
    top of it; after the rank death and /restart, the same tokens and version as before."""
    cfg = dataclasses.replace(PRESETS["tiny"], torch_dtype="float32")
    trained = str(tmp_path / "trained")
    named = dict(checkpoint_tensors(cfg, seed=0))
    save_checkpoint(cfg, trained, {n: (-t if n == "lm_head.weight" else t) for n, t in named.items()})
    from_path = admin.update_weights(trained)
    assert from_path["restart"]["restart_restores"] == "path"
    path_tokens = generate(admin)
    policy = {"lm_head.weight": torch.roll(named["lm_head.weight"], shifts=3, dims=0) * 2.0,
              "model.norm.weight": named["model.norm.weight"] * 0.5}
    r = admin.update_weights_from_group(policy)
    version = r["weight_version"]
    assert r["restart"]["restart_restores"] == "snapshot" and r["restart"]["bytes"] > 0
    expected = generate(admin)
    assert expected[1] == version == from_path["weight_version"] + 1 and expected[0] != path_tokens[0]
    restores = admin.status()["restart_restores"]
    assert restores["source"] == "snapshot" and restores["weight_version"] == version
    assert restores["path"] == trained and restores["snapshot"]["bytes"] > 0 and restores["lost"] is None

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
    failed_after = box["failed_at"] - killed
    health, _ = wait_health(admin, "unhealthy")
    print(f"rank 1 killed: the stream failed after {failed_after:.2f}s, /health unhealthy "
          f"after {time.monotonic() - killed:.2f}s at most")
    # The controller holds a call open on every rank (Controller._watch_deaths): the death fails
    # it at once, no waiting for the next health ping.
    assert failed_after < 1.0, f"the stream's 503 came {failed_after:.2f}s after the kill"
    assert "died" in health["reason"] and "died" in box["error"].message
    with pytest.raises(ServiceError) as e:
        generate(admin)
    assert e.value.status == 503 and e.value.body["error"]["code"] == "model_state"
    report = admin.restart()
    assert report["weights_reloaded_from"] == trained and report["weight_version"] == version
    assert report["restored"]["from"] == "path + snapshot" and report["note"] is None
    wait_health(admin, "ok")
    assert generate(admin) == expected  # the trained policy, the same version
    assert all(r["weight_version"] == version for r in admin.status()["ranks"])
