// The routed experts for a few tokens, hand-written (moe_cuda.py says why and when): the contract of
// moe_kernels.py's `_gate_up_kernel` and `_down_kernel`, one (token, slot) pair and 8 output rows a
// program, on the decode GEMV's tile (gemv_tile.cuh) with x one row.
//
//   gate/up: h[p, n] = act(x[t] . W13[e][n], x[t] . W13[e][shard + n]) for pair p = (t, slot), e = ids[p]
//   down:    part[p, n] = round(h[p] . W2[e][n]) * weights[p], fp32
//
// The expert ids come from the step's routing, so unlike the GEMV no weight is requested before
// the PDL wait. Roundings as act_kernels.gated and `_down_kernel`: each GEMM output rounded to bf16
// first, SiLU rounded again before the product, SiTU in fp32 with the up input soft-clipped when
// linear_beta is set.

#include "mma_bf16.cuh"
#include "gemv_tile.cuh"

#define WARPS 4
#define THREADS (WARPS * 32)

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float tanh_f(float y) { return 2.f * sigmoid_f(2.f * y) - 1.f; }

__device__ __forceinline__ float round_bf(float x) { return bf2f(f2bf(x)); }

// Pair p's expert: the step's routing wrote it, so only after the PDL wait.
__device__ __forceinline__ i64 pair_expert(const i64* ids, int p) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    return ids[p];
}

// A warp's row-0 outputs (lanes 0-3 of the fragment hold n = 2t, 2t + 1) into part[warp][8].
__device__ __forceinline__ void keep_row0(float (*part)[8], const float* acc, int warp, int g, int t) {
    if (g == 0) {
        part[warp][2 * t] = acc[0];
        part[warp][2 * t + 1] = acc[1];
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) expert_gate_up_small(
    const bf16_t* x, const bf16_t* w13, const i64* ids, bf16_t* h, i64 sx, i64 swe, i64 swn, i64 sh, int width,
    int shard, int top_k, float beta, float linear_beta, int act, int clip_up) {
    __shared__ float part[2][WARPS][8];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int p = blockIdx.x, n0 = blockIdx.y * 8;
    const i64 e = pair_expert(ids, p);
    const bool row_ok = n0 + g < shard;
    const bf16_t* gate = w13 + e * swe + (i64)(row_ok ? n0 + g : 0) * swn;
    const bf16_t* up = gate + (i64)shard * swn;
    const bf16_t* xrow = x + (i64)(p / top_k) * sx;
    uint4 wg[UNROLL], wu[UNROLL];
    load_w<WARPS>(wg, gate, row_ok, warp, width, t);
    load_w<WARPS>(wu, up, row_ok, warp, width, t);
    float acc_g[4] = {0.f, 0.f, 0.f, 0.f}, acc_u[4] = {0.f, 0.f, 0.f, 0.f};
    accumulate<false, WARPS>(acc_g, wg, xrow, 0, gate, row_ok, 1, width, warp, g, t);
    accumulate<false, WARPS>(acc_u, wu, xrow, 0, up, row_ok, 1, width, warp, g, t);
    keep_row0(part[0], acc_g, warp, g, t);
    keep_row0(part[1], acc_u, warp, g, t);
    __syncthreads();
    if (tid < 8 && n0 + tid < shard) {
        float sg = 0.f, su = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) {
            sg += part[0][v][tid];
            su += part[1][v][tid];
        }
        const float gv = round_bf(sg);
        float uv = round_bf(su), hv;
        if (act == 0) {
            hv = round_bf(gv * sigmoid_f(gv)) * uv;
        } else {
            hv = beta * tanh_f(gv / beta) * sigmoid_f(gv);
            if (clip_up) uv = linear_beta * tanh_f(uv / linear_beta);
            hv = hv * uv;
        }
        h[(i64)p * sh + n0 + tid] = f2bf(hv);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) expert_down_small(
    const bf16_t* h, const bf16_t* w2, const i64* ids, const float* weights, float* out, i64 sh, i64 swe, i64 swn,
    i64 so, int width_out, int shard) {
    __shared__ float part[WARPS][8];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int p = blockIdx.x, n0 = blockIdx.y * 8;
    const i64 e = pair_expert(ids, p);
    const bool row_ok = n0 + g < width_out;
    const bf16_t* wrow = w2 + e * swe + (i64)(row_ok ? n0 + g : 0) * swn;
    uint4 wv[UNROLL];
    load_w<WARPS>(wv, wrow, row_ok, warp, shard, t);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    accumulate<false, WARPS>(acc, wv, h + (i64)p * sh, 0, wrow, row_ok, 1, shard, warp, g, t);
    keep_row0(part, acc, warp, g, t);
    __syncthreads();
    if (tid < 8 && n0 + tid < width_out) {
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) s += part[v][tid];
        out[(i64)p * so + n0 + tid] = round_bf(s) * weights[p];
    }
}
