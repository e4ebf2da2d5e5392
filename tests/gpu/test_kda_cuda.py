"""The KDA layer's FLA path (fla-core's chunk_kda and fused recurrent kernels) against its torch
path, on CUDA, in fp32 and bf16: prefills, continuations, decodes (one of them a fresh one-token
prompt on an unwritten row) and mixed batches through the state rows; and the all-decode step
captured in a CUDA graph and replayed for other rows and positions.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla.ops.kda", reason="fla-core is not installed")

from service.config import PRESETS, ModelConfig  # noqa: E402
from service.engine.plan import SeqChunk  # noqa: E402
from service.model.attn_metadata import AttnMetadata  # noqa: E402
from service.model.kda import KDAState, KimiDeltaAttention, fla_kda, kda_state_shapes  # noqa: E402
from service.parallel import TPGroup  # noqa: E402

pytestmark = pytest.mark.gpu

K3 = PRESETS["k3-tiny"]
CONFIGS = {
    "linear": dataclasses.replace(K3, linear_attn_config={**K3.linear_attn_config, "use_full_rank_gate": False}),
    "k3-bounded": dataclasses.replace(K3, linear_attn_config={**K3.linear_attn_config, "gate_lower_bound": -5.0}),
}
ROWS = 8
# Relative to the largest output entry. fp32: FLA's chunk kernels multiply in TF32; bf16: FLA
# rounds the l2-normalised q/k to bf16, the torch path keeps them in fp32.
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True, scope="module")
def _fla_imports():
    if fla_kda() is None:
        pytest.skip("fla.ops.kda does not import")


def build_layer(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(cfg, TPGroup.single(), 0, torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name == "A_log":
                p.copy_((1 + 3 * torch.rand(p.shape, generator=g)).log())
            elif name == "dt_bias":
                dt = (torch.rand(p.shape, generator=g) * 4.6 - 6.9).exp()  # 1e-3 .. 1e-1
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            else:
                scale = 0.5 if name == "f_b_proj.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
    return layer.to(device="cuda", dtype=dtype).eval()


def nan_state(cfg: ModelConfig, dtype: torch.dtype) -> KDAState:
    return KDAState(**{k: torch.full((ROWS, *shape), float("nan"), dtype=dt or dtype, device="cuda")
                       for k, (shape, dt) in kda_state_shapes(cfg, 1).items()})


def meta_for(chunks: list[tuple[int, int, int]]) -> AttnMetadata:
    """chunks: (length, start position, state slot)."""
    return AttnMetadata.build([SeqChunk(i, [0] * n, start, [], state_slot=slot)
                               for i, (n, start, slot) in enumerate(chunks)], 16, "cuda")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


# (length, start, slot) per chunk; each row's sequence continues where the last step left it.
STEPS = [
    [(150, 0, 1), (5, 0, 2), (1, 0, 3)],  # two prefills and a one-token prompt (decode-shaped)
    [(1, 150, 1), (70, 5, 2), (64, 0, 4), (1, 1, 3)],  # decode, continuation, fresh prefill, decode
    [(1, 151, 1), (1, 75, 2), (1, 64, 4), (1, 2, 3)],  # all decodes: the batched recurrent step
    [(2, 152, 1), (1, 76, 2), (1, 65, 4), (3, 3, 3)],  # short chunks: conv history inside the chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fla_path_matches_torch_path(name, dtype, monkeypatch):
    monkeypatch.setenv("LATENTSERVE_KDA_DECODE_STEP", "0")  # FLA's step, not the step kernel (the default)
    cfg = CONFIGS[name]
    layer = build_layer(cfg, dtype)
    states = {"torch": nan_state(cfg, dtype), "fla": nan_state(cfg, dtype)}
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step, chunks in enumerate(STEPS):
        x = torch.randn(sum(n for n, _, _ in chunks), cfg.hidden_size, generator=gen, device="cuda").to(dtype)
        outs = {}
        with torch.inference_mode():
            for backend, state in states.items():
                layer.backend = backend
                outs[backend] = layer(x, meta_for(chunks), state)
        assert not outs["fla"].isnan().any(), f"step {step}: NaN from the FLA path"
        err = rel_err(outs["fla"], outs["torch"])
        assert err < TOL[dtype], f"{name} {dtype} step {step}: FLA vs torch relative max abs diff {err:.2e}"
    used = [1, 2, 3, 4]
    for part in ("recurrent", "conv"):
        a, b = getattr(states["fla"], part), getattr(states["torch"], part)
        err = rel_err(a[used], b[used])
        assert err < TOL[dtype], f"{name} {dtype}: final {part} rows differ by {err:.2e}"
        assert a[[0, 5, 6, 7]].isnan().all(), f"{part}: the FLA path wrote rows outside the batch"


@pytest.mark.parametrize("step", ["0", "1"], ids=["fla", "step_kernel"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fla_decode_kernel_matches_torch_in_fp32(name, step, monkeypatch):
    """Decodes alone from fresh rows: FLA's recurrent kernel has no TF32 matmuls, so in fp32 it
    agrees with the torch step to fp32 rounding, not just to the chunk kernels' tolerance; so does
    the step kernel that replaces it by default (LATENTSERVE_KDA_DECODE_STEP)."""
    monkeypatch.setenv("LATENTSERVE_KDA_DECODE_STEP", step)
    cfg = CONFIGS[name]
    layer = build_layer(cfg, torch.float32, seed=5)
    states = {"torch": nan_state(cfg, torch.float32), "fla": nan_state(cfg, torch.float32)}
    gen = torch.Generator(device="cuda").manual_seed(4)
    slots = [6, 1, 3]
    for t in range(24):
        x = torch.randn(len(slots), cfg.hidden_size, generator=gen, device="cuda")
        outs = {}
        with torch.inference_mode():
            for backend, state in states.items():
                layer.backend = backend
                outs[backend] = layer(x, meta_for([(1, t, s) for s in slots]), state)
        err = rel_err(outs["fla"], outs["torch"])
        assert err < 1e-4, f"{name} decode {t}: FLA vs torch relative max abs diff {err:.2e}"
    err = rel_err(states["fla"].recurrent[slots], states["torch"].recurrent[slots])
    assert err < 1e-4, f"{name}: recurrent rows differ by {err:.2e}"


CONV, MULTI, STEP = "LATENTSERVE_KDA_DECODE_CONV", "LATENTSERVE_GEMV_MULTI", "LATENTSERVE_KDA_DECODE_STEP"
SWITCHES = {"conv": {CONV: "1"}, "multi": {MULTI: "1"}, "both": {CONV: "1", MULTI: "1"}, "step": {STEP: "1"},
            "step_multi": {STEP: "1", MULTI: "1"}}


def switch(monkeypatch, on: str | None) -> None:
    for name in (CONV, MULTI, STEP):
        monkeypatch.setenv(name, SWITCHES[on].get(name, "0") if on else "0")


@pytest.mark.parametrize("on", sorted(SWITCHES))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_kernels_match_the_fla_path(name, on, monkeypatch):
    """All-decode steps with the short convs as one kernel (LATENTSERVE_KDA_DECODE_CONV=1: its q,
    k, v to FLA as they are), or the whole step as one (LATENTSERVE_KDA_DECODE_STEP=1, no FLA),
    and/or the input projections as one launch (LATENTSERVE_GEMV_MULTI=1) against the same steps
    without, from the same prefilled rows; a fresh sequence (position 0) on an unwritten row too."""
    cfg, dtype = CONFIGS[name], torch.bfloat16
    layer = build_layer(cfg, dtype, seed=7)
    layer.backend = "fla"
    gen = torch.Generator(device="cuda").manual_seed(8)
    ops_state = nan_state(cfg, dtype)
    with torch.inference_mode():
        layer(torch.randn(27, cfg.hidden_size, generator=gen, device="cuda").to(dtype),
              meta_for([(20, 0, 1), (7, 0, 2)]), ops_state)
        fused_state = KDAState(ops_state.conv.clone(), ops_state.recurrent.clone())
        for t in range(6):
            x = torch.randn(3, cfg.hidden_size, generator=gen, device="cuda").to(dtype)
            meta = meta_for([(1, 20 + t, 1), (1, t, 5), (1, 7 + t, 2)])
            switch(monkeypatch, None)
            ref = layer(x, meta, ops_state)
            switch(monkeypatch, on)
            got = layer(x, meta, fused_state)
            err = rel_err(got, ref)
            assert err < 1e-2, f"{name} decode {t}: kernel vs torch convs relative max abs diff {err:.2e}"
    for part in ("recurrent", "conv"):
        err = rel_err(getattr(fused_state, part)[[1, 2, 5]], getattr(ops_state, part)[[1, 2, 5]])
        assert err < 1e-2, f"{name}: {part} rows differ by {err:.2e}"


@pytest.mark.parametrize("backend,on", [("fla", None), ("fla", "both"), ("fla", "step_multi"), ("torch", None)])
def test_decode_step_replays_in_a_cuda_graph(backend, on, monkeypatch):
    """Captured once, replayed for other rows, positions and a fresh sequence: the decode step
    reads nothing from the host lists, and its replays match eager steps (on: SWITCHES)."""
    switch(monkeypatch, on)
    cfg, dtype, b = CONFIGS["k3-bounded"], torch.bfloat16, 4
    layer = build_layer(cfg, dtype, seed=3)
    layer.backend = backend
    state = nan_state(cfg, dtype)
    gen = torch.Generator(device="cuda").manual_seed(2)

    def hidden(n: int) -> torch.Tensor:
        return torch.randn(n, cfg.hidden_size, generator=gen, device="cuda").to(dtype)

    with torch.inference_mode():
        layer(hidden(30), meta_for([(20, 0, 1), (7, 0, 2), (3, 0, 3)]), state)
        eager_state = KDAState(state.conv.clone(), state.recurrent.clone())

        x_buf = torch.zeros(b, cfg.hidden_size, dtype=dtype, device="cuda")
        pos_buf = torch.zeros(b, dtype=torch.long, device="cuda")
        slot_buf = torch.zeros(b, dtype=torch.long, device="cuda")
        meta = dataclasses.replace(meta_for([(1, 0, 0)] * b), positions=pos_buf, state_slots=slot_buf)
        scratch = nan_state(cfg, dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and autotune outside the capture
            for _ in range(3):
                layer(x_buf, meta, scratch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_buf = layer(x_buf, meta, state)

        # Row 5 is unwritten (NaN) and its sequence starts here; rows 0 and 4 are never used.
        for positions, slots in [([7, 0, 20, 3], [2, 5, 1, 3]), ([21, 8, 1, 4], [1, 2, 5, 3])]:
            x = hidden(b)
            x_buf.copy_(x)
            pos_buf.copy_(torch.tensor(positions))
            slot_buf.copy_(torch.tensor(slots))
            graph.replay()
            eager = layer(x, meta_for([(1, p, s) for p, s in zip(positions, slots)]), eager_state)
            assert not out_buf.isnan().any()
            err = rel_err(out_buf, eager)
            assert err < 1e-2, f"{backend}: replay vs eager relative max abs diff {err:.2e}"
            for part in ("recurrent", "conv"):
                got, want = getattr(state, part)[[1, 2, 3, 5]], getattr(eager_state, part)[[1, 2, 3, 5]]
                assert rel_err(got, want) < 1e-2, f"{backend}: {part} rows after the replay"
        for row in (0, 4):
            assert state.recurrent[row].isnan().all() and state.conv[row].isnan().all()
