// MLA decode's split kernel for a few sequences, hand-written (mla_cuda.py says why and when).
//
// The contract is mla_decode.py's `_mla_decode_split` for bf16, a 512-wide latent and a 64-wide
// rope part: program (sequence b, block of 16 heads, split) walks its split's positions in tiles
// of 32, keeps an online softmax per head and writes its partial output [16, 512] fp32 and
// log-sum-exp, which mla_merge.py merges. With write_kv, the sequence's new token (the context's
// last position, not yet in the cache) is read from new_kv in place of its cache row, and the
// owning program of head block 0 writes that row to its slot. rope (1: halves, 2: interleaved
// pairs) ropes q_pe where it is loaded, as mla_parts.query_pe does.
//
// 8 warps. Scores: each warp one 8-position column of the tile over half of the 576 dims (18
// mma.m16n8k16 in two chains); values: each warp 64 of the 512 output columns (16 mma). The tile
// after the current one is copied (cp.async) while the current one is computed. None of CUDA's
// headers (mma_bf16.cuh is ours): NVRTC compiles this at first use.

#include "mma_bf16.cuh"

#define D_LAT 512
#define D_PE 64
#define D_ALL 576
#define HB 16          // heads a program: the mma's 16 rows
#define TILE 32        // positions a tile
#define THREADS 256
#define QS 584         // q and KV rows in shared memory, in elements: 1168 B, conflict-free fragments
#define PS 40          // P rows
#define SS 36          // score partial rows (floats)
#define CHUNKS 72      // 16-byte chunks a KV row

// Dynamic shared memory a program takes: q, two KV tiles, the score halves, P, the softmax's
// alpha/max/sum and two tiles' slots (the carve-up at the top of mla_split_small). Exported, so
// the launch (nvrtc.smem_bytes) reads this one number rather than a copy of the layout.
#define SMEM_BYTES (HB * QS * 2 + 2 * TILE * QS * 2 + 2 * HB * SS * 4 + HB * PS * 2 + 3 * HB * 4 + 2 * TILE * 8)
extern "C" __device__ const int mla_split_small_smem = SMEM_BYTES;

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The slot of position p (-1: past the split, zero-filled; -2: the new token, read from new_kv).
__device__ __forceinline__ i64 slot_of(int p, int end, int ctx, int write_kv, const i64* bt_row, int block_log2) {
    if (p >= end) return -1;
    if (write_kv && p == ctx - 1) return -2;
    return (bt_row[p >> block_log2] << block_log2) + (p & ((1 << block_log2) - 1));
}

// Copies a tile's 32 rows of 576 into shared memory: 2304 chunks of 16 B, 9 a thread.
__device__ __forceinline__ void copy_tile(bf16_t* dst, const i64* slots, const bf16_t* kv, i64 stride_slot,
                                          const bf16_t* new_row, int tid) {
#pragma unroll
    for (int k = 0; k < TILE * CHUNKS / THREADS; ++k) {
        const int c = tid + k * THREADS;
        const int row = c / CHUNKS, ch = c - row * CHUNKS;
        const i64 slot = slots[row];
        const bf16_t* src = slot >= 0 ? kv + slot * stride_slot + ch * 8 : slot == -2 ? new_row + ch * 8 : kv;
        const u32 bytes = slot == -1 ? 0 : 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst + row * QS + ch * 8)),
                     "l"(src), "r"(bytes));
    }
    asm volatile("cp.async.commit_group;");
}

