"""Kimi-K3's attention residuals over blocks of layers (`attn_res_block_size`).

Instead of one residual stream, every sublayer reads a softmax mix of its *sources*: the bank
of finished block sums (block 0 is the embeddings, block b the sum of the sublayer outputs of
layers (b-1)*bs .. b*bs-1) and the running sum of the current block. A source's score is
`proj . RMSNorm(source)` (a learned query `proj` [1, H] per sublayer); the mix is
softmax-weighted over the raw sources, then normalised by the sublayer's usual input norm.
"""

from __future__ import annotations

import torch

from .fusion import fused
from .layers import ReplicatedLinear, RMSNorm


def attn_res_mix(prefix: torch.Tensor, delta: torch.Tensor | None, bank: torch.Tensor, num_blocks: int,
                 norm: RMSNorm, proj: ReplicatedLinear, out_norm: RMSNorm | None,
                 write_block: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix, delta [T, H]: the running block sum and the last sublayer's output, not yet in it.
    bank [T, blocks, H]: finished block sums; the first `num_blocks` are sources. With
    write_block >= 0 the updated prefix closes that block (bank[:, write_block] = prefix).
    Returns (updated prefix, sublayer input [T, H])."""
    out_weight = out_norm.weight if out_norm is not None else None
    out_eps = out_norm.eps if out_norm is not None else 0.0
    return _mix(prefix, delta, bank, num_blocks, norm.weight, norm.eps, proj.weight, out_weight, out_eps, write_block)


# One compiled chain on CUDA (~12 small kernels otherwise, twice per layer): K3's attention-residual
# layers are not compiled whole inside the decode graphs (cuda_graph.py compiles their sublayers).
@fused
def _mix(prefix: torch.Tensor, delta: torch.Tensor | None, bank: torch.Tensor, num_blocks: int,
         norm_weight: torch.Tensor, norm_eps: float, proj_weight: torch.Tensor, out_weight: torch.Tensor | None,
         out_eps: float, write_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        prefix = prefix + delta
    if write_block >= 0:
        bank[:, write_block] = prefix
    if num_blocks == 0:  # one source: its softmax weight is exactly 1
        mixed = prefix.float()
    else:
        sources = torch.cat([bank[:, :num_blocks], prefix[:, None]], dim=1).float()  # [T, S, H]
        rstd = torch.rsqrt(sources.pow(2).mean(-1) + norm_eps)  # [T, S]
        query = norm_weight.float() * proj_weight[0].float()  # [H]
        weights = ((sources @ query) * rstd).softmax(dim=-1)  # [T, S]
        mixed = (weights[..., None] * sources).sum(dim=1)
    if out_weight is None:
        return prefix, mixed.to(prefix.dtype)
    rstd = torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps)
    return prefix, (mixed * rstd * out_weight.float()).to(prefix.dtype)
