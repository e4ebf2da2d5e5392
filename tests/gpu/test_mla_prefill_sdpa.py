"""MLA prefill attention (MLAAttention._expanded) on SDPA's fused kernels, not its math path.

The math path (fp32, 3-D inputs took it) was 115 of 188 ms of an 8 x 1024 prefill on the H200.
Forcing one backend makes SDPA raise where it cannot run, so these fail if the inputs' shape
or layout ever send prefill back to the math path. Values against an fp32 softmax reference.
Causal prompts run on flash with v padded to q's width until their shape has done enough work
to earn a cuDNN plan (model/sdpa.py), then on cuDNN's kernel with v unpadded: both tested here.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from service.config import resolve_model  # noqa: E402
from service.model import sdpa  # noqa: E402
from service.model.attention import MLAAttention  # noqa: E402
from service.model.kernel_guard import KernelGuard  # noqa: E402
from service.parallel import TPGroup  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def reference(attn: MLAAttention, q: torch.Tensor, latent: torch.Tensor, start: int) -> torch.Tensor:
    n, s = q.shape[0], latent.shape[0]
    kv = (latent[:, : attn.kv_lora_rank].float() @ attn.kv_b_proj.weight.float().t()).view(s, attn.num_heads, -1)
    k = torch.cat([kv[..., : attn.nope], latent[:, None, attn.kv_lora_rank:].float().expand(s, attn.num_heads, attn.rope)], -1)
    v = kv[..., attn.nope:]
    scores = torch.einsum("nhd,shd->hns", q.float(), k) * attn.scale
    visible = torch.arange(s, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hns,shd->nhd", p, v)


@pytest.mark.parametrize("n,start,backend", [(1024, 0, SDPBackend.FLASH_ATTENTION),
                                             (256, 512, SDPBackend.EFFICIENT_ATTENTION)])
def test_prefill_attention_runs_fused(n, start, backend, monkeypatch):
    monkeypatch.setenv("LATENTSERVE_SDPA_CUDNN", "never")
    cfg, _ = resolve_model("small")
    torch.manual_seed(0)
    attn = MLAAttention(cfg, TPGroup.single(), 0, torch.bfloat16).cuda()
    with torch.no_grad():
        attn.kv_b_proj.weight.normal_(0, 0.05)
        q = torch.randn(n, attn.num_heads, attn.qk_dim, device="cuda", dtype=torch.bfloat16)
        latent = torch.randn(start + n, cfg.kv_cache_dim, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel([backend]):  # raises if SDPA cannot use it for these inputs
            out = attn._expanded(q, latent, start)
        want = reference(attn, q, latent, start)
    assert out.shape == (n, attn.num_heads, attn.v_dim)
    err = (out.float() - want).abs().max().item()
    assert err < 0.03 * want.abs().max().item() + 1e-2, err


@pytest.mark.parametrize("cudnn", ["never", "always"])
def test_prompts_batched_by_length_run_fused(cudnn, monkeypatch):
    """Whole prompts of one length attend as one batch [n, heads, len, dim] (_whole_prompts):
    on flash attention with v padded, and on cuDNN's with v as it is, as views of the step's
    back-to-back tokens."""
    monkeypatch.setenv("LATENTSERVE_SDPA_CUDNN", cudnn)
    cfg, _ = resolve_model("small")
    torch.manual_seed(0)
    attn = MLAAttention(cfg, TPGroup.single(), 0, torch.bfloat16).cuda()
    n, length = 8, 256
    with torch.no_grad():
        attn.kv_b_proj.weight.normal_(0, 0.05)
        q = torch.randn(n * length, attn.num_heads, attn.qk_dim, device="cuda", dtype=torch.bfloat16)
        latent = torch.randn(n * length, cfg.kv_cache_dim, device="cuda", dtype=torch.bfloat16)
        k, v = attn._keys_values(latent)
        shape = (n, length, attn.num_heads)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # the cuDNN path picks its own backend inside
            out = attn._attend(q.view(*shape, -1), k.view(*shape, -1), v.reshape(*shape, -1), 0)
        if cudnn == "always":
            assert sdpa._CUDNN.failure is None, f"cuDNN attention is off: {sdpa._CUDNN.failure}"
            assert str(sdpa._cudnn) in sdpa._CUDNN._verified
        for i in (0, n - 1):
            s = slice(i * length, (i + 1) * length)
            want = reference(attn, q[s], latent[s], 0)
            err = (out[i].float() - want).abs().max().item()
            assert err < 0.03 * want.abs().max().item() + 1e-2, err


def test_shape_moves_to_cudnn_once_its_work_pays_for_a_plan(monkeypatch):
    """Default policy: flash for a shape's first calls, cuDNN once PLAN_AFTER score elements have
    run on flash; both agree with each other."""
    monkeypatch.delenv("LATENTSERVE_SDPA_CUDNN", raising=False)
    monkeypatch.setattr(sdpa, "PLANS", sdpa.PlanBudget())
    b, h, n = 2, 16, 256
    monkeypatch.setattr(sdpa, "PLAN_AFTER", 3 * b * h * n * n)
    torch.manual_seed(0)
    q, k = (torch.randn(b, h, n, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(sdpa, "_CUDNN", KernelGuard("cudnn_attention"))
    flash = [sdpa.causal(q, k, v, 0.1) for _ in range(3)]
    assert str(sdpa._cudnn) not in sdpa._CUDNN._verified  # three calls' work: still flash
    cudnn = sdpa.causal(q, k, v, 0.1)
    assert sdpa._CUDNN.failure is None and str(sdpa._cudnn) in sdpa._CUDNN._verified
    assert cudnn.shape == flash[0].shape == (b, h, n, 128)
    assert (cudnn.float() - flash[0].float()).abs().max().item() < 2e-2
