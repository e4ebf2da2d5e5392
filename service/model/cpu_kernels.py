"""Two small C kernels for the CPU decode step, compiled on first use, called through ctypes.

A CPU decode step spent most of its time where torch has no fused op (bench/RESULTS.md,
2026-12-03):
- MLA decode attention: the paged context was gathered into a [B, S, 576] copy per layer, then
  read by two batched matmuls with M = heads (4), which MKL serves by packing the whole context
  once more per sequence; at batch 64 x 97 tokens that was 6.7 ms of a layer.
- Routed experts for a few tokens: each expert's weights packed by MKL for a handful of rows.

`mla_decode` reads each sequence's cache rows in place, twice (scores, then the weighted sum of
the values; the rows of one sequence stay in cache between the passes), as vLLM's CPU MLA
kernel does; `moe_experts` runs each expert over its tokens with the expert's weight rows read
once (SiLU only; SiTU keeps the torch path). fp32 only, one thread (the rank's).

The kernels are plain C (no torch headers: a compile takes ~1 s), built with the system C
compiler (`CC`, else cc) into a per-user cache keyed by the source's hash, and loaded with
ctypes, which releases the GIL during the call. Without a compiler, or with
LATENTSERVE_CPU_KERNELS=0, every caller keeps its torch path. Sums run in a different order than
MKL's, so results differ from the torch path in the last bits (tests/test_cpu_kernels.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading

import torch

from ..log import get_logger

log = get_logger("cpu_kernels")

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 independent lanes, summed at the end: vectorizes without reassociating any one sum. */
static float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* q [B, H, D]; cache rows [*, D] (D = L + rope); slots [B, W] (row b's first lens[b] are its
   context); out [B, H, L] = softmax(scale * q . k) . v per head, v = the first L columns. */
int mla_decode_f32(const float *q, const float *cache, const int64_t *slots, const int64_t *lens,
                   int64_t B, int64_t H, int64_t D, int64_t L, int64_t W, float scale, float *out) {
    float *p = (float *)malloc(sizeof(float) * (size_t)(H * (W > 0 ? W : 1)));
    if (!p) return 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lens[b];
        const int64_t *sl = slots + b * W;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * L;
        for (int64_t h = 0; h < H; h++) memset(ob + h * L, 0, sizeof(float) * (size_t)L);
        if (n <= 0) continue;
        for (int64_t s = 0; s < n; s++) {
            const float *k = cache + sl[s] * D;
            for (int64_t h = 0; h < H; h++) p[h * W + s] = scale * dot(qb + h * D, k, D);
        }
        for (int64_t h = 0; h < H; h++) {
            float *ph = p + h * W;
            float m = ph[0];
            for (int64_t s = 1; s < n; s++) m = ph[s] > m ? ph[s] : m;
            float sum = 0.f;
            for (int64_t s = 0; s < n; s++) { ph[s] = expf(ph[s] - m); sum += ph[s]; }
            for (int64_t s = 0; s < n; s++) ph[s] /= sum;
        }
        for (int64_t s = 0; s < n; s++) {
            const float *v = cache + sl[s] * D;
            for (int64_t h = 0; h < H; h++) axpy(ob + h * L, p[h * W + s], v, L);
        }
    }
    free(p);
    return 0;
}

/* x [M, Wd]; w13 [E, 2I, Wd] (gate rows, then up rows); w2 [E, Wd, I]; weights/ids [M, K];
   out [M, Wd] = sum over each token's K (expert, weight) of weight * w2_e silu(gate) * up.
   Each expert's weight rows are read once for all its tokens. */
int moe_silu_f32(const float *x, const float *w13, const float *w2, const float *weights,
                 const int64_t *ids, int64_t M, int64_t K, int64_t E, int64_t I, int64_t Wd,
                 float *out) {
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (size_t)(M * K));
    float *tw = (float *)malloc(sizeof(float) * (size_t)(M * K));
    float *h = (float *)malloc(sizeof(float) * (size_t)(M * K * I));
    if (!tok || !tw || !h) { free(tok); free(tw); free(h); return 1; }
    memset(out, 0, sizeof(float) * (size_t)(M * Wd));
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t i = 0; i < M * K; i++)
            if (ids[i] == e) { tok[n] = i / K; tw[n] = weights[i]; n++; }
        if (!n) continue;
        const float *g = w13 + e * 2 * I * Wd, *u = g + I * Wd, *d = w2 + e * Wd * I;
        for (int64_t r = 0; r < I; r++)
            for (int64_t t = 0; t < n; t++) {
                const float *xt = x + tok[t] * Wd;
                float a = dot(g + r * Wd, xt, Wd), c = dot(u + r * Wd, xt, Wd);
                h[t * I + r] = a / (1.f + expf(-a)) * c;
            }
        for (int64_t o = 0; o < Wd; o++)
            for (int64_t t = 0; t < n; t++)
                out[tok[t] * Wd + o] += tw[t] * dot(d + o * I, h + t * I, I);
    }
    free(tok); free(tw); free(h);
    return 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]
_lock = threading.Lock()
_lib = None
_tried = False


def enabled() -> bool:
    return os.environ.get("LATENTSERVE_CPU_KERNELS", "1") != "0"


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "latentserve", "cpu_kernels")


def _cpu_flags() -> str:
    """This CPU's feature flags: -march=native code is only for CPUs that have them (a cache
    directory shared between hosts must not hand one CPU's build to another)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256((_SOURCE + " ".join([cc, *_FLAGS]) + _cpu_flags()).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"kernels-{key}.so")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            src, so = os.path.join(tmp, "kernels.c"), os.path.join(tmp, "kernels.so")
            with open(src, "w") as f:
                f.write(_SOURCE)
            subprocess.run([cc, *_FLAGS, src, "-o", so, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(so, path)  # atomic: concurrent ranks each build, the last one wins
    lib = ctypes.CDLL(path)
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.mla_decode_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr]
    lib.moe_silu_f32.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr]
    lib.mla_decode_f32.restype = lib.moe_silu_f32.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, no compiler, build failed: logged once)."""
    global _lib, _tried
    if _tried or not enabled():
        return _lib if enabled() else None
    with _lock:
        if not _tried:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                log.warning("cpu_kernels_off", error=f"{type(e).__name__}: {e} {detail.decode(errors='replace')[-500:]}")
            _tried = True
    return _lib


def _f32(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts)


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
               kv_lora_rank: int, scale: float) -> torch.Tensor | None:
    """q [B, H, D] against each row's context: slots [B, W] cache slots (the first lens[b] of
    row b), kv_cache [..., D]. Returns [B, H, kv_lora_rank], or None (use the torch path)."""
    if not _f32(q, kv_cache) or slots.dtype != torch.int64 or lens.dtype != torch.int64:
        return None
    lib = library()
    if lib is None:
        return None
    slots, lens = slots.contiguous(), lens.contiguous()
    b, h, d = q.shape
    out = q.new_empty(b, h, kv_lora_rank)
    if lib.mla_decode_f32(q.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(), lens.data_ptr(), b, h, d,
                          kv_lora_rank, slots.shape[1], scale, out.data_ptr()):
        return None
    return out


def moe_silu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor) -> torch.Tensor | None:
    """Routed experts with SiLU: x [M, W], w13 [E, 2I, W], w2 [E, W, I], weights/ids [M, k].
    Returns this rank's partial sum [M, W], or None (use the torch path)."""
    if not _f32(x, w13, w2) or ids.dtype != torch.int64:
        return None
    lib = library()
    if lib is None:
        return None
    weights, ids = weights.float().contiguous(), ids.contiguous()
    m, k = ids.shape
    e, two_i, width = w13.shape
    out = x.new_empty(m, width)
    if lib.moe_silu_f32(x.data_ptr(), w13.data_ptr(), w2.data_ptr(), weights.data_ptr(), ids.data_ptr(),
                        m, k, e, two_i // 2, width, out.data_ptr()):
        return None
    return out