// No __restrict__ on the inputs: with it every input load compiled to the read-only path
// (LDG.CONSTANT, ld.global.nc), which PTX allows only for data read-only for the kernel's whole
// lifetime. Under PDL this kernel starts while the one before it still writes q, and the buffers
// of one layer's q are the next layer's; coherent loads after griddepcontrol.wait see those writes.
// (Runs 120-121: the engine's decode graphs with this kernel differed from the eager step, 0.12-0.18
// relative, where every standalone test passed.)
extern "C" __global__ void __launch_bounds__(THREADS) mla_split_small(
    const bf16_t* q, const bf16_t* qpe, bf16_t* kv, const i64* bt, const i64* ctx_lens, float* __restrict__ o,
    float* __restrict__ lse, const bf16_t* new_kv, const i64* new_slots, const float* cos_t, const float* sin_t,
    i64 stride_qb, i64 stride_qh, i64 stride_pb, i64 stride_ph, i64 stride_slot, i64 stride_bt, i64 stride_ob,
    i64 stride_os, i64 stride_oh, i64 stride_lb, i64 stride_ls, i64 stride_new, i64 stride_cs, int num_heads,
    float scale, int block_log2, int num_splits, int write_kv, int rope) {
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* sQ = (bf16_t*)smem;                  // [HB][QS]
    bf16_t* sK = sQ + HB * QS;                   // [2][TILE][QS]
    float* sS = (float*)(sK + 2 * TILE * QS);    // [2 dim halves][HB][SS]
    bf16_t* sP = (bf16_t*)(sS + 2 * HB * SS);    // [HB][PS]
    float* sAlpha = (float*)(sP + HB * PS);      // [HB]
    float* sM = sAlpha + HB;
    float* sL = sM + HB;
    i64* sSlot = (i64*)(sL + HB);                // [2][TILE]

    const int b = blockIdx.x, hbase = blockIdx.y * HB, split = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

    // Programmatic dependent launch: everything below reads what earlier kernels of the step wrote.
    // (Copying the first tile's cache rows before the wait, when no kernel of the step writes them,
    // was slower: run 118, steps 0.99x / 0.98x at 1 / 8 sequences against 0.97x / 0.97x.)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");

    const int ctx = (int)ctx_lens[b];  // positions in 32 bits: a 64-bit division is a software routine
    const int per_split = ((ctx + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
    const int start = split * per_split;
    const int end = start + per_split < ctx ? start + per_split : ctx;
    const int ntiles = end > start ? (end - start + TILE - 1) / TILE : 0;
    const bool owns_new = write_kv && start <= ctx - 1 && ctx - 1 < end;
    const i64* bt_row = bt + b * stride_bt;
    const bf16_t* new_row = new_kv + b * stride_new;

    if (ntiles > 0 && tid < TILE) sSlot[tid] = slot_of(start + tid, end, ctx, write_kv, bt_row, block_log2);

    // The absorbed query and the (roped) rope part, heads past num_heads as zeros.
#pragma unroll
    for (int k = 0; k < HB * (D_LAT / 8) / THREADS; ++k) {
        const int c = tid + k * THREADS, r = c >> 6, ch = c & 63, h = hbase + r;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (h < num_heads) v = *(const uint4*)(q + b * stride_qb + h * stride_qh + ch * 8);
        *(uint4*)(sQ + r * QS + ch * 8) = v;
    }
#pragma unroll
    for (int k = 0; k < HB * D_PE / THREADS; ++k) {
        const int e = tid + k * THREADS, r = e >> 6, d = e & 63, h = hbase + r;
        bf16_t val = 0;
        if (h < num_heads) {
            const bf16_t* row = qpe + b * stride_pb + h * stride_ph;
            if (rope == 0) {
                val = row[d];
            } else {
                const int j = d & 31;
                const float x1 = bf2f(row[rope == 2 ? 2 * j : j]), x2 = bf2f(row[rope == 2 ? 2 * j + 1 : j + 32]);
                const float c = bf2f(f2bf(cos_t[b * stride_cs + j])), s = bf2f(f2bf(sin_t[b * stride_cs + j]));
                val = f2bf(d < 32 ? x1 * c - x2 * s : x2 * c + x1 * s);
            }
        }
        sQ[r * QS + D_LAT + d] = val;
    }
    __syncthreads();
    if (ntiles > 0) copy_tile(sK, sSlot, kv, stride_slot, new_row, tid);

    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // this warp's heads 2w, 2w + 1
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

    for (int i = 0; i < ntiles; ++i) {
        const int buf = i & 1;
        const int p0 = start + i * TILE;
        bf16_t* tile = sK + buf * TILE * QS;
        if (i + 1 < ntiles) {  // the next tile's copy runs under this one's math
            if (tid < TILE)
                sSlot[(buf ^ 1) * TILE + tid] = slot_of(p0 + TILE + tid, end, ctx, write_kv, bt_row, block_log2);
            __syncthreads();
            copy_tile(sK + (buf ^ 1) * TILE * QS, sSlot + (buf ^ 1) * TILE, kv, stride_slot, new_row, tid);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();

        {  // scores: warp (column n of 8 positions, half kh of the 36 K steps)
            const int n = warp & 3, kh = warp >> 2;
            const bf16_t* krow = tile + (n * 8 + g) * QS + 2 * t;
            const bf16_t* qlo = sQ + g * QS + 2 * t;
            const bf16_t* qhi = sQ + (g + 8) * QS + 2 * t;
            float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = kh * 18; ks < kh * 18 + 18; ks += 2) {
                const int k0 = ks * 16, k1 = k0 + 16;
                mma(c0, *(const u32*)(qlo + k0), *(const u32*)(qhi + k0), *(const u32*)(qlo + k0 + 8),
                    *(const u32*)(qhi + k0 + 8), *(const u32*)(krow + k0), *(const u32*)(krow + k0 + 8));
                mma(c1, *(const u32*)(qlo + k1), *(const u32*)(qhi + k1), *(const u32*)(qlo + k1 + 8),
                    *(const u32*)(qhi + k1 + 8), *(const u32*)(krow + k1), *(const u32*)(krow + k1 + 8));
            }
            float* out = sS + kh * HB * SS + n * 8 + 2 * t;
            out[g * SS] = c0[0] + c1[0];
            out[g * SS + 1] = c0[1] + c1[1];
            out[(g + 8) * SS] = c0[2] + c1[2];
            out[(g + 8) * SS + 1] = c0[3] + c1[3];
        }
        __syncthreads();

        // Online softmax: warp w owns heads 2w and 2w + 1, a lane one position.
        const bool valid = p0 + lane < end;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int r = 2 * warp + rr;
            const float s = valid ? (sS[r * SS + lane] + sS[HB * SS + r * SS + lane]) * scale : NEG_INF;
            const float m_new = fmaxf(m_run[rr], warp_max(s));
            const float alpha = __expf(m_run[rr] - m_new);
            const float p = valid ? __expf(s - m_new) : 0.f;
            l_run[rr] = l_run[rr] * alpha + warp_sum(p);
            m_run[rr] = m_new;
            sP[r * PS + lane] = f2bf(p);  // rounded for the value sum, as the Triton kernel's dot takes it
            if (lane == 0) sAlpha[r] = alpha;
        }
        __syncthreads();

        {  // values: warp w's 64 columns, P [16 x 32] times the tile's latent [32 x 512]
            const float a_lo = sAlpha[g], a_hi = sAlpha[g + 8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j][0] *= a_lo;
                acc[j][1] *= a_lo;
                acc[j][2] *= a_hi;
                acc[j][3] *= a_hi;
            }
            const int mat = lane >> 3, mrow = lane & 7;
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                const int k0 = ks * 16;
                const u32 a0 = *(const u32*)(sP + g * PS + k0 + 2 * t);
                const u32 a1 = *(const u32*)(sP + (g + 8) * PS + k0 + 2 * t);
                const u32 a2 = *(const u32*)(sP + g * PS + k0 + 8 + 2 * t);
                const u32 a3 = *(const u32*)(sP + (g + 8) * PS + k0 + 8 + 2 * t);
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int n0 = warp * 64 + jj * 16;
                    // Four 8x8 matrices, transposed: (k 0-7, n0), (k 8-15, n0), (k 0-7, n0 + 8), (k 8-15, n0 + 8).
                    const bf16_t* at = tile + (k0 + (mat & 1) * 8 + mrow) * QS + n0 + (mat >> 1) * 8;
                    u32 b0, b1, b2, b3;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                                 : "r"(smem_addr(at)));
                    mma(acc[2 * jj], a0, a1, a2, a3, b0, b1);
                    mma(acc[2 * jj + 1], a0, a1, a2, a3, b2, b3);
                }
            }
        }
        __syncthreads();  // the tile's buffer and P are free for the next tile
    }

    if (lane == 0) {
        sM[2 * warp] = m_run[0];
        sM[2 * warp + 1] = m_run[1];
        sL[2 * warp] = l_run[0];
        sL[2 * warp + 1] = l_run[1];
    }
    __syncthreads();

    // Every split writes both outputs, an empty one (0, -inf), so the merge never reads garbage.
    const float inv_lo = __frcp_rn(sL[g] > 0.f ? sL[g] : 1.f), inv_hi = __frcp_rn(sL[g + 8] > 0.f ? sL[g + 8] : 1.f);
    float* o_split = o + b * stride_ob + split * stride_os;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int col = warp * 64 + j * 8 + 2 * t;
        if (hbase + g < num_heads)
            *(float2*)(o_split + (hbase + g) * stride_oh + col) = make_float2(acc[j][0] * inv_lo, acc[j][1] * inv_lo);
        if (hbase + g + 8 < num_heads)
            *(float2*)(o_split + (hbase + g + 8) * stride_oh + col) = make_float2(acc[j][2] * inv_hi, acc[j][3] * inv_hi);
    }
    if (tid < HB && hbase + tid < num_heads) {
        const float l = sL[tid];
        lse[b * stride_lb + split * stride_ls + hbase + tid] = l > 0.f ? sM[tid] + __logf(l) : NEG_INF;
    }
    if (owns_new && hbase == 0 && tid < CHUNKS) {
        const i64 slot = new_slots[b];
        *(uint4*)(kv + slot * stride_slot + tid * 8) = *(const uint4*)(new_row + tid * 8);
    }
}
