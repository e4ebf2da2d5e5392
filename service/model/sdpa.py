"""SDPA of MLA's expanded prefill (causal prompts, masked later chunks): v narrower than q, k.

Two CUDA kernels fit: flash, which needs v padded with zero columns to q's width (a copy of
every value and a third more P.V work), and cuDNN's, which takes v as it is. cuDNN was 4%
faster on an 8 x 1024 prefill of `small` on the H200, but it builds a plan for every new
shape: ~1.3 s for the first in a process, ~60 ms for each one after (bench/RESULTS.md, run
22), and served mixed steps bring a new shape (prompts x length) almost every step, which
made them ~0.4 s each. Flash pays ~20 ms once for any shape. So a shape runs on flash until
the work it has done would have paid for a cuDNN plan, and on cuDNN from then on.

torch 2.11 puts cuDNN first in SDPA's own backend choice on Hopper, masks included: every call
here names its backends, or a prompt's later chunk (masked) built a plan for its shape inside a
served step (~0.9 s in run 23).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .kernel_guard import KernelGuard

_CUDNN = KernelGuard("cudnn_attention")
# What SDPA may choose from when the plan budget has not chosen cuDNN.
_NO_PLANS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Score elements (batch x heads x n x n) a shape must have run on flash before it gets a cuDNN
# plan: ~60 ms of plan against cuDNN's ~0.1 ms saving per 8 x 16 x 1024 x 1024 call (run 22).
PLAN_AFTER = 8e10


class PlanBudget:
    """The work each shape has done on flash: `ready` once it reaches `after`. A server meets a
    new shape for nearly every (prompt count, length) pair, so past `max_shapes` the half that
    did the least work is forgotten (the shapes with plans did the most)."""

    def __init__(self, max_shapes: int = 4096):
        self.work: dict[tuple, float] = {}
        self.max_shapes = max_shapes

    def ready(self, shape: tuple, work: float, after: float) -> bool:
        done = self.work.get(shape, 0.0)
        if done >= after:
            return True
        if shape not in self.work and len(self.work) >= self.max_shapes:
            keep = sorted(self.work.items(), key=lambda kv: kv[1])[len(self.work) // 2:]
            self.work = dict(keep)
        self.work[shape] = done + work
        return False


def _plan_after() -> float:
    """LATENTSERVE_SDPA_CUDNN: "never" (flash only, a bench baseline), "always" (cuDNN from
    the first call of a shape), or unset: after PLAN_AFTER score elements."""
    mode = os.environ.get("LATENTSERVE_SDPA_CUDNN", "")
    return {"never": float("inf"), "always": 0.0}.get(mode, PLAN_AFTER)


PLANS = PlanBudget()


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k [b, heads, n, qk], v [b, heads, n, v_dim <= qk] -> [b, heads, n, v_dim], causal."""
    b, h, n, width = q.shape
    v_dim = v.shape[-1]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and v_dim < width:
        if PLANS.ready((b, h, n, width, v_dim, q.dtype), float(b * h * n * n), _plan_after()):
            o = _CUDNN.call(_cudnn, q, k, v, scale)
            if o is not None:
                return o
        # Zero columns: scores are unchanged and the padded output columns are sliced off.
        v = F.pad(v, (0, width - v_dim))
    with sdpa_kernel(_NO_PLANS):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o[..., :v_dim]


def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, heads, n, qk] over k, v [b, heads, S, qk / v_dim] where mask [n, S] is True: a
    prompt's later chunk against its cached context (memory-efficient attention takes the mask
    and v's own width)."""
    with sdpa_kernel(_NO_PLANS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def warm_up_cudnn(heads: int, width: int, v_dim: int, dtype: torch.dtype, device) -> None:
    """cuDNN's first plan in a process took ~1.3 s on the H200, later ones ~60 ms: paid once at
    startup, so the first shape to earn a plan does not stall a served step for a second."""
    if dtype not in (torch.bfloat16, torch.float16) or _plan_after() == float("inf"):
        return
    q = torch.zeros(1, heads, 16, width, dtype=dtype, device=device)
    _CUDNN.call(_cudnn, q, q, q[..., :v_dim], 1.0)
