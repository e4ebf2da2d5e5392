"""RLHF weight transports through HTTP: process-group broadcast and Ray object refs, against a path.

The same 'trained' weights (lm_head scaled and rolled) sent three ways must give the same tokens,
different from the original ones; a mismatched update is rejected with nothing changed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from service.client import Client, ServiceError
from service.config import PRESETS
from service.weights import checkpoint_tensors, save_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _trained() -> dict[str, torch.Tensor]:
    named = dict(checkpoint_tensors(PRESETS["tiny"], seed=0))
    named["lm_head.weight"] = torch.roll(named["lm_head.weight"], shifts=7, dims=0) * 1.5
    return named


def _tokens(admin: Client) -> tuple[list[list[int]], int]:
    r = admin.completions(PROMPTS, max_tokens=8, temperature=0, ignore_eos=True)
    return [c["token_ids"] for c in sorted(r["choices"], key=lambda c: c["index"])], r["weight_version"]


@pytest.fixture(scope="module")
def admin(server_factory):
    server = server_factory("--enable-sleep-mode")
    with Client(server.url, server.admin_key, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def reference(admin, tmp_path_factory):
    """Tokens of the original weights and of the trained ones loaded from a checkpoint path."""
    original, v0 = _tokens(admin)
    path = str(tmp_path_factory.mktemp("trained"))
    save_checkpoint(PRESETS["tiny"], path, _trained().items())
    admin.update_weights(path=path)
    trained, v1 = _tokens(admin)
    assert trained != original and v1 == v0 + 1
    return original, trained


def _reset(admin: Client) -> None:
    """Back to the original weights through a group broadcast of a subset (lm_head only)."""
    orig = dict(checkpoint_tensors(PRESETS["tiny"], seed=0))
    admin.update_weights_from_group({"lm_head.weight": orig["lm_head.weight"]})


def test_group_broadcast_in_buckets_after_level2(admin, reference):
    original, trained = reference
    _reset(admin)
    assert _tokens(admin)[0] == original
    admin.sleep(level=2)
    admin.wake_up(["weights"])
    # small buckets: many broadcasts, each carrying several tensors
    r = admin.update_weights_from_group(_trained(), bucket_bytes=256 << 10)
    assert r["trainer"]["bytes"] > 0 and all(o["ok"] for o in r["ranks"])
    admin.wake_up(["kv_cache"])
    toks, version = _tokens(admin)
    assert toks == trained and version == r["weight_version"]
    # Without --weight-snapshot a restart could not bring this update back, and the service says so.
    assert r["restart"]["restart_restores"] == "base" and "group update" in r["restart"]["lost"]
    restores = admin.status()["restart_restores"]
    assert restores["mode"] == "off" and restores["source"] == "path" and "--weight-snapshot" in restores["lost"]


TRAINER = """
import sys, ray, torch
from service.client import Client
from service.config import PRESETS
from service.weights import checkpoint_tensors

url, key, address = sys.argv[1:4]
ray.init(address=address, namespace="rlhf-test")

@ray.remote(num_cpus=0)
class Trainer:
    def push(self):
        named = dict(checkpoint_tensors(PRESETS["tiny"], seed=0))
        named["lm_head.weight"] = torch.roll(named["lm_head.weight"], shifts=7, dims=0) * 1.5
        with Client(url, key, timeout=300) as c:
            return c.update_weights_from_refs(named)["weight_version"]

print("VERSION", ray.get(Trainer.remote().push.remote(), timeout=300))
"""


def test_ray_object_refs_from_a_trainer_actor(admin, reference):
    original, trained = reference
    _reset(admin)
    assert _tokens(admin)[0] == original
    address = admin.status()["ray"]["address"]
    # The embedded cluster enables Ray's token auth: a driver joining it must use the token too
    # (read when ray is imported, hence a separate process, as a trainer would be).
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    p = subprocess.run([sys.executable, "-c", TRAINER, admin.base_url, admin.admin_key, address],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    version = int(p.stdout.split("VERSION")[-1])
    toks, served_version = _tokens(admin)
    assert toks == trained and served_version == version


def test_mismatch_is_rejected_before_any_change(admin, reference):
    before, v = _tokens(admin)
    bad = {"lm_head.weight": torch.zeros(3, 3), "model.norm.weight": torch.ones(PRESETS["tiny"].hidden_size)}
    with pytest.raises(ServiceError) as e:
        admin.update_weights_from_group(bad)
    assert e.value.status == 422 and "shape" in str(e.value)
    with pytest.raises(ServiceError) as e:
        admin.update_weights(group={"port": 1, "tensors": [{"name": "nope", "shape": [1], "dtype": "float32"}]})
    assert e.value.status == 422 and "nope" in str(e.value)
    after, v2 = _tokens(admin)
    assert after == before and v2 == v
