"""Why the add-norm fold stops at one row (service/model/add_norm.py): at 2-16 rows the GEMV is a
tensor-core loop, and this times that loop with the fold's pieces added one at a time, against the
unfused pair measured in the same run (our GEMV after Inductor's add + RMS norm kernel), in CUDA
graphs, on one GPU.

Pieces: `add` (x + add feeds the dot), `squares` (each row's sum of squares in the loop, for the
norm), `g` (the norm weight's multiply), `store` (the new stream x + add written inside the loop by
one program) or `store_after` (after the loop, each program a share of the columns), `prepass` (the
sums of squares in a pass over the rows before the loop, as gemv.py's NORM does). Runs 107-108
(H100, 8 rows, 2112 x 2048): the unfused pair ~5.9 us; squares alone made the loop 14, the store
inside it 23, the best whole fold (prepass, store_after) 11.1 (10.4 at 16 rows). That probe timed
20 calls a graph by the host clock; this bench times them with CUDA events, best of 3, as
bench/gemv.py's graph_seconds does.

    python bench/norm_in_loop.py [--rows 8 16] [--n 2112] [--k 2048]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gemv import graph_seconds  # noqa: E402

from service.model import gemv, pdl  # noqa: E402, F401 (gemv registers latentserve::gemv)

try:
    import triton
    import triton.language as tl
except ImportError:  # the bench needs a GPU and Triton
    triton = None

VARIANTS = {  # name: (squares 0/1/prepass 3, add, store 0/in loop 1/after 2, g)
    "plain": (0, 0, 0, 0), "add": (0, 1, 0, 0), "squares": (1, 0, 0, 0), "g": (0, 0, 0, 1),
    "add_squares": (1, 1, 0, 0), "add_store": (0, 1, 1, 0), "add_store_after": (0, 1, 2, 0),
    "fold_in_loop": (1, 1, 1, 1), "fold_prepass": (3, 1, 2, 1),
}

if triton is not None:

    @triton.jit
    def _loop(x_ptr, add_ptr, g_ptr, w_ptr, y_ptr, sum_ptr, M, N, K, eps, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SS: tl.constexpr, ADD: tl.constexpr,
              STORE: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        mmask, nmask = m < M, n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        ss = tl.zeros([BLOCK_M], tl.float32)
        pdl.enter(PDL)
        if SS == 3:
            for k0 in range(0, K, BLOCK_K):
                s = _sum(x_ptr, add_ptr, m, k0 + tl.arange(0, BLOCK_K), mmask, K, ADD)
                ss += tl.sum(s * s, 1)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nmask[:, None] & (k < K)[None, :],
                        other=0.0)
            s = _sum(x_ptr, add_ptr, m, k, mmask, K, ADD)
            if STORE == 1:
                tl.store(sum_ptr + m[:, None] * K + k[None, :], s.to(x_ptr.dtype.element_ty),
                         mask=mmask[:, None] & (k < K)[None, :] & (tl.program_id(0) == 0))
            if SS == 1:
                ss += tl.sum(s * s, 1)
            if G:
                s = s * tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            acc = tl.dot(s.to(x_ptr.dtype.element_ty), tl.trans(w), acc)
        if SS:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
        if STORE == 2:
            for k0 in range(tl.program_id(0) * BLOCK_K, K, tl.num_programs(0) * BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                tl.store(sum_ptr + m[:, None] * K + k[None, :], _sum(x_ptr, add_ptr, m, k, mmask, K, True)
                         .to(x_ptr.dtype.element_ty), mask=mmask[:, None] & (k < K)[None, :])

    @triton.jit
    def _sum(x_ptr, add_ptr, m, k, mmask, K, ADD: tl.constexpr):
        """x (+ add) at rows m, columns k, rounded to x's dtype as the add rounds, in fp32."""
        mask = mmask[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(add_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0)
                 .to(tl.float32)).to(x.dtype)
        return x.to(tl.float32)


def graph_us(fn, calls: int = 20) -> float:
    """Microseconds a call, `calls` calls captured in one CUDA graph (bench/gemv.py's graph_seconds)."""
    return graph_seconds(lambda _: fn(), range(calls)) * 1e6


def launch(bufs: tuple, n: int, bk: int, variant: tuple) -> None:
    h, a, g, w, y, total = bufs
    ss, add, store, gg = variant
    _loop[(triton.cdiv(n, 16),)](h, a, g, w, y, total, h.shape[0], n, h.shape[1], 1e-6, BLOCK_M=16, BLOCK_N=16,
                                 BLOCK_K=bk, SS=ss, ADD=add, STORE=store, G=gg, num_warps=4, num_stages=4,
                                 **pdl.launch(h.device))


def time_rows(m: int, n: int, k: int, block_ks: list[int], add_norm) -> None:
    """One row count: the GEMV, the unfused pair, every variant at every K step, then the last
    variant's (a whole fold's) error against the unfused pair."""
    dev, dt = "cuda", torch.bfloat16
    h, a = torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
    g = torch.rand(k, device=dev, dtype=dt) + 0.5
    w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
    bufs = (h, a, g, w, torch.empty(m, n, device=dev, dtype=dt), torch.empty_like(h))
    x = h + a
    mm = graph_us(functools.partial(torch.ops.latentserve.gemv, x, w))
    unfused = graph_us(lambda: torch.ops.latentserve.gemv(add_norm(h, a, g)[1], w))
    print(f"rows {m}: gemv {mm:.2f} us, add + norm then gemv {unfused:.2f} us (the baseline)", flush=True)
    for bk in block_ks:
        for name, variant in VARIANTS.items():
            us = graph_us(functools.partial(launch, bufs, n, bk, variant))
            print(f"rows {m} k-step {bk} {name}: {us:.2f} us = {us / unfused:.2f}x the unfused pair", flush=True)
    want = torch.ops.latentserve.gemv(add_norm(h, a, g)[1], w).double()
    err = ((bufs[4].double() - want).norm() / want.norm()).item()
    print(f"rows {m}: {name} against the unfused pair, relative error {err:.1e}; new stream equal: "
          f"{torch.equal(bufs[5], x)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--n", type=int, default=2112)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    args = ap.parse_args()
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("bench/norm_in_loop.py needs a CUDA GPU and Triton")
    k = args.k
    add_norm = torch.compile(lambda h, a, g: (h + a, torch.nn.functional.rms_norm(h + a, (k,), g, 1e-6)))
    for m in args.rows:
        time_rows(m, args.n, k, args.block_k, add_norm)


if __name__ == "__main__":
    main()
