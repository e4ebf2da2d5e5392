"""Programmatic dependent launch (service/model/pdl.py) keeps every kernel's reads and writes
after the previous kernel has finished: a chain of dependent kernels (GEMVs, each reading the
one before's output into a buffer the next overwrites, with the MoE slot sum and the MLA decode
between them) replayed many times in a CUDA graph gives bitwise the tokens of the same chain
launched eagerly without PDL. A kernel that read or wrote before its `griddepcontrol.wait`
would read a half-written input here.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a CUDA GPU of sm_90 or later (PDL)", allow_module_level=True)
pytest.importorskip("triton")

from service.model import gemv, mla_decode, moe_kernels, pdl  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def chain(x, ws, kv, tables, lens, part, out):
    h = x
    for w in ws:
        h = gemv.gemv(h, w)  # each reads the whole output of the one before
    q = h[:, :576].reshape(1, 1, 576).expand(1, 16, 576).contiguous()
    o = mla_decode._mla_decode(q, kv, tables, lens, 512, 0.05)
    part.copy_(o.reshape(8, -1)[:, :1024])
    return moe_kernels.slot_sum(part, out, 8)


def test_pdl_chain_in_a_graph_equals_eager_without_pdl(monkeypatch):
    assert pdl.enabled(torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    dims = [2048, 1344, 2048, 1024, 2048, 3072, 2048]
    ws = [(torch.randn(n, k, generator=g) / k ** 0.5).cuda().bfloat16() for k, n in zip(dims, dims[1:])]
    kv = torch.randn(64, 16, 576, generator=g).cuda().bfloat16()
    tables = torch.randperm(64, generator=g).view(1, 64).cuda().to(torch.int32)
    lens = torch.tensor([1000], device="cuda")
    x = torch.randn(1, 2048, generator=g).cuda().bfloat16()
    part = torch.empty(8, 1024, device="cuda")
    out = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)

    monkeypatch.setenv("LATENTSERVE_PDL", "0")
    ref = chain(x, ws, kv, tables, lens, part, out).clone()
    monkeypatch.setenv("LATENTSERVE_PDL", "1")
    assert torch.equal(chain(x, ws, kv, tables, lens, part, out), ref), "PDL eagerly differs"
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        chain(x, ws, kv, tables, lens, part, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(x, ws, kv, tables, lens, part, out)
    for i in range(200):
        if i % 50 == 49:
            x.normal_()  # new inputs, read by the next replay's first kernel
        graph.replay()
        if i % 50 == 48 or i == 199:
            torch.cuda.synchronize()
            monkeypatch.setenv("LATENTSERVE_PDL", "0")
            expect = chain(x, ws, kv, tables, lens, part.clone(), out.clone())
            monkeypatch.setenv("LATENTSERVE_PDL", "1")
            assert torch.equal(y, expect), f"replay {i}: PDL graph differs from eager without PDL"
