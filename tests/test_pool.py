"""The sleep-mode memory pool on CPU (DESIGN §2): real mmaps, real madvise, real RSS."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from service.memory.pool import MemoryPool
from service.memory.sleep import SleepLevel, chunk_action, chunk_class, merge_reports

CHUNK = 4 << 20


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.register_buffer("scale", torch.empty(hidden))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x)))) * self.scale


class Tiny(nn.Module):
    """~32 MiB of fp32 parameters, tied embedding, float and integer buffers."""

    def __init__(self, vocab: int = 512, hidden: int = 512, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("positions", torch.empty(64, dtype=torch.int64))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)) + self.positions[: ids.shape[-1]].float()[:, None]


def build(pool: MemoryPool, preserve=(), seed: int = 0) -> Tiny:
    with torch.device("meta"):
        model = Tiny()
    pool.materialize(model, preserve=preserve)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # what a loader does: write every byte (pages become resident)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for b in model.buffers():
            b.copy_(torch.randint(0, 7, b.shape, generator=g).to(b.dtype))
    return model


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


IDS = torch.arange(16) % 512


def test_materialize_places_every_tensor_in_the_pool():
    pool = MemoryPool(chunk_bytes=CHUNK)
    model = build(pool)
    ptrs = pool.data_ptrs()
    chunks = [(c.region.address, c.region.address + c.capacity) for c in pool.chunks]
    for name, p in model.named_parameters(remove_duplicate=False):
        assert isinstance(p, nn.Parameter) and not p.requires_grad
        assert ptrs[name] == p.data_ptr()
        assert any(lo <= p.data_ptr() < hi for lo, hi in chunks), name
    for name, b in model.named_buffers():
        assert not isinstance(b, nn.Parameter) and ptrs[name] == b.data_ptr()
    assert model.lm_head.weight is model.embed.weight  # tied: allocated once
    assert ptrs["lm_head.weight"] == ptrs["embed.weight"]
    d = pool.describe()
    assert d["chunk_counts"]["parameter"] >= 8 and d["chunk_counts"]["state"] == 1
    assert d["mixed_chunks"] == 0
    unique = {id(p): p for p in model.parameters()}.values()
    assert d["parameter_bytes"] == sum(p.numel() * 4 for p in unique)
    assert model(IDS).shape == (16, 512)


def test_level1_keeps_every_value_and_address():
    pool = MemoryPool(chunk_bytes=CHUNK)
    model = build(pool)
    before, ptrs, out = snapshot(model), pool.data_ptrs(), model(IDS)
    rep = pool.sleep(1)
    assert rep["level"] == 1 and rep["tags"] == ["weights", "kv_cache"]
    assert rep["bytes_backed_up"] >= rep["parameter_bytes"] and rep["bytes_discarded"] == 0
    assert pool.asleep_tags == {"weights", "kv_cache"}
    assert model.layers[0].fc1.weight.abs().sum() == 0  # released pages read as zeros
    rep = pool.wake_up()
    assert rep["bytes_restored"] >= rep["parameter_bytes"] and pool.asleep_tags == set()
    assert pool.data_ptrs() == ptrs
    for name, t in snapshot(model).items():
        assert torch.equal(t, before[name]), name
    assert torch.equal(model(IDS), out)
    assert pool.weights_valid and pool.parameter_chunks_intact()


def test_level2_segregated_discards_parameters_and_restores_state():
    pool = MemoryPool(chunk_bytes=CHUNK)
    model = build(pool)
    flags = pool.state("tail.routed_flags", (4,), torch.int32, fill=3)
    peers = pool.state("tail.peer_ptrs", (8,), torch.int64)
    peers.copy_(torch.arange(8) * 1000 + 7)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    ptrs = pool.data_ptrs()
    rep = pool.sleep(2)
    assert rep["bytes_released"] >= 0.95 * rep["parameter_bytes"]
    assert rep["bytes_discarded"] >= 0.95 * rep["parameter_bytes"]
    assert rep["rss_before"] - rep["rss_after"] >= 0.9 * rep["parameter_bytes"]
    assert rep["chunks"]["parameter"] >= 8 and rep["chunks"]["state"] == 1
    assert not pool.weights_valid and not pool.parameter_chunks_intact()
    with pytest.raises(RuntimeError, match="asleep"):
        pool.mark_weights_loaded()
    rep = pool.wake_up(["weights"])
    assert rep["level"] == 2 and pool.asleep_tags == {"kv_cache"}
    assert pool.data_ptrs() == ptrs
    assert torch.equal(flags, torch.full((4,), 3, dtype=torch.int32))
    assert torch.equal(peers, torch.arange(8) * 1000 + 7)
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    assert model.layers[1].fc2.weight.abs().sum() == 0  # discarded, not poisoned: fresh zero pages
    assert not pool.weights_valid
    pool.mark_weights_loaded()
    assert pool.weights_valid and pool.parameter_chunks_intact()


def test_preserved_parameters_survive_level2():
    pool = MemoryPool(chunk_bytes=CHUNK)
    model = build(pool, preserve=["layers.0.*", "*norm.weight"])
    before = snapshot(model)
    pool.sleep(2)
    pool.wake_up()
    after = snapshot(model)
    for name in before:
        kept = name.startswith("layers.0.") or name.endswith("norm.weight") or "positions" in name \
            or name.endswith(".scale")
        assert torch.equal(after[name], before[name]) == kept, name
    assert not pool.weights_valid


def test_everything_preserved_keeps_weights_valid():
    pool = MemoryPool(chunk_bytes=CHUNK)
    model = build(pool, preserve=["*"])
    out = model(IDS)
    rep = pool.sleep(2)
    assert rep["bytes_discarded"] == 0 and "parameter" not in rep["chunks"]
    pool.wake_up()
    assert pool.weights_valid and pool.parameter_chunks_intact()
    assert torch.equal(model(IDS), out)


def test_preserve_glob_matching_nothing_is_an_error():
    pool = MemoryPool(chunk_bytes=CHUNK)
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(ValueError, match=r"decoder\.\*"):
        pool.materialize(model, preserve=["layers.*", "decoder.*"])
    assert pool.chunks == []  # validated before anything is allocated


def test_interleaved_layout_keeps_mixed_chunks():
    pool = MemoryPool(layout="interleaved", chunk_bytes=CHUNK)
    model = build(pool)
    before = snapshot(model)
    rep = pool.sleep(2)
    assert rep["chunks"].get("mixed", 0) >= 1
    mixed = [c for c in pool.chunks if c.mixed]
    assert len(mixed) == rep["chunks"]["mixed"] == pool.describe()["mixed_chunks"]
    pool.wake_up()
    in_mixed = {e.name for c in mixed for e in c.entries}
    assert any(n.endswith("fc1.bias") for n in in_mixed)
    after = snapshot(model)
    for name in in_mixed:
        assert torch.equal(after[name], before[name]), name


def test_poison_marks_discarded_parameters_nan():
    pool = MemoryPool(chunk_bytes=CHUNK, poison=True)
    model = build(pool, preserve=["norm.*"])
    positions = model.positions.clone()
    pool.sleep(2)
    rep = pool.wake_up()
    assert rep["bytes_poisoned"] >= 0.9 * rep["parameter_bytes"]
    assert torch.isnan(model.layers[2].fc1.weight).all() and torch.isnan(model.embed.weight).all()
    assert not torch.isnan(model.norm.weight).any()
    assert torch.equal(model.positions, positions)  # integer state kept exactly
    assert torch.isnan(model(IDS)).all()


def test_noop_reports_and_bad_arguments():
    pool = MemoryPool(chunk_bytes=CHUNK)
    build(pool)
    assert pool.wake_up()["noop"] == "already awake"
    assert pool.sleep(1)["noop"] is None
    rep = pool.sleep(2)
    assert rep["noop"] == "already asleep" and rep["bytes_released"] == 0
    assert pool.weights_valid  # the no-op level 2 discarded nothing
    rep = pool.wake_up(["weights"])
    assert rep["noop"] is None and rep["level"] == 1
    rep = pool.wake_up(["weights"])
    assert rep["noop"] == "already awake" and rep["already_awake"] == ["weights"]
    with pytest.raises(ValueError):
        pool.wake_up(["activations"])
    with pytest.raises(ValueError):
        pool.sleep(3)


@pytest.mark.parametrize("poison", [False, True])
def test_kv_cache_released_and_poisoned(poison):
    pool = MemoryPool(chunk_bytes=CHUNK, poison=poison)
    build(pool)
    kv = pool.allocate("kv_cache", "kv.layer0", (64, 2048), torch.bfloat16)
    kv.fill_(1.5)
    ptr = kv.data_ptr()
    rep = pool.sleep(1)
    assert rep["chunks"]["kv_cache"] >= 1 and rep["bytes_discarded"] >= kv.numel() * 2
    pool.wake_up(["weights"])
    assert pool.asleep_tags == {"kv_cache"}
    with pytest.raises(RuntimeError, match="asleep"):
        pool.allocate("kv_cache", "kv.layer1", (4,), torch.bfloat16)
    pool.wake_up(["kv_cache"])
    assert kv.data_ptr() == ptr
    assert (torch.isnan(kv).all() if poison else (kv == 0).all())


def test_named_state_is_stable():
    pool = MemoryPool(chunk_bytes=CHUNK)
    a = pool.state("flags", (4,), torch.int32)
    assert (a == 0).all() and pool.state("flags", (4,), torch.int32) is a
    with pytest.raises(ValueError):
        pool.state("flags", (5,), torch.int32)
    d = pool.describe()["state"]["flags"]
    assert d["data_ptr"] == a.data_ptr() and d["nbytes"] == 16


def test_comm_is_kept_and_exportable():
    pool = MemoryPool(chunk_bytes=CHUNK)
    build(pool)
    buf = pool.allocate("comm", "tail.mailbox", (1024,), torch.float32)
    buf.fill_(-0.0)
    pool.register_comm("shm.routed", 1 << 20)
    rep = pool.sleep(2)
    assert rep["bytes_kept"] >= buf.numel() * 4 + (1 << 20)
    assert torch.equal(buf.view(torch.int32), torch.full((1024,), -(2**31), dtype=torch.int32))
    fd = pool.export_fd("tail.mailbox")
    other = pool.map_peer_fd(fd, 4096).view(torch.float32)  # what a peer rank does with the fd
    os.close(fd)
    buf[0] = 2.5
    assert other.data_ptr() != buf.data_ptr() and other[0].item() == 2.5
    with pytest.raises(ValueError):
        pool.export_fd("embed.weight")
    pool.wake_up()


def test_rules_and_merging():
    assert chunk_class("weights", ["parameter"]) == "parameter"
    assert chunk_class("weights", ["parameter", "state"]) == "state"
    assert chunk_class("weights", ["preserved"]) == "state"
    assert chunk_action("parameter", SleepLevel.DISCARD).value == "release"
    assert chunk_action("parameter", SleepLevel.OFFLOAD).value == "backup_release"
    assert chunk_action("comm", SleepLevel.DISCARD).value == "keep"
    a = {"rank": 0, "bytes_released": 10, "seconds": 0.5, "chunks": {"state": 1}, "noop": None}
    b = {"rank": 1, "bytes_released": 5, "seconds": 0.7, "chunks": {"state": 2}, "noop": None}
    m = merge_reports([a, b])
    assert m["bytes_released"] == 15 and m["seconds"] == 0.7 and m["chunks"] == {"state": 3}
    assert m["ranks"] == [0, 1] and m["noop"] is None


def test_an_engine_shutdown_gives_its_pool_back():
    """An in-process engine (the 'uni' executor) returns every chunk at shutdown: on CUDA they are
    cuMem memory that nothing else frees, so a second engine in the process ran out of memory."""
    from service import LLM, SamplingParams

    llm = LLM("tiny", distributed_executor_backend="uni", dtype="float32", hf_overrides={"num_hidden_layers": 2})
    worker = llm.executor.rank0
    pool = worker.pool
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=2))
    assert pool.chunks and pool.data_ptrs()
    llm.shutdown()
    assert not pool.chunks and worker.model is None and not worker.kv_caches
