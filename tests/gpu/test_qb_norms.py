"""q_a's norm, q_b and the latent row in one launch (service/model/qb_norms.py,
LATENTSERVE_MLA_QB_NORMS): the op against the eager ops (rms_norm_hf, the GEMV, apply_rope and
the cat) with the rope in halves, interleaved and absent; a model's logits with the switch on and
off; (CUDA only) decode graphs with it against the eager step without.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, GRAPH_SHAPES, INTERPRET, graph_steps, kernel_marks, require_kernel_device

require_kernel_device()

from _model_utils import build_model, full_logits  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.model import qb_norms  # noqa: E402
from service.model.layers import _rms_norm_hf, apply_rope  # noqa: E402

pytestmark = kernel_marks(300)
EPS_Q, EPS_KV = 1e-6, 1e-5


def _tol(dtype: torch.dtype) -> dict:
    # an ulp where a norm's or the rope's rounding order differs from the eager ops'
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qa,kv,r,n", [(1536, 512, 64, 384), (96, 40, 8, 36)])
def test_one_launch_is_the_norms_the_gemv_and_the_rope(rope, dtype, qa, kv, r, n, monkeypatch):
    """small's widths (a 384-row slice of q_b), and narrow ones that mask every tile."""
    g = torch.Generator().manual_seed(qa + kv + rope)
    qkv = (torch.randn(1, qa + kv + r, generator=g) * 2).to(DEVICE, dtype)
    q_norm, kv_norm = ((1 + torch.randn(d, generator=g) / 4).to(DEVICE, dtype) for d in (qa, kv))
    w = (torch.randn(n, qa, generator=g) / qa ** 0.5).to(DEVICE, dtype)
    angles = torch.rand(1, r // 2, generator=g) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    monkeypatch.setenv("LATENTSERVE_MLA_QB_NORMS", "1")
    assert qb_norms.supported(qkv, qa, kv, r, w)
    y, latent = torch.ops.latentserve.mla_qb_norms(qkv, q_norm, EPS_Q, w, kv_norm, EPS_KV, cos, sin, rope)
    q_a, c_kv, k_pe = qkv.split([qa, kv, r], dim=-1)
    torch.testing.assert_close(y, torch.ops.latentserve.gemv(_rms_norm_hf(q_a, q_norm, EPS_Q), w), **_tol(dtype))
    key = apply_rope(k_pe.float(), cos, sin, rope == 2).to(dtype) if rope else k_pe
    want = torch.cat([_rms_norm_hf(c_kv, kv_norm, EPS_KV), key], dim=-1)
    torch.testing.assert_close(latent, want, **_tol(dtype))
    if rope == 0:  # NoPE: the key is copied
        assert torch.equal(latent[:, kv:], k_pe)


def test_off_by_default_and_one_row_only(monkeypatch):
    qkv, w = torch.zeros(2, 104).to(DEVICE), torch.zeros(36, 64).to(DEVICE)
    monkeypatch.delenv("LATENTSERVE_MLA_QB_NORMS", raising=False)
    assert not qb_norms.supported(qkv[:1], 64, 32, 8, w)
    monkeypatch.setenv("LATENTSERVE_MLA_QB_NORMS", "1")
    assert qb_norms.supported(qkv[:1], 64, 32, 8, w) and not qb_norms.supported(qkv, 64, 32, 8, w)
    assert not qb_norms.supported(qkv[:1], 64, 32, 6, w)  # the widths must add up


@pytest.mark.parametrize("tokens", [[5], [5, 9, 2]])
def test_tokens_through_the_model_give_the_same_logits(tokens, monkeypatch, spy):
    """`tiny` (q in LoRA form, DeepSeek's interleaved rope) in fp32, cache-less: at one token every
    layer takes the one launch, at three none does; the logits are those with it off."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg, device=DEVICE)
    monkeypatch.delenv("LATENTSERVE_MLA_QB_NORMS", raising=False)
    ref = full_logits(model, tokens)
    monkeypatch.setenv("LATENTSERVE_MLA_QB_NORMS", "1")
    calls = spy(torch.ops.latentserve, "mla_qb_norms")
    got = full_logits(model, tokens)
    assert len(calls) == (cfg.num_hidden_layers if len(tokens) == 1 else 0)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and compiled layers")
def test_decode_graphs_with_one_launch_match_the_eager_step_without(monkeypatch):
    """`tiny` in bf16, graphs captured with the switch on at 1 and 4 sequences (its kernel at 1),
    each replay against the eager step with it on and off."""
    steps = graph_steps(monkeypatch, "LATENTSERVE_MLA_QB_NORMS", "1", GRAPH_SHAPES)
    for rows, step in steps.items():
        ours = [n for n in step.kernels if "_qb_norms_kernel" in n]
        assert bool(ours) == (rows == 1), (rows, sorted(set(ours)))
        graph_err, kernel_err = step.errors()
        assert graph_err < 3e-2 and kernel_err < 3e-2, (rows, graph_err, kernel_err)
