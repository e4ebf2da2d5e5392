"""The memory pool on CUDA (cuMem): addresses, outputs, free memory and CUDA graphs across sleeps."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from service.memory.pool import MemoryPool

pytestmark = pytest.mark.gpu
MIB = 1 << 20


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)
        self.norm = nn.RMSNorm(hidden)
        self.register_buffer("scale", torch.empty(hidden))

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.silu(self.fc1(self.norm(x)))) * self.scale


class Net(nn.Module):
    """bf16; 16 MiB per layer at hidden 1024."""

    def __init__(self, hidden: int = 1024, layers: int = 4, vocab: int = 4096):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(pool, layers=4, preserve=(), seed=0):
    with torch.device("meta"):
        model = Net(layers=layers).to(torch.bfloat16)
    pool.materialize(model, preserve=preserve)
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32) * 0.05 + 1e-3)
    return model


def ids():
    return torch.arange(64, device="cuda") * 37 % 4096


@pytest.fixture
def pools():
    made = []
    yield made.append
    torch.cuda.synchronize()
    for p in made:
        p.close()


def test_outputs_and_addresses_survive_level1_and_level2_all_preserved(pools):
    pool = MemoryPool("cuda", chunk_bytes=16 * MIB)
    pools(pool)
    model = build(pool, preserve=["*"])
    flags = pool.state("tail.routed_flags", (4,), torch.int32, fill=5)
    kv = pool.allocate("kv_cache", "kv.0", (256, 1024), torch.bfloat16)
    ptrs = pool.data_ptrs()
    with torch.no_grad():
        ref = model(ids())
    rep = pool.sleep(1)
    assert rep["bytes_released"] >= rep["parameter_bytes"] and rep["bytes_backed_up"] >= rep["parameter_bytes"]
    pool.wake_up()
    assert pool.data_ptrs() == ptrs
    with torch.no_grad():
        assert torch.equal(model(ids()), ref)
    for _ in range(2):
        rep = pool.sleep(2)
        assert rep["bytes_discarded"] == kv.numel() * 2 + (-kv.numel() * 2) % pool.granularity
        pool.wake_up(["weights"])
        pool.wake_up(["kv_cache"])
        assert pool.data_ptrs() == ptrs and pool.weights_valid
        with torch.no_grad():
            assert torch.equal(model(ids()), ref)
        assert torch.equal(flags.cpu(), torch.full((4,), 5, dtype=torch.int32))


def test_level2_frees_device_memory_and_poisons(pools):
    pool = MemoryPool("cuda", poison=True)
    pools(pool)
    model = build(pool, layers=16, preserve=["norm.weight"])
    scale = model.layers[3].scale.clone()
    kv = pool.allocate("kv_cache", "kv.0", (32 * MIB,), torch.bfloat16)
    rep = pool.sleep(2)
    released = rep["bytes_released"]
    assert rep["bytes_discarded"] >= 0.95 * rep["parameter_bytes"]
    rise = rep["free_memory_after"] - rep["free_memory_before"]
    assert abs(rise - released) <= 0.05 * released + 16 * MIB, (rise, released)
    rep = pool.wake_up()
    drop = rep["free_memory_before"] - rep["free_memory_after"]
    assert abs(drop - rep["bytes_mapped"]) <= 0.05 * rep["bytes_mapped"] + 16 * MIB, (drop, rep["bytes_mapped"])
    assert torch.isnan(model.layers[5].fc1.weight).all() and torch.isnan(model.lm_head.weight).all()
    assert torch.isnan(kv).all()
    assert not torch.isnan(model.norm.weight).any()
    assert torch.equal(model.layers[3].scale, scale)
    assert not pool.weights_valid


def test_cuda_graph_captured_before_sleep_replays_after_wake(pools):
    pool = MemoryPool("cuda", chunk_bytes=16 * MIB, poison=True)
    pools(pool)
    model = build(pool)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    static = ids()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        model(static)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static)
    graph.replay()
    ref = out.clone()
    pool.sleep(1)
    pool.wake_up()
    graph.replay()
    assert torch.equal(out, ref)
    pool.sleep(2)
    pool.wake_up()
    graph.replay()
    assert torch.isnan(out).all()  # parameters were discarded (poisoned): the graph reads the new memory
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    pool.mark_weights_loaded()
    graph.replay()
    assert torch.equal(out, ref)


def test_interleaved_mixed_chunks_kept(pools):
    pool = MemoryPool("cuda", layout="interleaved", chunk_bytes=8 * MIB)
    pools(pool)
    model = build(pool, layers=2)
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    rep = pool.sleep(2)
    assert rep["chunks"].get("mixed", 0) >= 1
    pool.wake_up()
    after = dict([*model.named_parameters(), *model.named_buffers()])
    names = {e.name for c in pool.chunks if c.mixed for e in c.entries}
    assert names
    for n in names:
        assert torch.equal(after[n], before[n]), n


def test_comm_chunk_is_kept_and_exportable(pools):
    pool = MemoryPool("cuda")
    pools(pool)
    build(pool, layers=1)
    buf = pool.allocate("comm", "tail.mailbox", (MIB,), torch.float32)
    buf.fill_(-0.0)
    fd = pool.export_fd("tail.mailbox")
    peer = pool.map_peer_fd(fd, buf.numel() * 4).view(torch.float32)  # what a peer rank does
    os.close(fd)
    assert peer.data_ptr() != buf.data_ptr()
    buf[7] = 2.5
    torch.cuda.synchronize()
    assert peer[7].item() == 2.5
    rep = pool.sleep(2)
    assert rep["bytes_kept"] >= buf.numel() * 4
    assert peer[7].item() == 2.5 and torch.signbit(buf[0]).item()
    pool.wake_up()
