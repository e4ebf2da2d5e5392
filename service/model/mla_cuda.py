"""MLA decode's split kernel for a few sequences in CUDA C (mla_small.cu), in place of the Triton
one (`_mla_decode_split`) at 1-8 sequences.

At one to eight sequences the Triton split kernel is a layer's largest excess over its bytes:
10.5 us at one sequence for 1.2 MB of KV, 14 us at eight for 9.4 MB (H100, run 114). ncu had each
warp issuing ~1,900 instructions, one every ~9 cycles (run 62), and neither shorter epilogues,
16 warps, pipelined half tiles nor loads before the PDL wait moved it (runs 39, 62, 106-110):
the tile's chain is what Triton generates for a 16-row dot with 8 warps. This kernel writes that
chain by hand: mma.m16n8k16 on fragments read from conflict-free shared memory, the scores split
over the warps by position and by halves of the 576 dims, the value sum by output columns.
Same outputs (the fp32 partials and log-sum-exps the merge reads), same splits, same contract
for the new token's write and the query's rope.

Runs 116-119 (H100, bench/RESULTS.md): the kernel's time in the step 10.5 -> 7.8 us a layer at one
sequence and 13.9 -> 10.8 at eight; steps 0.96-0.97x at batch 1 and 0.97-0.99x at 8 (the default then).
Timed at 64 and 256 sequences too (run 119): 0.99x standalone, 1.00-1.01x in the step, so not there.

Runs 120-121 turned it off: the engine's decode graphs with it differed from the eager step
without it by 0.12 and 0.18. That was an expert choice flipped by a small change upstream
(bench/route_flips.py; a CPU run moved one row by 0.11-0.27 so), not the kernel: with every token
routed to all experts, run 122 (H100) had the replay within 1.7e-2 of the eager step with it on and
with it off, under PDL and without, the level of every other switch's graph test. The inputs are
coherent loads (not ld.global.nc) since, as PTX asks of data another kernel may still be writing
under PDL. Run 122's steps: 0.95x the Triton kernel's at batch 1, 0.98x at 8.

Built and launched by nvrtc.py. LATENTSERVE_MLA_CUDA_MAX_ROWS (8; 0: the Triton kernel, bench/gpu.py's
`mla_cuda_off`). Without `cuda.bindings` the Triton kernel runs; a build or first-launch failure
turns this one off for the process (`KernelGuard`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from . import nvrtc
from .kernel_guard import KernelGuard

GUARD = KernelGuard("mla_cuda")
SOURCE = Path(__file__).with_name("mla_small.cu")
D_LAT, D_PE, HEADS, THREADS = 512, 64, 16, 256


def max_rows() -> int:
    return int(os.environ.get("LATENTSERVE_MLA_CUDA_MAX_ROWS", "8"))


def splits() -> int | None:
    """LATENTSERVE_MLA_CUDA_SPLITS: the split count where this kernel runs (unset: the Triton
    kernel's, `mla_decode.num_splits`, 32 at one sequence and 16 at eight). 32 at eight sequences
    (one tile a program in 256 programs, bench/gpu.py's `mla_cuda_32_splits`) was 0.99x and 1.01x in
    runs 119-120 (H100): noise. 16 and 8 at one sequence lost (1.06x, 1.09x, run 119)."""
    n = os.environ.get("LATENTSERVE_MLA_CUDA_SPLITS")
    return int(n) if n else None


def supported(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, new_kv: torch.Tensor | None, new_slots: torch.Tensor | None,
              rope: tuple | None) -> bool:
    """bf16 throughout, a 512-wide latent and 64-wide rope part, int64 tables and lengths, fp32 rope
    tables, 16-byte aligned rows, power-of-2 cache blocks, sm_90 or later, up to `max_rows` sequences."""
    if GUARD.failure is not None or not 0 < q_lat.shape[0] <= max_rows() or not nvrtc.runs_on(q_lat):
        return False
    block_size = kv_cache.shape[1]
    ok = (q_lat.dtype == q_pe.dtype == kv_cache.dtype == torch.bfloat16 and q_lat.shape[-1] == D_LAT
          and q_pe.shape[-1] == D_PE and kv_cache.shape[-1] == D_LAT + D_PE and block_size & (block_size - 1) == 0
          and block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.stride(-1) == 1
          and context_lens.is_contiguous() and nvrtc.aligned(q_lat, q_lat.stride(0), q_lat.stride(1))
          and nvrtc.aligned(kv_cache, kv_cache.stride(1)))
    if ok and new_kv is not None:
        ok = new_slots is not None and new_slots.dtype == torch.int64 and nvrtc.aligned(new_kv, new_kv.stride(0))
    if ok and rope is not None:
        ok = rope[0].dtype == rope[1].dtype == torch.float32
    return ok


def _launch(q_lat, q_pe, kv_cache, block_tables, context_lens, o, lse, new_kv, new_slots, cos, sin, num_heads,
            scale, block_size, splits, write, rope_mode) -> bool:
    func = nvrtc.function(SOURCE, "mla_split_small", q_lat.device.index)
    c_i64, c_int, c_float = ctypes.c_longlong, ctypes.c_int, ctypes.c_float
    args = [nvrtc.ptr(t) for t in (q_lat, q_pe, kv_cache, block_tables, context_lens, o, lse, new_kv, new_slots, cos,
                                   sin)]
    args += [c_i64(s) for s in (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(1),
                                block_tables.stride(0), o.stride(0), o.stride(1), o.stride(2), lse.stride(0),
                                lse.stride(1), new_kv.stride(0) if write else 0, cos.stride(0))]
    args += [c_int(num_heads), c_float(scale), c_int(block_size.bit_length() - 1), c_int(splits), c_int(int(write)),
             c_int(rope_mode)]
    grid = (q_lat.shape[0], -(-num_heads // HEADS), splits)
    smem = nvrtc.smem_bytes(SOURCE, "mla_split_small", q_lat.device.index)
    return nvrtc.launch(func, grid, THREADS, smem, q_lat.device, args)


def split(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
          context_lens: torch.Tensor, scale: float, o: torch.Tensor, lse: torch.Tensor,
          new_kv: torch.Tensor | None, new_slots: torch.Tensor | None, rope: tuple | None) -> bool:
    """Fills o [B, S, H, 512] fp32 and lse [B, S, H] as `_mla_decode_split` does (S = o.shape[1]);
    False when the kernel is off for this process (the caller then launches the Triton kernel)."""
    write = new_kv is not None
    cos, sin = (rope[0], rope[1]) if rope is not None else (context_lens, context_lens)
    rope_mode = 0 if rope is None else 2 if rope[2] else 1
    args = (q_lat, q_pe, kv_cache, block_tables, context_lens, o, lse, new_kv if write else kv_cache,
            new_slots if write else context_lens, cos, sin, q_lat.shape[1], scale, kv_cache.shape[1], o.shape[1],
            write, rope_mode)
    return GUARD.call(_launch, *args) is not None
