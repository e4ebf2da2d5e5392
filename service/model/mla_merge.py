"""The merge of the MLA decode kernel's splits (mla_decode.py): each (sequence, head)'s split
outputs weighted by their log-sum-exps, either into the latent output the W_UV absorb takes next
(`merge`), or straight through W_UV into o_proj's row (`merge_out`, one launch fewer).
"""

from __future__ import annotations

import os

import torch

from . import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the torch path in attention.py is used
    triton = None

if triton is not None:

    @triton.jit
    def _merged(o_ptr, lse_ptr, b, h, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D_LAT: tl.constexpr):
        """Sequence b's head h: the log-sum-exp weighted mean of its splits' outputs [D_LAT], fp32."""
        s = tl.arange(0, S_PAD)
        smask = s < NUM_SPLITS
        lse = tl.load(lse_ptr + b * stride_lb + s * stride_ls + h, mask=smask, other=float("-inf"))
        # Split 0 is never empty (context >= 1), so the max is finite; empty splits weigh 0.
        w = tl.exp(lse - tl.max(lse, 0))
        d = tl.arange(0, D_LAT)
        o = tl.load(o_ptr + b * stride_ob + s[:, None] * stride_os + h * stride_oh + d[None, :],
                    mask=smask[:, None], other=0.0)
        return tl.sum(o * w[:, None], 0) / tl.sum(w, 0)

    @triton.jit
    def _mla_decode_merge(o_ptr, lse_ptr, out_ptr, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                          num_heads, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, D_LAT: tl.constexpr,
                          PDL: tl.constexpr):
        """One program per (sequence, head): the log-sum-exp weighted mean of its splits."""
        pdl.enter(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        out = _merged(o_ptr, lse_ptr, b, h, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, NUM_SPLITS,
                      S_PAD, D_LAT)
        tl.store(out_ptr + (b * num_heads + h) * D_LAT + tl.arange(0, D_LAT), out)

    @triton.jit
    def _merge_out_kernel(o_ptr, lse_ptr, w_ptr, out_ptr, J, stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                          stride_wh, stride_wj, stride_out, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                          D_LAT: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
        """Program (sequence, head, block of outputs): the head's merged output (`_merged`, as the
        merge kernel computes it), rounded to the weight's dtype, times W_UV[h] rows j (a register
        product: a few sequences, no 16-row padding), written to o_proj's row. W_UV's tile is read
        before the PDL wait."""
        b = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
        jmask = j < J
        d = tl.arange(0, D_LAT)
        w = tl.load(w_ptr + h * stride_wh + j[:, None] * stride_wj + d[None, :], mask=jmask[:, None], other=0.0)
        pdl.enter(PDL)
        merged = _merged(o_ptr, lse_ptr, b, h, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, NUM_SPLITS,
                         S_PAD, D_LAT).to(w.dtype).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * merged[None, :], 1)
        tl.store(out_ptr + b * stride_out + h * J + j, y.to(out_ptr.dtype.element_ty), mask=jmask)


def merge_out_max_rows() -> int:
    """Up to this many sequences the split merge and `absorb_out` are one kernel (`merge_out`),
    one launch fewer a layer (LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS; 0: never, bench/gpu.py's
    `merge_out_off`). One by default since run 47 (2026-12-05, H200): batch 1 1.674 ms, 0.95x of
    the same run's step without it (1.770, that build's one other change acting at one row); up to
    8 rows batch 8 took 3.271 ms against 3.148 (1.04x), each program then reading W_UV's slice
    for its one sequence."""
    return int(os.environ.get("LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS", "1"))


def merge_out(o: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o [B, S, H, L] fp32 and lse [B, S, H] (the split kernel's) against w_uv [H, v, L] ->
    [B, H * v] in w_uv's dtype: mla_absorb's `absorb_out` of the merged output, one kernel."""
    b, splits, h, lat = o.shape
    v = w_uv.shape[1]
    out = torch.empty(b, h * v, dtype=w_uv.dtype, device=o.device)
    block_j = 16 if lat >= 512 else 32  # the W tile in registers: 16 x 512 bf16 a program
    _merge_out_kernel[(b, h, triton.cdiv(v, block_j))](
        o, lse, w_uv, out, v, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        w_uv.stride(0), w_uv.stride(1), out.stride(0), NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits),
        D_LAT=lat, BLOCK_J=block_j, num_warps=4, **pdl.launch(o.device))
    return out


def merge(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [B, S, H, L] fp32 and lse [B, S, H] (the split kernel's) -> the merged [B, H, L] fp32."""
    b, splits, h, lat = o.shape
    out = torch.empty(b, h, lat, dtype=torch.float32, device=o.device)
    _mla_decode_merge[(b, h)](o, lse, out, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                              h, NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits), D_LAT=lat,
                              num_warps=4, **pdl.launch(o.device))
    return out
