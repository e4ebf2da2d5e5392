"""Kimi-K3's attention residuals over blocks of layers (`attn_res_block_size`).

Instead of one residual stream, every sublayer reads a softmax mix of its *sources*: the bank
of finished block sums (block 0 is the embeddings, block b the sum of the sublayer outputs of
layers (b-1)*bs .. b*bs-1) and the running sum of the current block. A source's score is
`proj . RMSNorm(source)` (a learned query `proj` [1, H] per sublayer); the mix is
softmax-weighted over the raw sources, then normalised by the sublayer's usual input norm.
"""

from __future__ import annotations

import os

import torch

from . import pdl
from .fusion import fused
from .layers import ReplicatedLinear, RMSNorm

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch chain runs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_enabled(x: torch.Tensor) -> bool:
    """The mix as one Triton kernel (`mix_kernel`) on CUDA, on by default (LATENTSERVE_ATTN_RES_KERNEL=0:
    the compiled torch chain, Inductor's kernels and the bank write, twice a layer). Run 61 (H100):
    with MLA's gate in W_UV's kernel, K3's decode step 0.85x / 0.88x / 0.92x of the chain's."""
    return (os.environ.get("LATENTSERVE_ATTN_RES_KERNEL", "1") == "1" and triton is not None
            and (x.is_cuda or INTERPRET) and x.dim() == 2 and x.stride(-1) == 1)


def attn_res_mix(prefix: torch.Tensor, delta: torch.Tensor | None, bank: torch.Tensor, num_blocks: int,
                 norm: RMSNorm, proj: ReplicatedLinear, out_norm: RMSNorm | None,
                 write_block: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix, delta [T, H]: the running block sum and the last sublayer's output, not yet in it.
    bank [T, blocks, H]: finished block sums; the first `num_blocks` are sources. With
    write_block >= 0 the updated prefix closes that block (bank[:, write_block] = prefix).
    Returns (updated prefix, sublayer input [T, H])."""
    out_weight = out_norm.weight if out_norm is not None else None
    out_eps = out_norm.eps if out_norm is not None else 0.0
    if kernel_enabled(prefix):
        return mix_kernel(prefix, delta, bank, num_blocks, norm.weight, norm.eps, proj.weight, out_weight, out_eps,
                          write_block)
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


if triton is not None:

    @triton.jit
    def _score(src, query, H, eps):
        """proj . RMSNorm(src): the norm's weight is folded into query."""
        return tl.sum(src * query, 0) * tl.rsqrt(tl.sum(src * src, 0) / H + eps)

    @triton.jit
    def _mix_kernel(prefix_ptr, delta_ptr, bank_ptr, norm_w_ptr, proj_w_ptr, out_w_ptr, new_prefix_ptr, out_ptr, H,
                    stride_p, stride_d, stride_bt, stride_bb, stride_np, stride_o, norm_eps, out_eps,
                    NUM_BLOCKS: tl.constexpr, WRITE_BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                    OUT_NORM: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """Program t: token t's row. The softmax over the sources is online (one pass over the
        bank's rows, each read once), the prefix first; the weights are read before the PDL wait."""
        t = tl.program_id(0).to(tl.int64)
        hs = tl.arange(0, BLOCK_H)
        hmask = hs < H
        query = (tl.load(norm_w_ptr + hs, mask=hmask, other=0.0).to(tl.float32)
                 * tl.load(proj_w_ptr + hs, mask=hmask, other=0.0).to(tl.float32))
        if OUT_NORM:
            out_w = tl.load(out_w_ptr + hs, mask=hmask, other=0.0).to(tl.float32)
        pdl.enter(PDL)
        p = tl.load(prefix_ptr + t * stride_p + hs, mask=hmask, other=0.0)
        if HAS_DELTA:  # rounded to the stream's dtype, as the torch add
            p = (p.to(tl.float32) + tl.load(delta_ptr + t * stride_d + hs, mask=hmask, other=0.0).to(tl.float32)
                 ).to(p.dtype)
        tl.store(new_prefix_ptr + t * stride_np + hs, p, mask=hmask)
        if WRITE_BLOCK >= 0:
            tl.store(bank_ptr + t * stride_bt + WRITE_BLOCK * stride_bb + hs, p, mask=hmask)
        mixed = p.to(tl.float32)
        if NUM_BLOCKS > 0:
            m = _score(mixed, query, H, norm_eps)
            total = 1.0
            for s in tl.static_range(NUM_BLOCKS):
                if s == WRITE_BLOCK:  # written just above, as the prefix
                    src = p.to(tl.float32)
                else:
                    src = tl.load(bank_ptr + t * stride_bt + s * stride_bb + hs, mask=hmask, other=0.0).to(tl.float32)
                score = _score(src, query, H, norm_eps)
                m_new = tl.maximum(m, score)
                alpha = tl.exp(m - m_new)
                w = tl.exp(score - m_new)
                mixed = mixed * alpha + w * src
                total = total * alpha + w
                m = m_new
            mixed = mixed / total
        if OUT_NORM:
            mixed = mixed * tl.rsqrt(tl.sum(mixed * mixed, 0) / H + out_eps) * out_w
        tl.store(out_ptr + t * stride_o + hs, mixed.to(out_ptr.dtype.element_ty), mask=hmask)


def _mix_launch(prefix, delta, bank, num_blocks, norm_weight, norm_eps, proj_weight, out_weight, out_eps, write_block):
    t, h = prefix.shape
    if bank.shape[0] != t or bank.shape[-1] != h or bank.stride(-1) != 1 or num_blocks > bank.shape[1] or (
            delta is not None and (delta.shape != prefix.shape or delta.stride(-1) != 1)):
        raise ValueError(f"attention-residual mix: prefix {tuple(prefix.shape)}, bank {tuple(bank.shape)}, "
                         f"{num_blocks} sources do not fit")
    new_prefix, out = torch.empty_like(prefix), torch.empty_like(prefix)
    if t == 0:
        return new_prefix, out
    block_h = triton.next_power_of_2(h)
    _mix_kernel[(t,)](
        prefix, delta if delta is not None else prefix, bank, norm_weight, proj_weight,
        out_weight if out_weight is not None else norm_weight, new_prefix, out, h, prefix.stride(0),
        delta.stride(0) if delta is not None else 0, bank.stride(0), bank.stride(1), new_prefix.stride(0),
        out.stride(0), norm_eps, out_eps, NUM_BLOCKS=num_blocks, WRITE_BLOCK=write_block,
        HAS_DELTA=delta is not None, OUT_NORM=out_weight is not None, BLOCK_H=block_h,
        # four fp32 rows in registers: 16 values a thread at 2048 wide on 4 warps
        num_warps=max(4, min(16, block_h // 512)), **pdl.launch(prefix.device))
    return new_prefix, out


@torch.library.custom_op("latentserve::attn_res_mix", mutates_args=("bank",))
def mix_kernel(prefix: torch.Tensor, delta: torch.Tensor | None, bank: torch.Tensor, num_blocks: int,
               norm_weight: torch.Tensor, norm_eps: float, proj_weight: torch.Tensor, out_weight: torch.Tensor | None,
               out_eps: float, write_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_mix` as one Triton kernel (same arguments, same results): one program a token."""
    return _mix_launch(prefix, delta, bank, num_blocks, norm_weight, norm_eps, proj_weight, out_weight, out_eps,
                       write_block)


@mix_kernel.register_fake
def _(prefix, delta, bank, num_blocks, norm_weight, norm_eps, proj_weight, out_weight, out_eps, write_block):
    return torch.empty_like(prefix), torch.empty_like(prefix)
