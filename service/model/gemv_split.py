"""Split-K for the GEMV's tensor-core tiles at 2-64 rows (LATENTSERVE_GEMV_SPLIT_K=1, a candidate).

Run 74's no-PDL profile (H100) has the four GEMVs of a layer at 64 rows taking 26.7 us for 26 MB
of weights (8.6 us at copy bandwidth, 0.32) and at 8 rows 22.7 us (0.38). Their programs are few
and long: fused_qkv_a (1344 x 2048) at 64 rows is 84 programs of 16 outputs, each streaming its
64 KB of weights and all 256 KB of x from L2, ~320 KB through one SM at ~55 KB/us (run 47's
count), where the weights alone at HBM speed take 1.8 us. Splitting K over more programs cuts
the bytes each one moves and fills the SMs: `plan` picks outputs a program and splits by the
fewest bytes through the busiest SM.

Each program writes its fp32 partial tile to a workspace and counts itself in on its tile's
arrival counter (acq_rel, as kda_step's split programs and the persistent probe do); the last to
arrive sums the partials in split order and writes y, so the result does not depend on arrival
order and a graph replay equals an eager call. The counters are left zeroed.
"""

from __future__ import annotations

import os

import torch

from . import pdl
from .counters import ArrivalCounters

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: gemv.py is off there too
    triton = None

MAX_SPLIT = 8


def enabled() -> bool:
    return os.environ.get("LATENTSERVE_GEMV_SPLIT_K", "0") == "1"


def plan(m: int, n: int, k: int, k2: int, sms: int, itemsize: int, bm: int) -> dict | None:
    """Launch shape (BLOCK_N, SPLIT, BLOCK_K, the K ranges a split) for m rows of [n, k] (+ [n, k2]
    paired) in gemv's bm-row tiles, or None where one split is as good: bytes a program (its rows
    of x and its weight slice over its K range, then the partials the last program reads) times
    the programs an SM."""
    if m > bm:  # above 64 rows: gemv's row blocks
        return None
    best = None
    for bn in (16, 32, 64, 128):
        if bn > max(16, triton.next_power_of_2(n)) or (bn == 128 and bm < 64):
            continue
        bk = max(16, min(256, triton.next_power_of_2(max(k, k2))))
        while bk > 32 and (bm + bn) * bk * itemsize > 40 * 1024:  # gemv.dot_config's stage budget
            bk //= 2
        for split in range(1, MAX_SPLIT + 1):
            chunk, chunk2 = (triton.cdiv(triton.cdiv(kk, split), bk) * bk if kk else 0 for kk in (k, k2))
            if (chunk and triton.cdiv(k, chunk) < split) or (chunk2 and triton.cdiv(k2, chunk2) < split):
                break  # a split with no K left
            programs = triton.cdiv(n, bn) * triton.cdiv(m, bm) * split
            moved = (m + bn) * (chunk + chunk2) * itemsize + (m * bn * 4 * (split + 1) if split > 1 else 0)
            cost = (triton.cdiv(programs, sms) * moved, split, -bn)
            if best is None or cost < best[0]:
                best = (cost, {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "CHUNK": chunk, "CHUNK2": chunk2})
    return None if best is None or best[1]["SPLIT"] == 1 else best[1]


COUNTERS = ArrivalCounters()


if triton is not None:

    @triton.jit
    def _dot(acc, xv, w, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
        return tl.dot(xv, tl.trans(w), acc)

    @triton.jit
    def _k_range(acc, x_ptr, w_ptr, m, n, mmask, nmask, start, end, stride_x, stride_w, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
        """acc + x[m, start:end] @ w[n, start:end]^T in BLOCK_K steps."""
        for k0 in range(start, end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < end
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0)
            xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc = _dot(acc, xv, w, IEEE)
        return acc

    @triton.jit(do_not_specialize=["M"])
    def _split_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, CHUNK, stride_x, stride_w, stride_y,
                      x2_ptr, w2_ptr, K2, CHUNK2, stride_x2, stride_w2, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PAIR: tl.constexpr,
                      IEEE: tl.constexpr, PDL: tl.constexpr):
        """Program (n block, m block, split s): x[m, K range s] @ w[n, K range s]^T (+ the pair's
        K2 range s) into part[s]; the tile's last program sums part[0..SPLIT) into y."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        s = tl.program_id(2)
        nmask, mmask = n < N, m < M
        start = s * CHUNK
        end = tl.minimum(K, start + CHUNK)
        k = start + tl.arange(0, BLOCK_K)
        # The first weight tile before the PDL wait: no kernel of a step writes weights.
        w0 = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & (k < end)[None, :],
                     other=0.0)
        pdl.enter(PDL)
        xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & (k < end)[None, :], other=0.0)
        acc = _dot(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), xv, w0, IEEE)
        acc = _k_range(acc, x_ptr, w_ptr, m, n, mmask, nmask, start + BLOCK_K, end, stride_x, stride_w, BLOCK_K, IEEE)
        if PAIR:
            start2 = s * CHUNK2
            acc = _k_range(acc, x2_ptr, w2_ptr, m, n, mmask, nmask, start2, tl.minimum(K2, start2 + CHUNK2),
                           stride_x2, stride_w2, BLOCK_K, IEEE)
        tile_mask = mmask[:, None] & nmask[None, :]
        tile = m[:, None] * N + n[None, :]
        plane = tl.num_programs(1) * BLOCK_M * N  # one split's [M padded, N] partials
        tl.store(part_ptr + s * plane + tile, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrival = cnt_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tl.atomic_xchg(arrival, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()  # every thread after the acquire
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for i in range(SPLIT):  # split order: the same sum whoever arrives last
                total += tl.load(part_ptr + i * plane + tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + m[:, None] * stride_y + n[None, :], total.to(y_ptr.dtype.element_ty), mask=tile_mask)

    def launch(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
               pair: tuple[torch.Tensor, torch.Tensor] | None, sms: int, bm: int) -> bool:
        """y = x @ weight^T (+ pair[0] @ pair[1]^T) split over K where `plan` says it pays; False
        (nothing launched) where it does not or no counters can be had."""
        m, k, n = y.shape[0], x.shape[1], weight.shape[0]
        xb, wb = pair if pair is not None else (x, weight)
        k2 = xb.shape[1] if pair is not None else 0
        cfg = plan(m, n, k, k2, sms, weight.element_size(), bm)
        if cfg is None:
            return False
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, bm), cfg["SPLIT"])
        counters = COUNTERS.get(x.device, grid[0] * grid[1])
        if counters is None:
            return False
        part = torch.empty(cfg["SPLIT"], grid[1] * bm, n, dtype=torch.float32, device=x.device)
        _split_kernel[grid](
            x, weight, y, part, counters, m, n, k, cfg["CHUNK"], x.stride(0), weight.stride(0), y.stride(0), xb, wb,
            k2, cfg["CHUNK2"], xb.stride(0), wb.stride(0), BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], SPLIT=cfg["SPLIT"], PAIR=pair is not None, IEEE=weight.dtype == torch.float32,
            num_warps=8 if bm * cfg["BLOCK_N"] > 4096 else 4, num_stages=4, **pdl.launch(x.device))
        return True
