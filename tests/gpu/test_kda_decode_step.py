"""A KDA layer's all-decode step as one Triton kernel (kda_step.decode_step) against the torch ops
of kda.py's decode path: o_proj's input, the conv history rows and the recurrent rows it advances
in place; fresh sequences on rows that hold NaN, rows out of order, both gate forms. Runs on CUDA,
or on a CPU with Triton installed and TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kda_reference import decode_step
from kernel_env import DEVICE, INTERPRET, fill_random, kernel_marks, require_kernel_device

require_kernel_device()

from service.model import kda_step  # noqa: E402
from service.model.counters import ArrivalCounters  # noqa: E402

pytestmark = kernel_marks(180)

SLOTS, B = 8, 5
ROWS = [6, 1, 3, 2, 7]
POSITIONS = [0, 5, 1, 0, 40]  # rows 6 and 2 hold NaN: their sequences start here


def draw(heads: int, d: int, width: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    p = heads * d

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g)

    conv = randn(SLOTS, 3 * p, width - 1).to(dtype).float()  # model-dtype values in fp32
    recurrent = randn(SLOTS, heads, d, d, scale=0.3)
    for rows in (conv, recurrent):
        rows[[2, 6]] = float("nan")
    dt = (torch.rand(p, generator=g) * 4.6 - 6.9).exp()  # 1e-3 .. 1e-1, as Kimi's init
    return dict(mixed=randn(B, 3 * p).to(dtype), conv=conv, rows=torch.tensor(ROWS),
                positions=torch.tensor(POSITIONS), ws=[randn(p, 1, width, scale=0.6).to(dtype) for _ in range(3)],
                raw_g=randn(B, p, scale=2.0).to(dtype), raw_beta=randn(B, heads).to(dtype),
                gate=randn(B, p).to(dtype), a_log=(1 + 3 * torch.rand(heads, generator=g)).log(),
                dt_bias=dt + torch.log(-torch.expm1(-dt)), norm_weight=(1 + 0.2 * randn(d)).to(dtype),
                recurrent=recurrent)


def assert_arrivals_zeroed() -> None:
    """A split step made its arrival counters and left them zeroed, for the next step or replay."""
    buffers = kda_step._ARRIVALS.buffers
    assert buffers and not any(buf.any() for buf in buffers.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("heads,d,width,f_b,blocks", [(3, 32, 4, False, "32"), (2, 128, 4, False, "32"),
                                                      (4, 16, 3, False, "32"), (2, 128, 4, True, "32"),
                                                      (3, 32, 4, True, "32"), (2, 128, 4, False, "wide"),
                                                      (2, 128, 4, True, "wide"), (2, 128, 4, False, "split"),
                                                      (2, 128, 4, True, "split")])
def test_decode_step_matches_the_torch_ops(dtype, lower_bound, heads, d, width, f_b, blocks, monkeypatch):
    """f_b: the kernel projects f_a's output through f_b's rows itself (K = d, as KDA's f_a). blocks:
    a program walks its head's 32-column blocks; "wide": 64-column blocks on 8 warps
    (LATENTSERVE_KDA_STEP_WIDE_MAX_ROWS); "split": one 32-column block a program, four programs a
    head, the last to arrive norming the row (LATENTSERVE_KDA_STEP_SPLIT_MAX_ROWS)."""
    monkeypatch.setenv("LATENTSERVE_KDA_STEP_WIDE_MAX_ROWS", "64" if blocks == "wide" else "0")
    monkeypatch.setenv("LATENTSERVE_KDA_STEP_SPLIT_MAX_ROWS", "64" if blocks == "split" else "0")
    assert kda_step.block_cols(B) == (64 if blocks == "wide" else 32)
    case = draw(heads, d, width, dtype, seed=heads * d + width)
    eps = 1e-5
    g = torch.Generator().manual_seed(d)
    if f_b:
        # Multiples of 1/4 and 1/8 whose sums bf16 holds exactly: a rounding of f_b's output (sum
        # order, the interpreter's truncation) would move a gate by one bf16 step, and a decay
        # exp(-5 sigmoid(a z)) amplifies that ~0.06 into the state.
        f_a = torch.randint(-2, 3, (B, d), generator=g).to(dtype) / 4
        w_fb = torch.randint(-2, 3, (heads * d, d), generator=g).to(dtype) / 8
        exact = f_a.double() @ w_fb.double().t()
        assert torch.equal(exact.to(torch.bfloat16).double(), exact)
        case["raw_g"] = exact.to(dtype)
    ref_out, ref_hist, ref_rec = decode_step(**case, lower_bound=lower_bound, eps=eps)

    dev = {k: ([w.to(DEVICE) for w in v] if k == "ws" else v.to(DEVICE)) for k, v in case.items()}
    assert kda_step.supported(dev["mixed"], dev["recurrent"], d)
    out = torch.ops.latentserve.kda_decode_step(
        dev["mixed"], dev["conv"], *dev["ws"], f_a.to(DEVICE) if f_b else dev["raw_g"], dev["raw_beta"],
        dev["gate"], dev["a_log"], dev["dt_bias"], dev["norm_weight"], dev["recurrent"], dev["rows"],
        dev["positions"], d ** -0.5, lower_bound, eps, w_fb.to(DEVICE) if f_b else None).cpu()
    assert out.dtype == dtype and out.shape == (B, heads * d) and not out.isnan().any()
    if blocks == "split":
        assert_arrivals_zeroed()
    # bf16: the output rounds twice (before the norm and after it), as the torch path does, and
    # an fp32 sum order may flip a rounding: one bf16 step of the output's scale.
    tol = 2e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol * ref_out.float().abs().max(), rtol=tol)

    rows, untouched = case["rows"], [0, 4, 5]
    after_conv, after_rec = dev["conv"].cpu(), dev["recurrent"].cpu()
    torch.testing.assert_close(after_conv[rows], ref_hist, atol=0, rtol=0)  # moved, not computed: exact
    # Triton 3.6's interpreter rounds fp32 -> bf16 by truncation (a GPU rounds to nearest), so there
    # the bf16-rounded q, k, v may sit one bf16 step from torch's.
    state_tol = 2 ** -7 if INTERPRET and dtype != torch.float32 else 1e-5
    torch.testing.assert_close(after_rec[rows], ref_rec, atol=state_tol * ref_rec.abs().max(), rtol=state_tol)
    torch.testing.assert_close(after_conv[untouched], case["conv"][untouched], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(after_rec[untouched], case["recurrent"][untouched], atol=0, rtol=0, equal_nan=True)


def test_decode_step_refuses_inputs_that_do_not_fit_its_heads():
    case = draw(2, 16, 4, torch.float32, seed=1)
    dev = {k: ([w.to(DEVICE) for w in v] if k == "ws" else v.to(DEVICE)) for k, v in case.items()}
    with pytest.raises(ValueError, match="do not fit 2 heads of 16"):
        torch.ops.latentserve.kda_decode_step(
            dev["mixed"], dev["conv"], *dev["ws"], dev["raw_g"][:, :16], dev["raw_beta"], dev["gate"],
            dev["a_log"], dev["dt_bias"], dev["norm_weight"], dev["recurrent"], dev["rows"], dev["positions"],
            0.25, None, 1e-5)


@pytest.mark.parametrize("preset", ["k3-tiny", "linear", "bounded"])
@pytest.mark.parametrize("multi,f_b_rows,split_rows", [(False, "16", "0"), (True, "16", "0"), (True, "0", "0"),
                                                      (True, "16", "8")],
                         ids=["projections", "gemv_multi", "f_b_launched", "split"])
def test_kda_layer_decodes_through_the_step_kernel(preset, multi, f_b_rows, split_rows, monkeypatch, spy):
    """KimiDeltaAttention's all-decode steps with LATENTSERVE_KDA_DECODE_STEP=1 (the input
    projections as one launch or not; f_b projected in the kernel, the default at 3 rows, or by
    its own launch; a head's columns over several programs) against its torch path: outputs and
    both state rows, over three steps, a fresh sequence on a NaN row among them (Kimi-K3's
    full-rank gate, Kimi-Linear's low-rank one, the bounded gate)."""
    import dataclasses

    from service.config import PRESETS
    from service.engine.plan import SeqChunk
    from service.model.attn_metadata import AttnMetadata
    from service.model.kda import KDAState, KimiDeltaAttention, kda_state_shapes
    from service.parallel import TPGroup

    cfg = PRESETS["k3-tiny"]
    extra = {"linear": {"use_full_rank_gate": False}, "bounded": {"gate_lower_bound": -5.0}}.get(preset, {})
    if split_rows != "0":  # head width 64: two 32-column programs a head
        extra = {**extra, "head_dim": 64}
        monkeypatch.setattr(kda_step, "_ARRIVALS", ArrivalCounters())
    cfg = dataclasses.replace(cfg, linear_attn_config={**cfg.linear_attn_config, **extra})
    layer = KimiDeltaAttention(cfg, TPGroup.single(), 0, torch.float32)
    g = torch.Generator().manual_seed(len(preset))
    fill_random(layer, g)
    layer = layer.to(DEVICE).eval()
    gs = torch.Generator().manual_seed(7)
    ref_state = KDAState(**{k: torch.randn((6, *shape), generator=gs).to(DEVICE, dt)
                            for k, (shape, dt) in kda_state_shapes(cfg, 1).items()})
    for rows in (ref_state.conv, ref_state.recurrent):
        rows[4] = float("nan")  # the fresh sequence's row
    got_state = KDAState(ref_state.conv.clone(), ref_state.recurrent.clone())
    monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "1" if multi else "0")
    monkeypatch.setenv("LATENTSERVE_KDA_STEP_FB_MAX_ROWS", f_b_rows)
    monkeypatch.setenv("LATENTSERVE_KDA_STEP_SPLIT_MAX_ROWS", split_rows)
    f_b_launches = spy(layer.f_b_proj, "forward")
    calls = spy(kda_step, "decode_step")
    with torch.no_grad():
        for step in range(3):
            chunks = [SeqChunk(0, [0], 9 + step, [], state_slot=2), SeqChunk(1, [0], step, [], state_slot=4),
                      SeqChunk(2, [0], 1 + step, [], state_slot=1)]
            meta = AttnMetadata.build(chunks, 16, DEVICE)
            x = torch.randn(3, cfg.hidden_size, generator=g).to(DEVICE)
            monkeypatch.setenv("LATENTSERVE_KDA_DECODE_STEP", "0")
            layer.backend = "torch"
            ref = layer(x, meta, ref_state)
            monkeypatch.setenv("LATENTSERVE_KDA_DECODE_STEP", "1")
            layer.backend = "auto"
            got = layer(x, meta, got_state)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert len(calls) == 3
    assert len(f_b_launches) == 3 + (3 if f_b_rows == "0" else 0)  # the torch path's, and the kernel path's
    if split_rows != "0":
        assert_arrivals_zeroed()
    for part in ("conv", "recurrent"):
        torch.testing.assert_close(getattr(got_state, part), getattr(ref_state, part), atol=1e-5, rtol=1e-4,
                                   equal_nan=True)
