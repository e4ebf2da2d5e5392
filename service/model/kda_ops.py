"""KDA decode's in-place state updates, as ops that stay in place inside compiled layers.

A decode step reads and writes each sequence's state rows (the conv window, the recurrent
state) in place. Under torch.compile (decoder layers compiled inside the decode CUDA graphs,
fusion.CompiledForward) an in-place write into a graph input is functionalized, and Inductor
may turn it into a copy of the whole state plus a copy back (it did so for the MLA cache:
attention.write_kv). FLA's fused recurrent kernel is a Triton launch behind Python wrappers
(autotune, heuristics, input guards) that dynamo cannot trace as they are. So both are
`torch.library` custom ops that declare what they mutate; eager steps call the plain functions.

- `write_rows(dst, rows, src)`: dst[rows] = src.
- `fla_decode(...)`: zero the recurrent rows of sequences at position 0 (decided on the device,
  so one captured graph serves every batch), then FLA's fused recurrent step reading and
  writing each row in place through `ssm_state_indices`.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from ..log import get_logger

log = get_logger("kda")

try:  # Triton comes with CUDA builds of torch; CPU installs run without it.
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@functools.cache
def fla_kda() -> SimpleNamespace | None:
    """FLA's KDA kernels, or None where fla-core is not installed (or does not import)."""
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return None
    except Exception as e:  # a broken install must not take the torch path down with it
        log.warning("fla_import_failed", error=repr(e))
        return None
    return SimpleNamespace(chunk_kda=chunk_kda, fused_recurrent_kda_fwd=fused_recurrent_kda_fwd)


def state_rows_fit(recurrent: torch.Tensor, head_dim: int) -> bool:
    """Recurrent rows [S, H, D, D] as the decode kernels (FLA's and kda_step's) index them: float32,
    contiguous within a row."""
    d = head_dim
    return recurrent.dtype == torch.float32 and recurrent.stride()[1:] == (d * d, d, 1)


@torch.compiler.assume_constant_result
def fla_available() -> bool:
    """fla_kda() is not None; a constant to dynamo (it would otherwise trace the import)."""
    return fla_kda() is not None


