"""The L2 prefetch's request table (model/l2_prefetch.py) on CPU tensors, and its kernel compiled
for sm_90 without a GPU (Triton's CUDA backend and bundled ptxas; skipped without Triton): the
inline PTX assembles and the prefetch instruction survives the compiler. The GPU test
(tests/gpu/test_l2_prefetch_cuda.py) checks that decode graphs give the same logits with it."""

from __future__ import annotations

import pytest
import torch

from service.model import l2_prefetch
from service.model.l2_prefetch import BLOCK, CHUNK, LayerPrefetch, chunks, layer_weights


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.zeros(300, 1000, dtype=torch.bfloat16))  # 600,000 bytes
        self.norm = torch.nn.Parameter(torch.zeros(1000))  # 4 KB: under MIN_BYTES
        self.experts = torch.nn.Parameter(torch.zeros(4, 64, 256))  # 3-D: routed experts
        self.register_buffer("table", torch.zeros(40000))  # 160 KB buffer
        self.alias = self.proj  # the same storage twice is requested once


def test_layer_weights_keep_2d_tensors_of_64_kb_and_more_once():
    layer = _Layer()
    assert [t.data_ptr() for t in layer_weights(layer)] == [layer.proj.data_ptr(), layer.table.data_ptr()]


def test_chunks_cover_each_tensor_in_aligned_pieces_and_pad_to_whole_programs():
    layer = _Layer()
    weights = layer_weights(layer)
    addrs, sizes = chunks(weights)
    assert len(addrs) == len(sizes) and len(addrs) % BLOCK == 0
    assert all(a % 16 == 0 and 0 < s <= CHUNK and s % 16 == 0 for a, s in zip(addrs, sizes))
    covered = set()
    for a, s in zip(addrs, sizes):
        covered.update(range(a, a + s, 16))
    for t in weights:
        lo = -(-t.data_ptr() // 16) * 16
        hi = (t.data_ptr() + t.numel() * t.element_size()) // 16 * 16
        inside = [p for p in covered if lo <= p < hi]
        assert len(inside) == (hi - lo) // 16  # every aligned 16 bytes of the tensor, once
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in weights]
    assert all(any(lo <= a and a + s <= hi for lo, hi in spans) for a, s in zip(addrs, sizes))  # none outside
    assert chunks([]) == ([], [])


def test_off_by_default_and_on_from_the_environment(monkeypatch):
    monkeypatch.delenv("LATENTSERVE_L2_PREFETCH", raising=False)
    assert LayerPrefetch.from_env() is None
    monkeypatch.setenv("LATENTSERVE_L2_PREFETCH", "16")
    monkeypatch.setenv("LATENTSERVE_L2_PREFETCH_EVICT_LAST", "1")
    p = LayerPrefetch.from_env()
    assert (p.rows, p.evict_last) == (16, True)
    # CPU rows never fork a stream or launch
    p.issue(0, _Layer(), torch.zeros(4, 8))
    p.join()
    assert not p.forked and p.tables == {}


@pytest.mark.parametrize("evict_last", [False, True])
def test_the_prefetch_kernel_compiles_for_sm90(evict_last):
    triton = pytest.importorskip("triton")
    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    from triton.backends import Backend, backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in backends:  # no GPU driver here, so the backend was not discovered
        from triton.backends.nvidia.driver import CudaDriver
        backends["nvidia"] = Backend(compiler=nvidia.CUDABackend, driver=CudaDriver)
    kernel = l2_prefetch._prefetch_kernel
    src = ASTSource(kernel, {"addr_ptr": "*i64", "size_ptr": "*i32", "EVICT_LAST": "constexpr", "BLOCK": "constexpr"},
                    constexprs={(2,): evict_last, (3,): BLOCK}, attrs={(0,): [["tt.divisibility", 16]],
                                                                      (1,): [["tt.divisibility", 16]]})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    except RuntimeError as e:  # e.g. no ptxas in this install
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1
    assert ("L2::cache_hint" in ptx) == evict_last
    assert compiled.asm["cubin"]
