"""The torch.compile'd elementwise chains (service/model/fusion.py) equal their eager functions
on CUDA at every batch size a decode graph uses, and replay inside a CUDA graph; the decode
graphs' compiled decoder layers give the eager step's logits; the MLA decode custom op that
those layers call equals the kernel and has a matching fake implementation."""

from __future__ import annotations

import pytest
import torch
from kernel_env import GRAPH_SHAPES, rel_error

from service import LLM
from service.engine.plan import SeqChunk, StepPlan
from service.model import mla_decode
from service.model.layers import apply_rope, rms_norm_hf
from service.model.moe import route
from service.tail.base import latent_norm, rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"
BF16 = torch.bfloat16


def _close(a, b, tol):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("m", [1, 5, 64])
def test_norms_and_rope_match_eager(m):
    g = torch.Generator(device=DEV).manual_seed(m)
    for width in (512, 2048):
        x = torch.randn(m, width, device=DEV, generator=g).to(BF16)
        w = (torch.rand(width, device=DEV, generator=g) + 0.5).to(BF16)
        _close(rms_norm_hf(x, w, 1e-6), rms_norm_hf.eager(x, w, 1e-6), 1e-2)
        _close(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6), 1e-2)
        assert latent_norm(x, None, 1e-6) is x  # no latent norm: the sum goes up as it is
    q = torch.randn(m, 16, 64, device=DEV, generator=g).to(BF16)
    k = torch.randn(m, 64, device=DEV, generator=g).to(BF16)
    ang = torch.rand(m, 32, device=DEV, generator=g) * 6.28
    # eager rope rounds each product to bf16, the fused kernel once at the end: 2 ulps apart
    for inter in (True, False):
        _close(apply_rope(q, ang.cos(), ang.sin(), inter), apply_rope.eager(q, ang.cos(), ang.sin(), inter), 2e-2)
        _close(apply_rope(k, ang.cos(), ang.sin(), inter), apply_rope.eager(k, ang.cos(), ang.sin(), inter), 2e-2)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_router_matches_eager(m):
    g = torch.Generator(device=DEV).manual_seed(10 + m)
    x = torch.randn(m, 1024, device=DEV, generator=g).to(BF16)
    weight = (torch.randn(64, 1024, device=DEV, generator=g) * 0.05).to(BF16)
    bias = torch.randn(64, device=DEV, generator=g) * 0.01
    for n_group, topk_group in ((1, 1), (8, 4)):
        args = (weight, bias, n_group, topk_group, 6, True, 2.5)
        (w1, i1), (w2, i2) = route(x, *args), route.eager(x, *args)
        # top-k without sorting may list the same experts in another order: compare by expert id
        o1, o2 = i1.sort(-1), i2.sort(-1)
        assert torch.equal(o1.values, o2.values)
        _close(w1.gather(1, o1.indices), w2.gather(1, o2.indices), 1e-5)


def test_compiled_chain_replays_in_a_cuda_graph():
    x = torch.randn(8, 2048, device=DEV).to(BF16)
    w = torch.ones(2048, device=DEV, dtype=BF16)
    ref = rms_norm_hf.eager(x, w, 1e-6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm_hf(x, w, 1e-6)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm_hf(x, w, 1e-6)
    x.add_(1.0)  # new input in the same buffer: the replay must read it
    graph.replay()
    torch.cuda.synchronize()
    _close(out, rms_norm_hf.eager(x, w, 1e-6), 1e-2)
    assert not torch.allclose(out.float(), ref.float(), atol=1e-2)


# tiny with latent/rope widths the Triton decode kernel takes, as in test_engine_cuda.py
OVERRIDES = GRAPH_SHAPES


def test_compiled_decode_layers_in_graphs_match_the_eager_step(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_COMPILE", "layers")  # the default; set in case the environment says otherwise
    llm = LLM(model="tiny", hf_overrides=OVERRIDES, dtype="bfloat16", device=DEV, seed=0,
              distributed_executor_backend="uni", cuda_graph_batch_sizes=[1, 4, 8])
    try:
        worker = llm.executor.rank0
        graphs = worker.decode_graphs
        compiled = graphs.stats()["compiled_layers"]
        # warm-up and capture at 3 sizes, every layer through the compiled forward
        assert compiled and compiled["ok"], compiled
        assert compiled["calls"] >= 2 * 3 * len(worker.model.layers), compiled
        with torch.no_grad():
            for kv in worker.kv_caches:
                kv.normal_()  # real numbers in every slot a context reads
        bs = llm.config.block_size
        for b in (1, 3, 8):  # 3 runs in the graph of 4: padding rows
            chunks = [SeqChunk(i, [7 + i], 20 + 5 * i, list(range(4 * i, 4 * i + 4))) for i in range(b)]
            assert all(c.start_pos + 1 <= 4 * bs for c in chunks)
            with torch.inference_mode():
                before = graphs.replays
                out = worker.execute(StepPlan(chunks))
                assert graphs.replays == before + 1, "the step did not replay a graph"
                ref = worker._eager_forward(chunks, worker.kv_caches)
            assert out.shape == ref.shape and torch.isfinite(out).all()
            # bf16 activations are rounded in other places (fused kernels keep fp32 between ops):
            # ~5e-3 per layer. A router near-tie can flip one token's expert and move that row
            # by ~0.5 (seen on CPU with the same weights), so most rows, not all, must be close.
            errs = sorted(rel_error(out[r], ref[r]) for r in range(b))
            assert errs[(b - 1) // 2] < 3e-2, f"batch {b}: per-row errors vs eager {errs}"
            assert errs[-1] < 1.0, f"batch {b}: a row is unrelated to the eager step: {errs}"
    finally:
        llm.shutdown()


def test_mla_decode_custom_op_matches_kernel_and_fake():
    g = torch.Generator(device=DEV).manual_seed(3)
    lora, rope, bs = 64, 16, 16
    q = torch.randn(3, 16, lora + rope, device=DEV, generator=g).to(BF16)
    kv = torch.randn(12, bs, lora + rope, device=DEV, generator=g).to(BF16)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], device=DEV)
    ctx = torch.tensor([1, 17, 40], device=DEV)
    args = (q, kv, tables, ctx, lora, 0.125)
    out = torch.ops.latentserve.mla_decode(*args)
    one_split = mla_decode.mla_decode(*args, splits=1)  # no merge at all
    assert out.shape == (3, 16, lora) and out.dtype == torch.float32
    assert rel_error(out, one_split) < 1e-2
    torch.library.opcheck(torch.ops.latentserve.mla_decode.default, args, test_utils=("test_schema", "test_faketensor"))
