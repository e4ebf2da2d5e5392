"""Inputs and error measure shared by the GPU fused-tail tests (virtual ranks and real processes)."""

from __future__ import annotations

import torch

LATENT, HIDDEN, MAX_TOKENS = 160, 256, 128
M_SEQUENCE = (1, 5, 8, 16, 33, 65, 5)
EPS = 1e-6


def tail_inputs(tp: int, m: int, seed: int, dtype: torch.dtype, device):
    """Every rank's partials, with real negative zeros (they must travel as +0.0)."""
    g = torch.Generator().manual_seed(seed)
    routed = [torch.randn(m, LATENT, generator=g) for _ in range(tp)]
    shared = [torch.randn(m, HIDDEN, generator=g) for _ in range(tp)]
    routed[0][0, :4] = -0.0
    shared[-1][0, ::5] = -0.0
    return [x.to(device, dtype) for x in routed], [x.to(device, dtype) for x in shared]


def tail_weights(dtype: torch.dtype, device):
    g = torch.Generator().manual_seed(3)
    up = torch.randn(HIDDEN, LATENT, generator=g) / LATENT**0.5
    norm = torch.rand(LATENT, generator=g) + 0.5
    return up.to(device, dtype), norm.to(device, dtype)


def rel_err(out, ref) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()
    return ((out - ref).abs().max() / ref.abs().max()).item()
