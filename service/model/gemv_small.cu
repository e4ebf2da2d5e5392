// The decode GEMV for 1-16 rows, hand-written (gemv_cuda.py says why and when):
// y[M, N] = x[M, K] @ W[N, K]^T (+ x2[M, K2] @ W2[N, K2]^T, one fp32 sum), bf16 in and out.
//
// The product runs transposed on mma.m16n8k16, x as the 16-row operand (rows past M are zeros)
// and 8 rows of W as the 8-column one, so a program owns 8 outputs and no row of W is padded.
// Each thread reads its operands straight from global memory into the fragments' registers,
// 16 bytes at a time: the sum over K does not care which K a fragment slot holds, so slot pair
// (2t, 2t+1) / (2t+8, 2t+9) of two MMAs takes elements 8t..8t+7 of each row of a 32-wide chunk,
// for W and for x alike. No shared memory on the way in, no ldmatrix, no barrier in the loop.
// The warps (4; 8 in the `_k8` kernels, a candidate) split K by chunks; their partial 16 x 8 tiles
// add in shared memory at the end. W is read before the PDL wait (no kernel of a step writes
// weights); x only after it.

#include "mma_bf16.cuh"
#include "gemv_tile.cuh"

template <bool TALL, int WARPS>
__device__ __forceinline__ void gemv_body(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                          const bf16_t* __restrict__ x2, const bf16_t* __restrict__ w2,
                                          bf16_t* __restrict__ y, i64 sx, i64 sw, i64 sx2, i64 sw2, i64 sy, int M,
                                          int N, int K, int K2, int pair) {
    __shared__ float part[WARPS][16][8];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 8;
    const bool row_ok = n0 + g < N;
    const bf16_t* wrow = w + (i64)(row_ok ? n0 + g : 0) * sw;
    uint4 wv[UNROLL];
    load_w<WARPS>(wv, wrow, row_ok, warp, K, t);

    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    accumulate<TALL, WARPS>(acc, wv, x, sx, wrow, row_ok, M, K, warp, g, t);
    if (pair) {
        const bf16_t* wrow2 = w2 + (i64)(row_ok ? n0 + g : 0) * sw2;
        load_w<WARPS>(wv, wrow2, row_ok, warp, K2, t);
        accumulate<TALL, WARPS>(acc, wv, x2, sx2, wrow2, row_ok, M, K2, warp, g, t);
    }

    // acc: rows g and g + 8 of x, outputs n0 + 2t and n0 + 2t + 1
    part[warp][g][2 * t] = acc[0];
    part[warp][g][2 * t + 1] = acc[1];
    part[warp][g + 8][2 * t] = acc[2];
    part[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    const int m = tid >> 3, n = tid & 7;
    if (m < M && n0 + n < N) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) sum += part[v][m][n];
        y[(i64)m * sy + n0 + n] = f2bf(sum);
    }
}

#define GEMV_ENTRY(NAME, TALL, WARPS)                                                                               \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(                                                 \
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, const bf16_t* __restrict__ x2,                 \
        const bf16_t* __restrict__ w2, bf16_t* __restrict__ y, i64 sx, i64 sw, i64 sx2, i64 sw2, i64 sy, int M,    \
        int N, int K, int K2, int pair) {                                                                          \
        gemv_body<TALL, WARPS>(x, w, x2, w2, y, sx, sw, sx2, sw2, sy, M, N, K, K2, pair);                          \
    }

GEMV_ENTRY(gemv_small_8, false, 4)
GEMV_ENTRY(gemv_small_16, true, 4)
GEMV_ENTRY(gemv_small_8_k8, false, 8)  // 8 warps on K: a K of 2048 all in flight before the wait
GEMV_ENTRY(gemv_small_16_k8, true, 8)
