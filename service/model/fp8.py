"""FP8 block-scaled projections (service/weights/fp8.py has the format): the model's FP8
parameters, and `x @ dequant(W, scale_inv)^T` for layers.linear.

- `quantize_parameters`: after the model is built (on meta or a device), every FP8 weight of
  the weight table becomes a `float8_e4m3fn` parameter with a `<name>_scale_inv` fp32 parameter
  next to it, so the memory pool holds both as weights (level-2 sleep discards both, reload and
  updates restore both). MLA's kv_b and the latent up-projection stay in the model dtype
  (fp8.HELD_DEQUANTIZED says why).
- `linear_fp8`: on CUDA a Triton kernel reading the FP8 weight (half the bytes of bf16: what a
  memory-bound decode step pays for) and dequantizing it in registers per 128x128 block, bf16
  tensor-core dots against the activation (W8A16; no activation quantization error). Elsewhere
  (CPU, shapes the kernel does not take) the torch reference: dequantize, then F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..weights import fp8 as fmt
from ..weights.specs import check_fp8_layout, weight_specs
from . import gemv, moe_kernels, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

FP8 = fmt.FP8


def quantize_parameters(model: nn.Module, cfg: ModelConfig, world_size: int) -> None:
    """Make the model's FP8 weights FP8 parameters with their scales (no-op for a plain model).
    ConfigError when TP shards or stacked tensors would cut a block."""
    block = fmt.fp8_block(cfg)
    if block is None:
        return
    check_fp8_layout(cfg, world_size)
    names = {s.param for s in weight_specs(cfg) if fmt.is_fp8_weight(s) and fmt.held_fp8(s.param)}
    for name in sorted(names):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        old = getattr(module, attr)
        setattr(module, attr, nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False))
        scale = torch.empty(fmt.scale_shape(tuple(old.shape), block), dtype=torch.float32, device=old.device)
        module.register_parameter(attr + fmt.SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))


def is_fp8(weight: torch.Tensor) -> bool:
    return weight.dtype == FP8


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return fmt.dequantize(weight, scale, None, dtype)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K] fp8, scale [ceil(N/bn), ceil(K/bk)])^T in x's dtype."""
    # Scale blocks at least 16 wide (implied_block: powers of 2): tl.dot's smallest K step.
    if gemm_supported(x, weight) and fmt.block_of(weight, scale)[1] >= 16:
        out = moe_kernels.call(torch.ops.latentserve.fp8_linear, x.reshape(-1, x.shape[-1]), weight, scale)
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, dequantize(weight, scale, x.dtype))


def gemm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    on_device = triton is not None and moe_kernels.enabled() and (x.is_cuda or moe_kernels.INTERPRET)
    return on_device and fmt.kernel_operands(x, weight, moe_kernels.INTERPRET)


if triton is not None:

    @triton.jit
    def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                      BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """out[m, n] = sum_k x[m, k] * w[n, k] * s[n // BN, k // BK]: each weight tile is read
        once as FP8, scaled by its block's scale in fp32 and rounded to x's dtype for the dot.
        BLOCK_K divides BK, so a K step lies in one scale block: one scale per column per step
        (a [BLOCK_N] vector; per element it was a [BLOCK_K, BLOCK_N] fp32 tile, 4x the weight's
        bytes through shared memory: 240 KB at 64 x 128 tiles and 3 stages on the H200)."""
        pdl.enter(PDL)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask, nmask = m < M, n < N
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]  # the tile as [BLOCK_K, BLOCK_N], K-major
            wv = tl.load(w_ptr + k[:, None] + n[None, :] * stride_wn, mask=wmask, other=0.0).to(tl.float32)
            sv = tl.load(s_ptr + k0 // BK + (n // BN) * stride_sn, mask=nmask, other=0.0)
            acc = tl.dot(xv, (wv * sv[None, :]).to(dtype), acc)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(dtype), mask=mmask[:, None] & nmask[None, :])