if triton is not None:
    @triton.jit
    def _zero_fresh_rows_kernel(state, rows, positions, row_stride, row_numel, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        if tl.load(positions + i) == 0:
            row = tl.load(rows + i).to(tl.int64)
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            tl.store(state + row * row_stride + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < row_numel)


def zero_fresh_rows(recurrent: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Zero the recurrent rows of the batch entries at position 0, deciding on the device.

    FLA's in-place recurrent kernel reads and writes the same row, so a sequence that starts in
    a decode-shaped step must find zeros there; a gather/where/scatter in torch would move every
    row of the batch twice for the rare fresh one, and the host lists cannot tell which (a CUDA
    graph is captured once for every batch)."""
    numel = recurrent[0].numel()
    block = 1024
    _zero_fresh_rows_kernel[(rows.shape[0], triton.cdiv(numel, block))](
        recurrent, rows, positions, recurrent.stride(0), numel, BLOCK=block)


# ---- dst[rows] = src ----------------------------------------------------------------------------

def _write_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    dst.index_copy_(0, rows, src.to(dst.dtype))


@torch.library.custom_op("latentserve::kda_write_rows", mutates_args=("dst",))
def _write_rows_op(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    _write_rows(dst, rows, src)


@_write_rows_op.register_fake
def _(dst, rows, src) -> None:
    return None


def write_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    if torch.compiler.is_compiling():
        torch.ops.latentserve.kda_write_rows(dst, rows, src)
    else:
        _write_rows(dst, rows, src)


# ---- a decode step's short convs: one kernel -----------------------------------------------------

def decode_conv_enabled() -> bool:
    """LATENTSERVE_KDA_DECODE_CONV=1 (not yet timed on a GPU: `bench/gpu_check.sh k3` times it): an
    all-decode step's three short convs as one kernel (`decode_conv`) whose q, k and v go to FLA
    as they are, where the compiled layer gathered the history, concatenated the window, wrote it
    back, convolved, and FLA's wrapper then copied q, k and v contiguous (three copies)."""
    return os.environ.get("LATENTSERVE_KDA_DECODE_CONV", "0") == "1"


if triton is not None:
    @triton.jit
    def conv_window(mixed_ptr, conv_ptr, w_ptr, t, row, kept, ch, c, cmask, stride_m, stride_cs, stride_cc, stride_w,
                    W: tl.constexpr, W_PAD: tl.constexpr):
        """Channels ch (weight rows c, cmask) of decode token t on history row `row`: the window
        [history | input] (zeros for history when not `kept`: a sequence at position 0, whose row
        may hold anything), silu(window . w) in fp32 rounded to the input's dtype, and the history
        shifted by one as (address, values, mask). The caller stores those after a barrier: lanes
        read taps that others write. Shared by decode_conv's kernel and kda_step's."""
        j = tl.arange(0, W_PAD)
        hist = conv_ptr + row * stride_cs + ch[:, None].to(tl.int64) * stride_cc + j[None, :]
        window = tl.load(hist, mask=cmask[:, None] & (j < W - 1)[None, :] & kept, other=0.0)
        shifted = tl.load(hist + 1, mask=cmask[:, None] & (j < W - 2)[None, :] & kept, other=0.0)
        x = tl.load(mixed_ptr + t * stride_m + ch, mask=cmask, other=0.0)
        xf = x.to(tl.float32)
        window = tl.where((j == W - 1)[None, :], xf[:, None], window)
        shifted = tl.where((j == W - 2)[None, :], xf[:, None], shifted)
        w = tl.load(w_ptr + c[:, None] * stride_w + j[None, :], mask=cmask[:, None] & (j < W)[None, :], other=0.0)
        acc = tl.sum(window * w.to(tl.float32), 1)
        return (acc * tl.sigmoid(acc)).to(x.dtype), hist, shifted, cmask[:, None] & (j < W - 1)[None, :]

    @triton.jit
    def _decode_conv_kernel(mixed_ptr, conv_ptr, rows_ptr, positions_ptr, wq_ptr, wk_ptr, wv_ptr, q_ptr, k_ptr,
                            v_ptr, P, stride_m, stride_cs, stride_cc, stride_w, stride_o,
                            W: tl.constexpr, W_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (token, q/k/v, channel block): `conv_window` of its channels, out written, then
        the row's history shifted. Every load of the row comes before the barrier, every store after."""
        t = tl.program_id(0)
        part = tl.program_id(1)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < P
        if part == 0:
            w_ptr, o_ptr = wq_ptr, q_ptr
        elif part == 1:
            w_ptr, o_ptr = wk_ptr, k_ptr
        else:
            w_ptr, o_ptr = wv_ptr, v_ptr
        row = tl.load(rows_ptr + t).to(tl.int64)
        kept = tl.load(positions_ptr + t) != 0
        out, hist, shifted, taps = conv_window(mixed_ptr, conv_ptr, w_ptr, t, row, kept, part * P + c, c, cmask,
                                               stride_m, stride_cs, stride_cc, stride_w, W, W_PAD)
        tl.store(o_ptr + t * stride_o + c, out, mask=cmask)
        tl.debug_barrier()
        tl.store(hist, shifted, mask=taps)


def _decode_conv(mixed: torch.Tensor, conv: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                 wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    b, p = mixed.shape[0], mixed.shape[1] // 3
    width = wq.shape[-1]
    outs = tuple(mixed.new_empty(b, p) for _ in range(3))
    if b == 0:
        return outs
    block = min(256, triton.next_power_of_2(p))
    _decode_conv_kernel[(b, 3, triton.cdiv(p, block))](
        mixed, conv, rows, positions, wq, wk, wv, *outs, p, mixed.stride(0), conv.stride(0), conv.stride(1),
        wq.stride(0), outs[0].stride(0), W=width, W_PAD=triton.next_power_of_2(width), BLOCK_C=block, num_warps=4)
    return outs


@torch.library.custom_op("latentserve::kda_decode_conv", mutates_args=("conv",))
def decode_conv(mixed: torch.Tensor, conv: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token a row of mixed [B, 3P] (pre-conv q|k|v); conv [S, 3P, W-1] fp32 history
    rows, advanced in place at rows [B]; positions [B]; w* [P, 1, W] -> post-conv q, k, v [B, P]
    in mixed's dtype, each contiguous. The math of KimiDeltaAttention._decode's torch ops."""
    return _decode_conv(mixed, conv, rows, positions, wq, wk, wv)


@decode_conv.register_fake
def _(mixed, conv, rows, positions, wq, wk, wv):
    b, p = mixed.shape[0], mixed.shape[1] // 3
    return tuple(mixed.new_empty(b, p) for _ in range(3))


# ---- FLA's fused recurrent decode step ----------------------------------------------------------

def _fla_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, recurrent: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, scale: float, lower_bound: float | None) -> torch.Tensor:
    """q, k, v, g [B, H, D] (pre-norm q/k, raw gate); beta [B, H] raw; recurrent [S, H, D, D]
    fp32, updated in place at `rows` [B]. Returns o [B, H, D] in q's dtype."""
    b, heads, d = q.shape
    zero_fresh_rows(recurrent, rows, positions)
    o, _ = fla_kda().fused_recurrent_kda_fwd(
        q=q.view(b, 1, heads, d), k=k.view(b, 1, heads, d), v=v.view(b, 1, heads, d), g=g.view(b, 1, heads, d),
        beta=beta.view(b, 1, heads), A_log=a_log, dt_bias=dt_bias, scale=scale, initial_state=recurrent,
        inplace_final_state=True, ssm_state_indices=rows, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    return o.reshape(b, heads, d).to(q.dtype)


@torch.library.custom_op("latentserve::kda_fla_decode", mutates_args=("recurrent",))
def _fla_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, recurrent: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor, scale: float, lower_bound: float | None) -> torch.Tensor:
    return _fla_decode(q, k, v, g, beta, a_log, dt_bias, recurrent, rows, positions, scale, lower_bound)


@_fla_decode_op.register_fake
def _(q, k, v, g, beta, a_log, dt_bias, recurrent, rows, positions, scale, lower_bound):
    return q.new_empty(q.shape)


def fla_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               a_log: torch.Tensor, dt_bias: torch.Tensor, recurrent: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor, scale: float, lower_bound: float | None) -> torch.Tensor:
    args = (q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), a_log, dt_bias,
            recurrent, rows, positions, scale, lower_bound)
    if torch.compiler.is_compiling():
        return torch.ops.latentserve.kda_fla_decode(*args)
    return _fla_decode(*args)
