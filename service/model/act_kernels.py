"""The gated activation of every fused MLP / expert kernel's epilogue (Triton), in one place.

`gated(acc_gate, acc_up, ...)` takes a GEMM's fp32 accumulators for the gate and up rows and
returns act(gate) * up in fp32 with the roundings of the torch path (`layers.act_and_mul` after
a GEMM): both GEMM outputs rounded to the activation dtype first; SiLU rounded again before the
product, as F.silu(gate) * up is; Kimi's SiTU in fp32, the up input soft-clipped when
linear_beta is set.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

ACTS = {"silu": 0, "situ": 1}  # the ACT constexpr of the kernels

if triton is not None:

    @triton.jit
    def tanh(y):
        return 2.0 * tl.sigmoid(2.0 * y) - 1.0

    @triton.jit
    def gated(acc_gate, acc_up, beta, linear_beta, dtype: tl.constexpr, ACT: tl.constexpr,
              CLIP_UP: tl.constexpr):
        g = acc_gate.to(dtype).to(tl.float32)  # the GEMM's output rounding
        u = acc_up.to(dtype).to(tl.float32)
        if ACT == 0:  # SiLU, rounded as F.silu(gate) * up in the activation dtype
            h = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u
        else:
            h = beta * tanh(g / beta) * tl.sigmoid(g)
            if CLIP_UP:
                u = linear_beta * tanh(u / linear_beta)
            h = h * u
        return h