if triton is not None:

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr,
                          PDL: tl.constexpr):
        """One token's group of GROUP activations: scale = amax / 448, q = x / scale in FP8."""
        pdl.enter(PDL)
        row, g = tl.program_id(0), tl.program_id(1)
        k = g * GROUP + tl.arange(0, GROUP)
        kmask = k < K
        v = tl.load(x_ptr + row * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(v), 0), 1e-12) / 448.0
        q = tl.clamp(v / s, -448.0, 448.0)
        tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=kmask)
        tl.store(s_ptr + row * stride_sm + g, s)

    @triton.jit
    def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_am, stride_asm, stride_wn, stride_wsn,
                     stride_om, BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PDL: tl.constexpr):
        """out = sum over K blocks of (a_q . w_q^T) in FP8 tensor cores (fp32 accumulate), each
        block's partial scaled by its token-group scale (rows) and weight block scale (columns)."""
        pdl.enter(PDL)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask, nmask = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            k = kb * BK + tl.arange(0, BK)
            kmask = k < K
            a = tl.load(a_ptr + m[:, None] * stride_am + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            # The weight tile loaded K-major [BK, BLOCK_N] through its strides (as vLLM's
            # w8a8_block_fp8_matmul), not transposed in registers: what Hopper's FP8 MMA takes.
            w = tl.load(w_ptr + k[:, None] + n[None, :] * stride_wn, mask=kmask[:, None] & nmask[None, :], other=0.0)
            a_s = tl.load(as_ptr + m * stride_asm + kb, mask=mmask, other=0.0)
            w_s = tl.load(ws_ptr + (n // BN) * stride_wsn + kb, mask=nmask, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out, mask=mmask[:, None] & nmask[None, :])


if triton is not None:

    @triton.jit
    def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_s, stride_y,
                         BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
        """gemv.py's bandwidth-shaped decode GEMM on FP8 rows: BLOCK_N output rows per program
        (the grid covers every SM twice), K streamed in steps of BLOCK_K // SUB scale blocks
        (SUB = min(BK, BLOCK_K)), the weight tile scaled elementwise: at one row `row_times`, fp32
        throughout; from two `rows_times`. The first weight and scale tiles are loaded before the
        PDL wait (weights only, as in gemv.py)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        if BLOCK_M == 1:
            acc1 = row_times(x_ptr, w_ptr, s_ptr, n, nmask, K, stride_w, stride_s, BN, BK, BLOCK_K, SUB, PDL)
            tl.store(y_ptr + n, acc1.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
            mmask = m < M
            acc = rows_times(x_ptr, w_ptr, s_ptr, m, n, mmask, nmask, K, stride_x, stride_w, stride_s, BN, BK,
                             BLOCK_M, BLOCK_N, BLOCK_K, SUB, PDL)
            tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def row_times(x_ptr, w_ptr, s_ptr, n, nmask, K, stride_w, stride_s, BN: tl.constexpr, BK: tl.constexpr,
                  BLOCK_K: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
        """One row x @ dequant(w)[n]^T in fp32 ([BLOCK_N]): the products accumulated elementwise
        and reduced once at the end (per-step reductions made the kernel 3x slower than the bf16
        GEMV for half the bytes). Shared with moe_entry's FP8 latent down-projection."""
        kblocks = tl.cdiv(K, BK)
        rows = w_ptr + n[:, None].to(tl.int64) * stride_w
        k = tl.arange(0, BLOCK_K)
        kmask = k < K
        w0 = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        s0 = gemv.scale_tile(s_ptr, n, 0, stride_s, kblocks, nmask, BN, BK, BLOCK_K, SUB)
        pdl.enter(PDL)
        acc = w0.to(tl.float32) * s0 * tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            scale = gemv.scale_tile(s_ptr, n, k0, stride_s, kblocks, nmask, BN, BK, BLOCK_K, SUB)
            acc += w * scale * tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        return tl.sum(acc, 1)

    @triton.jit
    def rows_times(x_ptr, w_ptr, s_ptr, m, n, mmask, nmask, K, stride_x, stride_w, stride_s, BN: tl.constexpr,
                   BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SUB: tl.constexpr, PDL: tl.constexpr):
        """x[m] @ dequant(w)[n]^T in fp32 from 2 rows: the bf16 GEMV's tensor-core tiles (`dot_config`),
        rows padded to BLOCK_M, each weight tile scaled in fp32 and rounded to x's dtype for the dot
        (the W8A16 kernel's roundings). The first weight and scale tiles before the PDL wait.
        Shared with moe_entry's FP8 latent down-projection."""
        kblocks = tl.cdiv(K, BK)
        rows = w_ptr + n[:, None].to(tl.int64) * stride_w
        dtype = x_ptr.dtype.element_ty
        k = tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        scale = gemv.scale_tile(s_ptr, n, 0, stride_s, kblocks, nmask, BN, BK, BLOCK_K, SUB)
        pdl.enter(PDL)
        xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(xv, tl.trans((w.to(tl.float32) * scale).to(dtype)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(rows + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            scale = gemv.scale_tile(s_ptr, n, k0, stride_s, kblocks, nmask, BN, BK, BLOCK_K, SUB)
            xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(xv, tl.trans((w.to(tl.float32) * scale).to(dtype)), acc)
        return acc

def gemv_max_rows() -> int:
    """Up to this many rows FP8 projections take the GEMV's shapes (one row: the register product;
    from 2 rows tensor-core tiles over narrow outputs, `dot_config`); above, the W8A16 kernel's
    64-128-wide output tiles. Those left most SMs idle at decode batches (o_proj at 8 rows: 32
    programs on 132 SMs), and FP8 decode took 1.00 / 1.06x bf16's time at batches 8 / 64 for half
    the weight bytes (run 31). LATENTSERVE_FP8_GEMV_MAX_ROWS (1: the one-row GEMV only, the
    bench's baseline `fp8_wide_tiles`; 256 with LATENTSERVE_FP8_W8A8_MIN_ROWS above it: 64-row
    blocks up to 256, `fp8_gemv_256`); none with the GEMV off (LATENTSERVE_GEMV_MAX_ROWS=0)."""
    return int(os.environ.get("LATENTSERVE_FP8_GEMV_MAX_ROWS", "64")) if gemv.max_rows() > 0 else 0


def dot_config(m: int, n: int, k: int, sms: int) -> dict:
    """The FP8 GEMV's launch shape from 2 rows: gemv.dot_config's rows and outputs a program, K
    steps of up to 512 FP8 columns while a stage's x and weight tiles fit 40 KB (5 of them at 4
    stages, as there) and the scaled fp32 tile stays at 8K elements (64 registers a thread)."""
    bm, bn = gemv.rows_tile(m, True), max(16, gemv.block_n(n, sms))
    if m > bm:  # 64-row blocks: wider outputs a program, as gemv.dot_config's, for fewer x re-reads
        bn = gemv.tall_block_n(m, n, bm, sms)
    bk = max(16, min(512, triton.next_power_of_2(k)))
    while bk > 32 and ((2 * bm + bn) * bk > 40 * 1024 or bn * bk > 8192):
        bk //= 2
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4}


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    bn, bk = fmt.block_of(weight, scale)
    # Small M (decode): narrow N tiles so even one token spreads the weight over many SMs.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    if m <= gemv_max_rows() and m < w8a8_min_rows():  # decode rows: bandwidth-shaped
        sms = gemv.sm_count(x.device)
        cfg = {"BLOCK_M": 1, **gemv.config(m, n, k, sms, max_k=1024)} if m == 1 else dot_config(m, n, k, sms)
        _gemv_fp8_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))](
            x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            BN=bn, BK=bk, SUB=min(bk, cfg["BLOCK_K"]), **cfg, **pdl.launch(x.device))
        return out
    if m >= w8a8_min_rows() and bk in (64, 128, 256):
        return _linear_w8a8(x, weight, scale, out, bn, bk)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # Shared memory (sm_90, Triton 3.6, bf16, compiled offline): 24-113 KB at these tiles and 3 stages (limit 227).
    _w8a16_kernel[grid](x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), scale.stride(0),
                        out.stride(0), BN=bn, BK=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(128, bk),
                        num_warps=4, num_stages=3, **pdl.launch(x.device))
    return out


def w8a8_min_rows() -> int:
    """From this many rows on, FP8 x FP8 tensor cores (activations quantized per token and
    128-wide group, as DeepSeek-V3's inference code and vLLM's w8a8_block_fp8_matmul): twice
    bf16's peak, where prefill and big batches are compute-bound. Fewer rows are memory-bound:
    W8A16 reads the same FP8 weight bytes without the activations' quantization error."""
    return int(os.environ.get("LATENTSERVE_FP8_W8A8_MIN_ROWS", "128"))


def _linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, bn: int,
                 bk: int) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    groups = triton.cdiv(k, bk)
    xq = torch.empty(m, k, dtype=weight.dtype, device=x.device)
    xs = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    _act_quant_kernel[(m, groups)](x, xq, xs, k, x.stride(0), xq.stride(0), xs.stride(0), GROUP=bk, num_warps=4,
                                   **pdl.launch(x.device))
    block_m = 64 if m <= 256 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 128))
    _w8a8_kernel[grid](xq, xs, weight, scale, out, m, n, k, xq.stride(0), xs.stride(0), weight.stride(0),
                       scale.stride(0), out.stride(0), BN=bn, BK=bk, BLOCK_M=block_m, BLOCK_N=128,
                       num_warps=8 if block_m == 128 else 4, num_stages=3, **pdl.launch(xq.device))
    return out


if triton is not None:

    @torch.library.custom_op("latentserve::fp8_linear", mutates_args=())
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ dequant(weight [N, K], scale)^T -> [M, N] in x's dtype."""
        return _linear(x, weight, scale)

    @fp8_linear.register_fake
    def _(x, weight, scale):
        return x.new_empty(x.shape[0], weight.shape[0])
