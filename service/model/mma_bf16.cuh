// What the hand-written CUDA C kernels share (mla_small.cu, gemv_small.cu): bf16 as raw 16-bit
// words (NVRTC compiles them without CUDA's headers), its conversions, and the bf16 tensor-core MMA.
#pragma once

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// c += a [16 x 16] @ b [16 x 8], bf16 in, fp32 accumulate (the PTX fragment layout of m16n8k16)
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
