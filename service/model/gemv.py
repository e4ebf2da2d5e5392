"""Bandwidth-shaped GEMM for the few rows of a decode step: y[M, N] = x[M, K] @ W[N, K]^T.

At M <= 16 a projection is a read of W and nothing else, so its speed is how many bytes of W
are in flight. cuBLAS picks tensor-core tiles for these shapes (nvjet 64x8, 16x64, ...) that
leave most of the H200's bandwidth unused: the profile in bench/RESULTS.md shows the dense
projections at ~0.9 TB/s, 40% of a batch-1 step. Here each program owns a few output rows
(BLOCK_N, chosen so the grid covers every SM twice) and streams them over K with fp32
accumulation; the M rows of x are re-read from L1/L2, never from HBM twice. One row multiplies
in registers; from two rows the rows are padded to a tensor-core tile (`dot_config`). No split-K, so
no atomics and no second kernel: results are deterministic, and equal between a CUDA graph
replay and an eager call. Tried and removed (run 78, H100): split-K at 2-64 rows where the busiest
SM's bytes were fewer: steps 0.98-1.01x.

A `torch.library` custom op, so compiled decoder layers keep it opaque and graphs capture it.
`supported` decides; `layers.linear` calls it.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

from ..weights.fp8 import block_of, kernel_operands
from . import gemv_cuda, pdl
from .kernel_guard import KernelGuard

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GUARD = KernelGuard("gemv")  # a first-call failure turns the GEMVs off: cuBLAS then


def max_rows() -> int:
    """Up to this many rows the GEMV runs (LATENTSERVE_GEMV_MAX_ROWS; 1: the register product
    only, 0: cuBLAS throughout, the bench's baselines). 64 by default: from 2 rows it runs on
    tensor-core tiles, faster than cuBLAS at every projection of a decoder layer (bench/gemv.py,
    run 35, 2026-12-04: e.g. fused_qkv_a at 8 rows 4.5 us, cuBLAS 6.2); decode steps against
    cuBLAS from 2 rows: batch 8 0.93x, batch 64 0.98x (runs 35-36). Above 64 rows in blocks of
    64 (`dot_config`)."""
    return int(os.environ.get("LATENTSERVE_GEMV_MAX_ROWS", "64"))


# Above this many weight elements cuBLAS streams at ~3.7 TB/s (lm_head: 36 us for 134 MB at one
# row, ours 45 us at best): the GEMV is for the many small projections of a layer.
MAX_WEIGHT_ELEMENTS = 16 << 20


def pair_supported(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                   scale2: torch.Tensor | None = None) -> bool:
    """Both projections GEMV-shaped, into the same rows and width (LATENTSERVE_GEMV_PAIR=0: two
    launches and an add, the bench's baseline); scale2: weight2 FP8 block-scaled (blocks >= 16
    wide, 16-bit rows: the FP8 GEMV's conditions)."""
    if os.environ.get("LATENTSERVE_GEMV_PAIR", "1") == "0" or not supported(x, weight):
        return False
    if scale2 is None:
        second = supported(x2, weight2)
    else:
        second = (kernel_operands(x2, weight2, INTERPRET) and x2.dtype == x.dtype and weight2.dim() == 2
                  and x2.shape[-1] == weight2.shape[1] and weight2.numel() <= MAX_WEIGHT_ELEMENTS
                  and block_of(weight2, scale2)[1] >= 16)
    return second and weight.shape[0] == weight2.shape[0] and x.numel() // x.shape[-1] == x2.numel() // x2.shape[-1]


def pair_norm_max_rows() -> int:
    """Up to this many rows the latent MoE's RMS norm runs inside the paired GEMV
    (`gemv_pair_normed`), not as a kernel of its own before it: at one row the step was 0.99x
    (1.4 us a layer for the norm kernel without PDL); at 8 and 64 rows 1.02x and 1.03x slower, each
    program's pass over the rows for their norms costing more than the launch (run 46,
    2026-12-04). LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS (0: never, the bench's `pair_norm_off`)."""
    return int(os.environ.get("LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS", "1"))


def pair_slots_enabled() -> bool:
    """Where the pair norm runs, the routed experts' slot sum too (MoE._slots_tail). 0.99x at batch 1
    in runs 51 and 58, inside their noise; the default since runs 105-106 with the other switches
    of bench/gpu.py's `small_stack_off`. LATENTSERVE_GEMV_PAIR_SLOTS=0: a kernel of its own."""
    return os.environ.get("LATENTSERVE_GEMV_PAIR_SLOTS", "1") == "1"


def pair_early() -> bool:
    """At one row, the pair's second weight (16-bit) requests its first tile before the PDL wait
    too, as the first weight does. That tile is all of it: the latent MoE's shared down-projection
    (3.1 MB at `small`) then streams during the experts' down kernel, not after it.
    LATENTSERVE_GEMV_PAIR_EARLY=1 (a candidate, bench `gemv_pair_early`)."""
    return os.environ.get("LATENTSERVE_GEMV_PAIR_EARLY", "0") == "1"


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if triton is None or GUARD.failure is not None or not (x.is_cuda or INTERPRET) or weight.dim() != 2:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return (0 < rows <= max_rows() and x.dtype == weight.dtype and x.dtype in _DTYPES
            and weight.stride(-1) == 1 and x.shape[-1] == weight.shape[1] and weight.numel() <= MAX_WEIGHT_ELEMENTS)


def run(op, *args) -> torch.Tensor | None:
    """op(*args) (`gemv` or `gated_gemv`), or None when its first call in this process fails
    (`KernelGuard`): callers then use cuBLAS."""
    return GUARD.call(op, *args)


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H200's count, so the shapes match the GPU's
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def block_n(n: int, sms: int = 132) -> int:
    """Rows per program: the largest power of 2 (4..64) that still gives >= 2 programs per SM."""
    b = 64
    while b > 4 and triton.cdiv(n, b) < 2 * sms:
        b //= 2
    return b


if triton is not None:

    @triton.jit
    def _product(acc, xv, w, DOT: tl.constexpr, IEEE: tl.constexpr):
        """acc + xv @ w^T: on tensor cores (DOT, rows padded to 16; 16-bit products are exact in
        the fp32 sums, fp32 ones IEEE), or as a register product (one row: no padding to pay)."""
        if DOT:
            if IEEE:
                return tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
            return tl.dot(xv, tl.trans(w), acc)
        return acc + tl.sum(xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)

    @triton.jit
    def _x_rows(x_ptr, m, k, mmask, kmask, stride_x, g_ptr, SLOTS: tl.constexpr):
        """Rows m of x at columns k; with SLOTS each row is the fp32 sum of SLOTS consecutive rows
        (a token's expert outputs, in slot order as moe_kernels.slot_sum adds them), rounded to
        the norm weight's dtype."""
        mask = mmask[:, None] & kmask[None, :]
        if SLOTS:
            total = tl.load(x_ptr + (m[:, None] * SLOTS) * stride_x + k[None, :], mask=mask, other=0.0)
            for j in tl.static_range(1, SLOTS):
                total += tl.load(x_ptr + (m[:, None] * SLOTS + j) * stride_x + k[None, :], mask=mask, other=0.0)
            xv = total.to(g_ptr.dtype.element_ty)
        else:
            xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mask, other=0.0)
        return xv

    @triton.jit
    def _x_tile(x_ptr, m, k, mmask, kmask, stride_x, inv_rms, g_ptr, NORM: tl.constexpr, SLOTS: tl.constexpr):
        """`_x_rows`; with NORM those rows RMS-normed (x * inv_rms * g, rounded to x's dtype as
        rms_norm rounds its output)."""
        xv = _x_rows(x_ptr, m, k, mmask, kmask, stride_x, g_ptr, SLOTS)
        if NORM:
            g = tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            xv = (xv.to(tl.float32) * inv_rms[:, None] * g[None, :]).to(xv.dtype)
        return xv

    @triton.jit
    def _inv_rms(x_ptr, m, mmask, K, stride_x, eps, g_ptr, BLOCK_K: tl.constexpr, SLOTS: tl.constexpr):
        """1 / sqrt(mean(x[m]^2) + eps) in fp32, a pass over the rows (from L2: a decode step's few)."""
        k = tl.arange(0, BLOCK_K)
        xv = _x_rows(x_ptr, m, k, mmask, k < K, stride_x, g_ptr, SLOTS).to(tl.float32)
        ss = tl.sum(xv * xv, 1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = _x_rows(x_ptr, m, k, mmask, k < K, stride_x, g_ptr, SLOTS).to(tl.float32)
            ss += tl.sum(xv * xv, 1)
        return tl.rsqrt(ss / K + eps)

    @triton.jit
    def scale_tile(s_ptr, n, k0, stride_s, kblocks, nmask, BN: tl.constexpr, BK: tl.constexpr,
                   BLOCK_K: tl.constexpr, SUB: tl.constexpr):
        """[BLOCK_N, BLOCK_K] block scales (BN x BK blocks, SUB = min(BK, BLOCK_K)) of an FP8 weight
        tile at rows n, columns k0..: one load per scale block, broadcast along it (per-element
        loads or per-block partial sums cost 64 scalar loads or 328 shuffles a 2048-wide step in
        the sm_90 PTX)."""
        NB: tl.constexpr = BLOCK_K // SUB
        kb = k0 // BK + (tl.arange(0, NB) * SUB) // BK
        sv = tl.load(s_ptr + (n // BN)[:, None] * stride_s + kb[None, :], mask=nmask[:, None] & (kb < kblocks)[None, :],
                     other=0.0)
        return tl.reshape(tl.broadcast_to(sv[:, :, None], [sv.shape[0], NB, SUB]), [sv.shape[0], BLOCK_K])

    @triton.jit
    def _accumulate(acc, x_ptr, w_ptr, m, n, mmask, nmask, start, K, stride_x, stride_w, BLOCK_K: tl.constexpr,
                    DOT: tl.constexpr, IEEE: tl.constexpr, inv_rms=None, g_ptr=None, NORM: tl.constexpr = False,
                    SLOTS: tl.constexpr = 0, s_ptr=None, stride_s=0, SCALED: tl.constexpr = False,
                    BN: tl.constexpr = 1, BK: tl.constexpr = 1, SUB: tl.constexpr = 1):
        """SCALED: w is FP8 with block scales s (`scale_tile`), each tile scaled in fp32, and for the
        tensor cores rounded to x's dtype, as the FP8 GEMV's tiles (fp8.row_times / rows_times)."""
        for k0 in range(start, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            xv = _x_tile(x_ptr, m, k, mmask, kmask, stride_x, inv_rms, g_ptr, NORM, SLOTS)
            if SCALED:
                ws = w.to(tl.float32) * scale_tile(s_ptr, n, k0, stride_s, tl.cdiv(K, BK), nmask, BN, BK, BLOCK_K, SUB)
                if DOT:
                    ws = ws.to(xv.dtype)
                acc = _product(acc, xv, ws, DOT, IEEE)
            else:
                acc = _product(acc, xv, w, DOT, IEEE)
        return acc

    @triton.jit
    def _rows_times(x_ptr, w_ptr, m, n, mmask, nmask, K, stride_x, stride_w, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                    PDL: tl.constexpr, g_ptr=None, eps=0.0, NORM: tl.constexpr = False, SLOTS: tl.constexpr = 0):
        """x[m] @ w[n]^T in fp32 (NORM: RMS-normed x[m] with weight g; SLOTS: `_x_rows`). The
        first weight tile is requested before the PDL wait: no kernel of the step writes weights,
        so under PDL that load overlaps the previous kernel's tail, and only the activation loads
        wait for it."""
        k = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & (k < K)[None, :],
                     other=0.0)
        pdl.enter(PDL)
        inv_rms = None
        if NORM:
            inv_rms = _inv_rms(x_ptr, m, mmask, K, stride_x, eps, g_ptr, BLOCK_K, SLOTS)
        xv = _x_tile(x_ptr, m, k, mmask, k < K, stride_x, inv_rms, g_ptr, NORM, SLOTS)
        acc = _product(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), xv, w0, DOT, IEEE)
        return _accumulate(acc, x_ptr, w_ptr, m, n, mmask, nmask, BLOCK_K, K, stride_x, stride_w, BLOCK_K, DOT, IEEE,
                           inv_rms, g_ptr, NORM, SLOTS)

    # M only masks rows: specialized (== 1, % 16), each class of a mixed step's row count would
    # be a compile of its own inside a served step (TP > 1 runs those steps eagerly).
    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, x2_ptr, w2_ptr, K2, stride_x2,
                     stride_w2, g_ptr, eps, s2_ptr, stride_s2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PAIR: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr, NORM: tl.constexpr, SLOTS: tl.constexpr, FP8_2: tl.constexpr = False,
                     BN2: tl.constexpr = 1, BK2: tl.constexpr = 1, SUB2: tl.constexpr = 1,
                     PAIR_EARLY: tl.constexpr = False):
        """y = x @ w^T, or with PAIR x @ w^T + x2 @ w2^T (one rounding of the fp32 sum); NORM: x
        RMS-normed with weight g first; SLOTS: x's rows are sums of SLOTS fp32 rows (`_x_rows`);
        FP8_2: w2 is FP8 with block scales s2 (an FP8 model's shared down-projection).
        PAIR_EARLY (16-bit w2): w2's first tile requested before the PDL wait too, as w's is; the
        same sums in the same order."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        nmask = n < N
        mmask = m < M
        if PAIR_EARLY:
            k2 = tl.arange(0, BLOCK_K)
            w2_0 = tl.load(w2_ptr + n[:, None].to(tl.int64) * stride_w2 + k2[None, :],
                           mask=nmask[:, None] & (k2 < K2)[None, :], other=0.0)
        acc = _rows_times(x_ptr, w_ptr, m, n, mmask, nmask, K, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K, DOT,
                          IEEE, PDL, g_ptr, eps, NORM, SLOTS)
        if PAIR:
            start = 0
            if PAIR_EARLY:
                acc = _product(acc, _x_tile(x2_ptr, m, k2, mmask, k2 < K2, stride_x2, None, None, False, 0), w2_0,
                               DOT, IEEE)
                start = BLOCK_K
            acc = _accumulate(acc, x2_ptr, w2_ptr, m, n, mmask, nmask, start, K2, stride_x2, stride_w2, BLOCK_K, DOT,
                              IEEE, s_ptr=s2_ptr, stride_s=stride_s2, SCALED=FP8_2, BN=BN2, BK=BK2, SUB=SUB2)
        tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    def config(m: int, n: int, k: int, sms: int, max_k: int | None = None) -> dict:
        """Launch shape for [m, k] x [n, k]^T at one row: a program's whole weight slice (K up to
        2048, 4-16 rows) in one step, so under PDL all of it is requested before the wait. From
        bench/gemv.py --sweep and the engine on the H200 (runs 39-40, 2026-12-04): e.g. latent_down
        4.31 -> 2.56 us, o_proj 5.29 -> 4.54; the batch-1 step 1.954 -> 1.844 ms (1.06x; the 512-wide
        K steps before it are bench/gpu.py's `gemv_k512`). FP8 rows (fp8.py) pass their own max_k."""
        max_k = max_k or int(os.environ.get("LATENTSERVE_GEMV_MAX_K", "2048"))
        bm = triton.next_power_of_2(m)
        bn = max(4, block_n(n, sms))
        # A [BLOCK_M, BLOCK_N, BLOCK_K] product lives in registers: keep it near 8K elements.
        bk = max(64, min(max_k, 8192 // (bm * bn), triton.next_power_of_2(k)))
        return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4}

    def rows_tile(m: int, dot: bool) -> int:
        """BLOCK_M: the rows themselves for the register product; 16 or 64 for tensor-core tiles,
        so a step of any 2-64 rows takes one of two compiles (decode graphs and the startup
        mixed steps make both), the padding rows costing bandwidth nothing."""
        return triton.next_power_of_2(m) if not dot else 16 if m <= 16 else 64

    def dot_config(m: int, n: int, k: int, sms: int, itemsize: int) -> dict:
        """Launch shape from 2 rows: the rows padded to a 16-row (or larger) tensor-core tile, so a
        weight tile costs the same registers at 16 rows as at 2 (the register product's grow with
        the rows: 18.7 us at 8 rows where cuBLAS took 6.2). K steps shrink until a stage's x and
        weight tiles fit 40 KB: Triton keeps 5 of them at 4 stages (the first weight tile, loaded
        before the PDL wait, has its own), 200 KB of the H200's 227. At 48 KB the 64-row x
        32-output tiles of `gemv_256` needed 240 KB and failed to launch (run 47)."""
        bm, bn = rows_tile(m, True), max(16, block_n(n, sms))
        if m > bm:
            # Above 64 rows, blocks of 64 rows (LATENTSERVE_GEMV_MAX_ROWS=256: bench/gpu.py's
            # `gemv_256`, 1.00x at batch 256 in run 51). Each program re-reads its 64 rows of x
            # from L2, 4x its weight bytes at 16 outputs a program: the widest outputs that still
            # give ~3/4 of the SMs a program (a 2048-wide projection at 256 rows: 64, 128 programs).
            bn = int(os.environ.get("LATENTSERVE_GEMV_TALL_BLOCK_N", "0")) or tall_block_n(m, n, bm, sms)
        elif bn == 16 and triton.cdiv(n, 32) >= 96 and os.environ.get("LATENTSERVE_GEMV_WIDE_TILES", "1") != "0":
            # Wide outputs (q_b, 3072 x 768): 32 rows a program still fill ~3/4 of the SMs and
            # re-read x half as often (bench/gemv.py --sweep, runs 39-40: 64 rows 7.25 -> 4.18 us,
            # 8 rows 3.78 -> 3.52; cuBLAS 4.8 and 4.6). LATENTSERVE_GEMV_WIDE_TILES=0: 16 (a baseline).
            return {"BLOCK_N": 32, "BLOCK_K": min(128, max(16, triton.next_power_of_2(k))), "num_warps": 4,
                    "num_stages": 3 if bm > 16 else 4, "DOT": True}
        bk = max(16, min(dot_max_k() if bm == 16 else 256, triton.next_power_of_2(k)))
        while bk > 32 and (bm + bn) * bk * itemsize > 40 * 1024:
            bk //= 2
        return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4, "DOT": True}

    def dot_max_k() -> int:
        """K step of 2-16 rows' 16 x 16 tiles (LATENTSERVE_GEMV_DOT_MAX_K, a candidate; 256 the
        default). Run 70 (H100, no PDL) had 8 rows' four GEMVs at 0.38 of copy bandwidth: 16
        outputs a program, one program an SM, 4 stages of 8 KB of weights in flight, about what
        3 TB/s needs at DRAM latency. 512 doubles that (32 KB a stage, 128 KB at 4); the sweeps
        stopped at 256."""
        return int(os.environ.get("LATENTSERVE_GEMV_DOT_MAX_K", "256"))

    def tall_block_n(m: int, n: int, block_m: int, sms: int) -> int:
        """Outputs a program above 64 rows: the widest of 64, 32, 16 that still gives ~3/4 of the
        SMs a program, since each program re-reads its block_m rows of x from L2."""
        return next(b for b in (64, 32, 16) if b == 16 or triton.cdiv(n, b) * triton.cdiv(m, block_m) * 4 >= sms * 3)

    def shape(m: int, n: int, k: int, sms: int, itemsize: int = 2) -> dict:
        return config(m, n, k, sms) if m == 1 else dot_config(m, n, k, sms, itemsize)

    def launch(x2: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cfg: dict,
               pair: tuple[torch.Tensor, torch.Tensor] | None = None,
               norm: tuple[torch.Tensor, float] | None = None, slots: int = 0,
               scale2: torch.Tensor | None = None) -> None:
        """slots: x2 holds `slots` fp32 rows a token to sum (with norm only), y one row a token;
        scale2: the pair's second weight is FP8 with these block scales."""
        m, k = y.shape[0], x2.shape[1]
        n = weight.shape[0]
        xb, wb = pair if pair is not None else (x2, weight)
        g, eps = norm if norm is not None else (x2, 0.0)  # unread without NORM
        cfg = {"DOT": False, **cfg}
        block_m = rows_tile(m, cfg["DOT"])
        fp8 = {}
        if scale2 is not None:
            bn2, bk2 = block_of(wb, scale2)
            fp8 = {"FP8_2": True, "BN2": bn2, "BK2": bk2, "SUB2": min(bk2, cfg["BLOCK_K"])}
        s2 = scale2 if scale2 is not None else x2  # unread without FP8_2
        # One row (the register product; 2-16 rows' plain pair is the CUDA C GEMV's). The early tile
        # costs registers: normed with the slot sum, 106 -> 138 a thread, 3 programs an SM and two
        # waves of 512; capped at 128, no spill and one wave (sm_90 compile, bench/launch_audit.py).
        early = {"PAIR_EARLY": True, "maxnreg": 128} if pair is not None and scale2 is None and m == 1 \
            and pair_early() else {}
        _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, block_m))](
            x2, weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0), xb, wb, xb.shape[1], xb.stride(0),
            wb.stride(0), g, float(eps), s2, s2.stride(0), BLOCK_M=block_m, PAIR=pair is not None,
            IEEE=weight.dtype == torch.float32, NORM=norm is not None, SLOTS=slots, **fp8, **cfg, **early,
            **pdl.launch(x2.device))

    def rows(x: torch.Tensor) -> torch.Tensor:
        """x [..., K] as rows [M, K] with contiguous K."""
        x2 = x.reshape(-1, x.shape[-1])
        return x2 if x2.stride(-1) == 1 else x2.contiguous()

    def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        x2 = rows(x)
        m, n = x2.shape[0], weight.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if not (gemv_cuda.supported(x2, weight) and gemv_cuda.run(x2, weight, y)):
            launch(x2, weight, y, shape(m, n, k, sm_count(x.device), x.element_size()))
        return y.view(*x.shape[:-1], n)

    def _pair(x, weight, x2, weight2, norm=None, slots=0, scale2=None):
        a, b = rows(x), rows(x2)
        if slots and b.shape[0] != 1:  # the tiles' pipeline would stage every slot's fp32 rows (270 KB)
            raise ValueError(f"slots: one row only, got {b.shape[0]}")
        y = torch.empty(b.shape[0], weight.shape[0], dtype=weight.dtype, device=x.device)
        plain = norm is None and scale2 is None and not slots
        if plain and gemv_cuda.supported(a, weight, (b, weight2)) and gemv_cuda.run(a, weight, y, (b, weight2)):
            return y
        launch(a, weight, y, shape(b.shape[0], weight.shape[0], max(a.shape[1], b.shape[1]), sm_count(x.device),
                                   weight.element_size()), pair=(b, weight2), norm=norm, slots=slots, scale2=scale2)
        return y

    @torch.library.custom_op("latentserve::gemv_pair", mutates_args=())
    def gemv_pair(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                  scale2: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T + x2 [M, K2] @ weight2[N, K2]^T -> [M, N] in x's dtype: two
        projections into the same rows (a latent MoE's up-projection and its shared experts'
        down-projection at TP 1) in one launch, summed in fp32. scale2: weight2 is FP8 block-scaled."""
        return _pair(x, weight, x2, weight2, scale2=scale2)

    @gemv_pair.register_fake
    def _(x, weight, x2, weight2, scale2=None):
        return x.new_empty(x.reshape(-1, x.shape[-1]).shape[0], weight.shape[0])

    @torch.library.custom_op("latentserve::gemv_pair_normed", mutates_args=())
    def gemv_pair_normed(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                         x2: torch.Tensor, weight2: torch.Tensor, slots: int = 0,
                         scale2: torch.Tensor | None = None) -> torch.Tensor:
        """`gemv_pair` of rms_norm(x, norm_weight, eps): the latent MoE's norm before its
        up-projection inside the same launch (each program norms the few rows it reads). slots > 0
        (one row): x [slots, K] fp32 are the routed experts' outputs a slot, summed here in slot
        order and rounded to the model dtype (moe_kernels.slot_sum's math) before the norm."""
        return _pair(x, weight, x2, weight2, norm=(norm_weight, eps), slots=slots, scale2=scale2)

    @gemv_pair_normed.register_fake
    def _(x, norm_weight, eps, weight, x2, weight2, slots=0, scale2=None):
        return weight.new_empty(x2.reshape(-1, x2.shape[-1]).shape[0], weight.shape[0])

    @torch.library.custom_op("latentserve::gemv", mutates_args=())
    def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T -> [..., N] in x's dtype (fp32 accumulation)."""
        return _gemv(x, weight)

    @gemv.register_fake
    def _(x, weight):
        return x.new_empty(*x.shape[:-1], weight.shape[0])
