"""What /restart brings back (service/weights/restore.py), without a server: the plan's bookkeeping
(path resets the overlay, snapshots merge newest-last, 'off' names what would be lost) with the
rank calls faked, and the rank side on a real TP-1 engine: a snapshot of the parameters a tensor
update wrote, restored into a fresh engine, gives the same tokens and version."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service import LLM, SamplingParams
from service.config import PRESETS
from service.weights import checkpoint_tensors
from service.weights.restore import RestorePlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]


class FakeRank:
    def __init__(self, rank: int):
        self.rank, self.calls = rank, []


class FakeRanks(list):
    """An executor whose call_ranks(method, args) is answered by a dict of method -> fn(rank, *args)."""

    def __init__(self, answers: dict, n: int):
        super().__init__(FakeRank(r) for r in range(n))
        self.answers = answers

    @property
    def world_size(self) -> int:
        return len(self)

    def call_ranks(self, method, args_per_rank, timeout):
        out = []
        for a, args in zip(self, args_per_rank):
            a.calls.append((method, args))
            try:
                out.append({"rank": a.rank, "ok": True, "result": self.answers[method](a.rank, *args)})
            except Exception as e:  # noqa: BLE001
                out.append({"rank": a.rank, "ok": False, "error": str(e)})
        return out, {}


@pytest.fixture
def fake_calls():
    """The answers of FakeRanks' calls: method -> fn(rank, *args)."""
    return {}


def test_plan_replays_path_then_the_merged_snapshots(fake_calls):
    ranks = FakeRanks(fake_calls, 2)
    plan = RestorePlan("host")
    snaps = iter([{"a": torch.ones(2), "b": torch.ones(3)}, {"b": torch.full((3,), 2.0)}])
    current = {}
    fake_calls["snapshot_params"] = lambda rank: current.setdefault(rank, next(snaps)) if rank == 0 else {}
    assert plan.updated("path", "/ckpt/1", 1, ranks, 5)["restart_restores"] == "path"
    assert plan.updated("group", {"port": 1}, 2, ranks, 5)["params"] == 2
    current.clear()
    assert plan.updated("refs", {"token": "t"}, 3, ranks, 5)["restart_restores"] == "snapshot"
    d = plan.describe()
    assert d["source"] == "snapshot" and d["weight_version"] == 3 and d["path"] == "/ckpt/1"
    assert d["snapshot"]["bytes"] == 4 * (2 + 3) and d["snapshot"]["sources"] == ["group", "refs"]

    fake_calls["update_weights_from_path"] = lambda rank, path, version: {"version": version}
    fake_calls["restore_params"] = lambda rank, params, version: {"params": sorted(params)}
    version, report = plan.restore(ranks, 5)
    assert version == 3 and report["from"] == "path + snapshot" and report["lost"] is None
    assert [m for m, _ in ranks[0].calls[-2:]] == ["update_weights_from_path", "restore_params"]
    restored = ranks[0].calls[-1][1][0]
    assert sorted(restored) == ["a", "b"] and restored["b"].tolist() == [2.0] * 3  # the newest copy

    # A path update holds everything: the overlay goes.
    plan.updated("path", "/ckpt/4", 4, ranks, 5)
    assert plan.describe()["snapshot"] is None and plan.restore(ranks, 5)[0] == 4


def test_plan_without_snapshots_says_what_a_restart_would_lose(fake_calls):
    ranks = FakeRanks(fake_calls, 1)
    plan = RestorePlan("off")
    plan.updated("path", "/ckpt/1", 1, ranks, 5)
    r = plan.updated("group", {}, 2, ranks, 5)
    assert r["restart_restores"] == "base" and "group update to version 2" in r["lost"]
    assert plan.describe()["source"] == "path" and plan.describe()["weight_version"] == 1
    fake_calls["update_weights_from_path"] = lambda rank, path, version: {}
    version, report = plan.restore(ranks, 5)
    assert version == 1 and "group update" in report["lost"] and plan.describe()["lost"] is None

    failing = RestorePlan("host")
    fake_calls["snapshot_params"] = lambda rank: (_ for _ in ()).throw(RuntimeError("disk full"))
    assert "snapshot failed (disk full)" in failing.updated("refs", {}, 1, ranks, 5)["lost"]
    with pytest.raises(ValueError, match="mode"):
        RestorePlan("disk")


def test_rank_snapshot_restores_a_tensor_update_into_fresh_ranks():
    cfg = PRESETS["tiny"]
    named = dict(checkpoint_tensors(cfg, seed=0))
    policy = {"lm_head.weight": torch.roll(named["lm_head.weight"], shifts=5, dims=0) * 1.5,
              "model.layers.1.mlp.experts.0.up_proj.weight": named["model.layers.1.mlp.experts.0.up_proj.weight"]
              * -1.0}
    kw = dict(distributed_executor_backend="uni", dtype="float32", hf_overrides={"num_hidden_layers": 2})
    with LLM("tiny", **kw) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.update_weights(list(policy.items())) == 1
        served = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        snap = llm.executor.rank0.snapshot_params()
    assert served != before
    # w13 holds gate and up of every expert: the whole parameter travels.
    assert sorted(snap) == ["lm_head.weight", "model.layers.1.mlp.experts.w13"]
    with LLM("tiny", **kw) as fresh:
        assert [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, GREEDY)] == before
        report = fresh.executor.rank0.restore_params(snap, 7)
        assert report["params"] == 2 and report["weight_version"] == 7
        outs = fresh.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == served and outs[0].weight_version == 7
        with pytest.raises(ValueError, match="does not fit"):
            fresh.executor.rank0.restore_params({"lm_head.weight": torch.zeros(2, 2)}, 8)


def test_offline_restart_goes_through_the_coordinator_and_keeps_the_policy(tmp_path):
    """LLM.restart is the HTTP restart's path (Coordinator.restart): fresh ranks, then the last
    path checkpoint and, with weight_snapshot='host', the tensor update after it, same version."""
    from service.weights import save_checkpoint

    cfg = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=2, torch_dtype="float32")
    named = dict(checkpoint_tensors(cfg, seed=0))
    ckpt = str(tmp_path / "trained")
    save_checkpoint(cfg, ckpt, {n: (-t if n == "lm_head.weight" else t) for n, t in named.items()})
    policy = [("model.norm.weight", named["model.norm.weight"] * 0.5)]
    kw = dict(distributed_executor_backend="uni", dtype="float32", hf_overrides={"num_hidden_layers": 2})
    with LLM("tiny", weight_snapshot="host", **kw) as llm:
        startup = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.update_weights_from_path(ckpt) == 1 and llm.update_weights(policy) == 2
        served = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        old = llm.executor
        report = llm.restart()
        assert llm.executor is not old and report["weight_version"] == 2 and report["state"] == "running"
        assert report["restored"]["from"] == "path + snapshot" and report["note"] is None
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == served != startup and outs[0].weight_version == 2
