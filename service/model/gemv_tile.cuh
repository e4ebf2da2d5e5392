// The decode GEMV's tile (gemv_small.cu): 8 rows of W against the rows of x over K,
// split by chunks of 32 between a program's warps, every operand read from global memory straight
// into mma.m16n8k16 fragments (gemv_small.cu's header says why the K order inside a chunk is free).
#pragma once

#include "mma_bf16.cuh"

#define UNROLL 8  // chunks of 32 a warp has in flight

// 16 bytes, or zeros where ok is false. Weights are read once a step: past L1 (no_allocate). Not
// through the read-only path (ld.global.nc): ptxas moves those loads below griddepcontrol.wait
// (the SASS of that version had every weight load after ACQBULK), where coherent loads stay put.
__device__ __forceinline__ uint4 load_weights16(const bf16_t* p, bool ok) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (ok)
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 load_rows16(const bf16_t* p, bool ok) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (ok)
        asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The thread's 8 weights (row n0 + g) of each of its warp's next UNROLL chunks from chunk `first`.
template <int WARPS>
__device__ __forceinline__ void load_w(uint4* wv, const bf16_t* wrow, bool row_ok, int first, int K, int t) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int k = (first + u * WARPS) * 32 + 8 * t;
        wv[u] = load_weights16(wrow + k, row_ok && k < K);
    }
}

// acc += x[:, K] @ W[n0 : n0 + 8, K]^T over this warp's chunks, with wv already holding the first
// UNROLL of them. TALL: rows 8-15 of x too.
template <bool TALL, int WARPS>
__device__ __forceinline__ void accumulate(float* acc, uint4* wv, const bf16_t* x, i64 sx, const bf16_t* wrow,
                                           bool row_ok, int M, int K, int warp, int g, int t) {
    const int chunks = (K + 31) / 32;
    const bf16_t* xlo = x + (i64)g * sx;
    const bf16_t* xhi = x + (i64)(g + 8) * sx;
    for (int first = warp; first < chunks; first += UNROLL * WARPS) {
        uint4 xa[UNROLL], xb[UNROLL], wn[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = (first + u * WARPS) * 32 + 8 * t;
            xa[u] = load_rows16(xlo + k, g < M && k < K);
            xb[u] = TALL ? load_rows16(xhi + k, g + 8 < M && k < K) : make_uint4(0, 0, 0, 0);
        }
        const int next = first + UNROLL * WARPS;
        if (next < chunks) load_w<WARPS>(wn, wrow, row_ok, next, K, t);  // in flight under this group's MMAs
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            mma(acc, xa[u].x, xb[u].x, xa[u].y, xb[u].y, wv[u].x, wv[u].y);
            mma(acc, xa[u].z, xb[u].z, xa[u].w, xb[u].w, wv[u].z, wv[u].w);
        }
        if (next < chunks) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) wv[u] = wn[u];
        }
    }
}
