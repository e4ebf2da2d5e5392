"""The torch ops of KimiDeltaAttention's all-decode step (kda.py's torch path), on host tensors:
the reference the KDA decode kernels (kda_ops.decode_conv, kda_step.decode_step) are held to."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.model.kda import gated_rms_norm, kda_gate, recurrent_step, split_heads


def fresh_mask(positions: torch.Tensor) -> torch.Tensor:
    return (positions == 0).view(-1, 1, 1)


def conv_step(mixed, conv, rows, positions, ws):
    """The short convs: (post-conv q|k|v [B, 3P] in mixed's dtype, the new history rows)."""
    hist = conv.index_select(0, rows)
    hist = torch.where(fresh_mask(positions), torch.zeros((), dtype=hist.dtype), hist)
    window = torch.cat([hist, mixed.unsqueeze(-1).to(hist.dtype)], dim=-1)
    w = torch.cat(ws, dim=0).view(-1, ws[0].shape[-1])
    return F.silu((window.float() * w.float()).sum(-1)).to(mixed.dtype), window[..., 1:]


def decode_step(mixed, conv, rows, positions, ws, raw_g, raw_beta, gate, a_log, dt_bias, norm_weight, recurrent,
                lower_bound, eps):
    """The whole step: (o_proj's input [B, P], the new history rows, the new recurrent rows)."""
    b, heads, d = mixed.shape[0], recurrent.shape[1], recurrent.shape[-1]
    qkv, hist = conv_step(mixed, conv, rows, positions, ws)
    q, k, v = split_heads(qkv, heads, d)
    g = kda_gate(raw_g.view(b, heads, d), dt_bias, a_log, lower_bound)
    beta = torch.sigmoid(raw_beta.float())
    s0 = recurrent.index_select(0, rows)
    s0 = torch.where(fresh_mask(positions).unsqueeze(-1), torch.zeros((), dtype=s0.dtype), s0)
    o, s1 = recurrent_step(q, k, v, g, beta, s0)
    out = gated_rms_norm(o.to(mixed.dtype), norm_weight, gate.view(b, heads, d), eps)
    return out.view(b, heads * d), hist, s1
