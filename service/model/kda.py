"""Kimi Delta Attention (KDA): the linear-attention layers of Kimi-Linear and Kimi-K3.

Per head, a [D_key, D_value] state S is carried along the sequence (transformers' layout):

    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with a per-key-channel log decay g_t <= 0 and q/k coming through a short causal depthwise conv,
SiLU and an l2 norm. The output is RMS-normed per head, gated by sigmoid(gate(x)) and projected.

Per sequence the layer keeps a fixed-size state row (`KDAState`): the recurrent state and the
last conv_size-1 pre-conv inputs. Single-token chunks (decodes) run as one batched recurrent
step that gathers and scatters rows on the device alone, so it can be captured in a CUDA graph;
longer chunks run the chunked (WY/UT) form, 64 tokens at a time. On CUDA, when the `fla`
package (fla-core, Triton) imports, its `chunk_kda` and recurrent kernels replace the torch
recurrences; the causal conv, the gates' projections and the output norm stay in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..log import get_logger
from ..parallel import TPGroup
from . import gemv_multi, kda_ops, kda_step
from .attn_metadata import AttnMetadata
from .fusion import fused
from .kda_ops import fla_available, fla_decode, fla_kda, write_rows
from .layers import ColumnParallelLinear, KeepFloat32, ReplicatedLinear, RowParallelLinear, cat_last, frozen

log = get_logger("kda")

CHUNK_SIZE = 64
L2_EPS = 1e-6  # x / sqrt(sum x^2 + eps), FLA's l2norm, which transformers and vLLM follow
# vLLM builds the gated output norm as FusedRMSNormGated(head_dim) with its default eps, whatever
# rms_norm_eps says (transformers uses rms_norm_eps): the serving engine is the spec.
O_NORM_EPS = 1e-5
SOFTPLUS_THRESHOLD = 20.0

@dataclass
class KDAState:
    """One KDA layer's per-sequence state cache; rows are indexed by state slot."""

    conv: torch.Tensor  # [S, 3*H_local*D, conv_size-1] fp32: last pre-conv q|k|v inputs (model-dtype values)
    recurrent: torch.Tensor  # [S, H_local, D, D] float32: S[key_dim, value_dim]


def kda_state_shapes(cfg: ModelConfig, tp_world_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Per-slot shapes of a KDA layer's state rows; a None dtype is the model dtype."""
    heads, d = cfg.kda_num_heads, cfg.kda_head_dim
    if heads % tp_world_size:
        raise ConfigError(f"linear_attn_config.num_heads={heads} is not divisible by TP size {tp_world_size}")
    local = heads // tp_world_size
    # The conv window holds model-dtype values but is stored in fp32 like the recurrent rows: the
    # decode graphs' compiled KDA layer mutates both, and aot_autograd refuses mutated inputs that
    # alias one pool chunk with different dtypes. Exact (bf16 -> fp32 -> bf16), 3% more state.
    return {"conv": ((3 * local * d, cfg.kda_conv_size - 1), torch.float32),
            "recurrent": ((local, d, d), torch.float32)}


# ---- the math, shared by every path ---------------------------------------------------------

@fused
def kda_gate(raw_g: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """raw_g [T, H, D] (f_b(f_a(x))) -> fp32 log decay per key channel, <= 0."""
    z = raw_g.float() + dt_bias.float().view(raw_g.shape[-2:])
    a = a_log.float().exp().unsqueeze(-1)
    if lower_bound is not None:
        # K3's bounded gate: every step keeps at least exp(lower_bound) of the state, which is
        # what lets the chunked kernels take their fast path without underflow.
        return lower_bound * torch.sigmoid(a * z)
    return -a * F.softplus(z, threshold=SOFTPLUS_THRESHOLD)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def split_heads(qkv: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-conv [T, 3*H*D] -> fp32 q (normalised, scaled by D^-0.5), k (normalised), v: [T, H, D]."""
    q, k, v = qkv.float().view(qkv.shape[0], 3, heads, head_dim).unbind(1)
    return l2_normalize(q) * head_dim ** -0.5, l2_normalize(k), v


@fused
def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's D channels, times sigmoid(gate), all in fp32 (transformers'
    KimiLinearRMSNormGated and FLA's fused norm gate)."""
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (of * torch.sigmoid(gate.float())).to(o.dtype)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: q, k, v, g [B, H, D]; beta [B, H]; state [B, H, Dk, Dv].
    Returns (o [B, H, Dv], new state)."""
    state = state * g.exp().unsqueeze(-1)
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks: q, k, g [L, H, Dk]; v [L, H, Dv]; beta [L, H]; state [H, Dk, Dv].
    Returns (o [L, H, Dv], final state), equal to `recurrent_step` token by token.

    Within a chunk, with G the inclusive cumsum of g and S the state entering it, the updates
    satisfy (I + diag(beta) A) U = diag(beta) (V - (K*exp(G)) S), A[t, j] = sum_d k_t k_j
    exp(G_t - G_j) over j < t: a unit lower-triangular solve (the UT transform) instead of c
    sequential steps. Every exponent used is G_t - G_j with j <= t (or exp(G) itself), never
    above 0, so nothing overflows however strong the decay.
    """
    length, heads, dv = v.shape
    out = v.new_empty(length, heads, dv)
    for s in range(0, length, chunk_size):
        e = min(s + chunk_size, length)
        c = e - s
        qc, kc, vc, bc = q[s:e], k[s:e], v[s:e], beta[s:e]
        cum = g[s:e].cumsum(0)  # [c, H, Dk]
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        # [t, j, H, Dk]: exp(G_t - G_j) for j <= t, 0 above the diagonal (masked before exp).
        decay = torch.where(causal[:, :, None, None], cum[:, None] - cum[None, :], float("-inf")).exp()
        kk = (kc[:, None] * kc[None, :] * decay).sum(-1).permute(2, 0, 1).tril(-1)  # [H, t, j], j < t
        qk = (qc[:, None] * kc[None, :] * decay).sum(-1).permute(2, 0, 1)  # [H, t, j], j <= t
        growth = cum.exp()
        rhs = bc.t().unsqueeze(-1) * (vc.transpose(0, 1) - torch.einsum("thk,hkv->htv", kc * growth, state))
        lower = bc.t().unsqueeze(-1) * kk + torch.eye(c, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # [H, c, Dv]
        out[s:e] = (torch.einsum("thk,hkv->htv", qc * growth, state) + qk @ u).transpose(0, 1)
        last = cum[-1]  # [H, Dk]
        state = state * last.exp().unsqueeze(-1) + torch.einsum("jhk,hjv->hkv", kc * (last - cum).exp(), u)
    return out, state


# ---- the layer --------------------------------------------------------------------------------

class ConvWeight(nn.Module):
    """Holds a depthwise conv kernel [channels, 1, width] under the checkpoint's `*_conv1d.weight`."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.weight = frozen(channels, 1, width, dtype=dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = frozen(dim, dtype=dtype)
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, self.weight, gate, self.eps)


class KimiDeltaAttention(KeepFloat32, nn.Module):
    """Heads split across TP ranks: q/k/v, their convs, f_b, b, the output gate (g_proj or g_b)
    and dt_bias/A_log by head; f_a, g_a and o_norm replicated; o_proj row-parallel."""

    fp32_tensors = ("dt_bias", "A_log")

    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        heads, d = cfg.kda_num_heads, cfg.kda_head_dim
        kda_state_shapes(cfg, tp.world_size)  # validates the head split
        lower_bound = cfg.kda_gate_lower_bound
        if lower_bound is not None and not float(lower_bound) < 0:
            raise ConfigError(f"linear_attn_config.gate_lower_bound={lower_bound} must be negative")
        if cfg.kda_conv_size < 2:
            raise ConfigError(f"linear_attn_config.short_conv_kernel_size={cfg.kda_conv_size} must be at least 2")
        self.layer_idx = layer_idx
        self.num_heads = heads // tp.world_size
        self.head_dim = d
        self.conv_size = cfg.kda_conv_size
        self.lower_bound = float(lower_bound) if lower_bound is not None else None
        # "auto": FLA's kernels for CUDA tensors when fla imports; "torch" or "fla" force one.
        self.backend = "auto"
        h, proj = cfg.hidden_size, heads * d
        local = proj // tp.world_size
        self.q_proj = ColumnParallelLinear(h, proj, tp, dtype)
        self.k_proj = ColumnParallelLinear(h, proj, tp, dtype)
        self.v_proj = ColumnParallelLinear(h, proj, tp, dtype)
        self.q_conv1d = ConvWeight(local, self.conv_size, dtype)
        self.k_conv1d = ConvWeight(local, self.conv_size, dtype)
        self.v_conv1d = ConvWeight(local, self.conv_size, dtype)
        self.f_a_proj = ReplicatedLinear(h, d, dtype)
        self.f_b_proj = ColumnParallelLinear(d, proj, tp, dtype)
        self.dt_bias = frozen(local, dtype=torch.float32)
        self.A_log = frozen(self.num_heads, dtype=torch.float32)
        self.b_proj = ColumnParallelLinear(h, heads, tp, dtype)
        self.full_rank_gate = cfg.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = ColumnParallelLinear(h, proj, tp, dtype)
        else:
            self.g_a_proj = ReplicatedLinear(h, d, dtype)
            self.g_b_proj = ColumnParallelLinear(d, proj, tp, dtype)
        self.o_norm = GatedRMSNorm(d, O_NORM_EPS, dtype)
        self.o_proj = RowParallelLinear(proj, h, tp, dtype)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: AttnMetadata, state: KDAState | None) -> torch.Tensor:
        if kda_step.fits(self, x, meta, state):
            return kda_step.run(self, x, meta, state)
        inputs, gate = self.project(x)
        return self.output(self.attend(*inputs, meta, state), gate)

    def project(self, x: torch.Tensor, into: tuple | None = None, f_b: bool = True) -> tuple[tuple, torch.Tensor]:
        """x [T, H] -> ((pre-conv q|k|v [T, 3 * heads * d], raw gate [T, heads, d], raw beta
        [T, heads]), output gate [T, heads * d]): the per-token part before the recurrence, which
        depends on the token count only (prefill_graphs.py captures it). `into`: buffers for the
        first three (`step_buffers`). f_b=False: the raw gate's slot holds f_a's output [T, d]
        (kda_step's kernel projects it)."""
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        one_launch = self._input_projections(x)
        if one_launch is not None:
            mixed, gate_in, f_a, raw_beta = one_launch
            mixed = into[0].copy_(mixed) if into is not None else mixed
        else:
            mixed = cat_last([self.q_proj(x), self.k_proj(x), self.v_proj(x)], into[0] if into is not None else None)
            gate_in = self.g_proj(x) if self.full_rank_gate else self.g_a_proj(x)
            f_a = self.f_a_proj(x)
            raw_beta = self.b_proj(x)
        raw_g = self.f_b_proj(f_a).view(t, heads, d) if f_b else f_a
        if into is not None:
            raw_g, raw_beta = into[1].copy_(raw_g), into[2].copy_(raw_beta)
        gate = gate_in if self.full_rank_gate else self.g_b_proj(gate_in)
        return (mixed, raw_g, raw_beta), gate

    def _input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """(q|k|v, the output gate or its low-rank input, f_a's output, raw beta) as views of one
        GEMV launch over the six weights (gemv_multi, a decode step's rows), or None."""
        mods = [self.q_proj, self.k_proj, self.v_proj, self.g_proj if self.full_rank_gate else self.g_a_proj,
                self.f_a_proj, self.b_proj]
        weights = [m.weight for m in mods]
        if any(m.weight_scale_inv is not None for m in mods) or not gemv_multi.supported(x, weights):
            return None
        y = gemv_multi.run(x, weights)
        if y is None:
            return None
        p, g, f = weights[0].shape[0], weights[3].shape[0], weights[4].shape[0]
        return y[:, :3 * p], y[:, 3 * p:3 * p + g], y[:, 3 * p + g:3 * p + g + f], y[:, 3 * p + g + f:]

    def step_buffers(self, n: int, dtype: torch.dtype, device) -> tuple[tuple, torch.Tensor]:
        """Zeroed buffers for `project`'s attention inputs and `attend`'s output, n rows."""
        heads, d = self.num_heads, self.head_dim
        inputs = (torch.zeros(n, 3 * heads * d, dtype=dtype, device=device),
                  torch.zeros(n, heads, d, dtype=dtype, device=device), torch.zeros(n, heads, dtype=dtype, device=device))
        return inputs, torch.zeros(n, heads, d, dtype=dtype, device=device)

    def output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        t, heads, d = core.shape
        return self.o_proj(self.o_norm(core, gate.view(t, heads, d)).view(t, heads * d))

    def attend(self, mixed: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor, meta: AttnMetadata,
               state: KDAState | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The short convs and the delta-rule recurrence over the chunks, from and into their state
        rows -> core [T, heads, d] (into `out` when given). Always eager: it depends on the chunks."""
        t, heads, d = mixed.shape[0], self.num_heads, self.head_dim
        if state is None and any(p != 0 for p in meta.start_positions):
            raise ValueError("without a KDA state cache every chunk must start at position 0")
        use_fla = self._use_fla(mixed)
        if (use_fla and out is None and state is not None and not meta.prefill_chunks
                and meta.state_slots is not None and kda_ops.decode_conv_enabled()):
            return self._decode_fused(mixed, raw_g, raw_beta, meta, state)
        core = mixed.new_empty(t, heads, d) if out is None else out
        if state is None:
            prefills = list(range(len(meta.query_lens)))  # cache-less: one-token chunks too start from zeros
        else:
            prefills = meta.prefill_chunks
            # A device shape, not len(meta.query_lens): a compiled layer would guard on that list's
            # length and compile once per captured batch size.
            if meta.decode_token_idx.shape[0] > 0:
                self._decode(mixed, raw_g, raw_beta, meta, state, core, use_fla)
        if prefills:
            self._prefill(prefills, mixed, raw_g, raw_beta, meta, state, core, use_fla)
        return core

    def _use_fla(self, x: torch.Tensor) -> bool:
        if self.backend == "torch" or not x.is_cuda:
            return False
        if not fla_available():
            if self.backend == "fla":
                raise RuntimeError("KDA backend 'fla' asked for, but fla (fla-core) does not import")
            return False
        return True

    def _conv_weight(self) -> torch.Tensor:
        # Concatenated per call: a pool may swap the parameters' storage under us.
        ws = [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        return torch.cat(ws, dim=0).view(-1, self.conv_size)

    # ---- decodes: one batched step, device-side indices only ----------------------------------
    def _decode(self, mixed, raw_g, raw_beta, meta: AttnMetadata, state: KDAState, core: torch.Tensor,
                use_fla: bool) -> None:
        heads, d = self.num_heads, self.head_dim
        idx = meta.decode_token_idx
        if not meta.prefill_chunks and meta.state_slots is not None:
            rows = meta.state_slots  # all chunks are decodes, in decode order
        else:
            decode_chunks = [i for i, n in enumerate(meta.query_lens) if n == 1]
            rows = torch.tensor([meta.state_slots_list[i] for i in decode_chunks], dtype=torch.long,
                                device=mixed.device)
        positions = meta.positions.index_select(0, idx)
        # The host's start_positions cannot decide this: a captured graph replays for every batch.
        fresh = (positions == 0).view(-1, 1, 1)

        # Causal conv over [history | new input]; a fresh sequence's history is zeros (where, not
        # a product: an unwritten row may hold anything, NaN included).
        hist = state.conv.index_select(0, rows)
        hist = torch.where(fresh, torch.zeros((), dtype=hist.dtype, device=hist.device), hist)
        window = torch.cat([hist, mixed.index_select(0, idx).unsqueeze(-1).to(hist.dtype)], dim=-1)
        write_rows(state.conv, rows, window[..., 1:])
        qkv = F.silu((window.float() * self._conv_weight().float()).sum(-1)).to(mixed.dtype)
        g_raw = raw_g.index_select(0, idx)
        beta_raw = raw_beta.index_select(0, idx)

        if use_fla:
            o = self._fla_step(*qkv.view(qkv.shape[0], 3, heads * d).unbind(1), g_raw, beta_raw, state, rows, positions)
            core.index_copy_(0, idx, o.to(core.dtype))
            return

        q, k, v = split_heads(qkv, heads, d)
        g = kda_gate(g_raw, self.dt_bias, self.A_log, self.lower_bound)
        beta = torch.sigmoid(beta_raw.float())
        s0 = state.recurrent.index_select(0, rows)
        s0 = torch.where(fresh.unsqueeze(-1), torch.zeros((), dtype=s0.dtype, device=s0.device), s0)
        o, s1 = recurrent_step(q, k, v, g, beta, s0)
        write_rows(state.recurrent, rows, s1)
        # Rounded to the model dtype before the norm, as transformers and vLLM (and FLA's output) do.
        core.index_copy_(0, idx, o.to(core.dtype))

    def _decode_fused(self, mixed, raw_g, raw_beta, meta: AttnMetadata, state: KDAState) -> torch.Tensor:
        """An all-decode step (token i is sequence i's) on two Triton launches and FLA's: the
        short convs (kda_ops.decode_conv), then the recurrent step on its outputs as they are."""
        rows = meta.state_slots
        q, k, v = kda_ops.decode_conv(mixed, state.conv, rows, meta.positions, self.q_conv1d.weight,
                                      self.k_conv1d.weight, self.v_conv1d.weight)
        return self._fla_step(q, k, v, raw_g, raw_beta, state, rows, meta.positions)

    def _fla_step(self, q, k, v, g_raw, beta_raw, state: KDAState, rows: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """FLA's recurrent step for one token a row: q, k, v [B, heads * d] post-conv, g_raw [B,
        heads, d], beta_raw [B, heads] -> o [B, heads, d], the rows' recurrent state advanced."""
        b, heads, d = q.shape[0], self.num_heads, self.head_dim
        rec = state.recurrent
        if not kda_ops.state_rows_fit(rec, d):
            raise ValueError("FLA's KDA kernels need float32 recurrent rows, contiguous within a row")
        return fla_decode(q.view(b, heads, d), k.view(b, heads, d), v.view(b, heads, d), g_raw.view(b, heads, d),
                          beta_raw.view(b, heads), self.A_log, self.dt_bias, rec, rows, positions, d ** -0.5,
                          self.lower_bound)

    # ---- prefill chunks: per sequence, from the row's state -----------------------------------
    def _prefill(self, chunks: list[int], mixed, raw_g, raw_beta, meta: AttnMetadata, state: KDAState | None,
                 core: torch.Tensor, use_fla: bool) -> None:
        heads, d, hist_len = self.num_heads, self.head_dim, self.conv_size - 1
        qsl = meta.query_starts
        weight = self._conv_weight().float().unsqueeze(1)
        spans, conts, rows, qkvs = [], [], [], []
        for i in chunks:
            s, e = qsl[i], qsl[i + 1]
            cont = state is not None and meta.start_positions[i] > 0
            row = meta.state_slots_list[i] if state is not None else -1
            x_t = mixed[s:e].t()  # [3C, L]
            hist = state.conv[row].to(x_t.dtype) if cont else x_t.new_zeros(x_t.shape[0], hist_len)
            window = torch.cat([hist, x_t], dim=-1)
            if state is not None:
                state.conv[row] = window[:, window.shape[1] - hist_len:]
            conv = F.conv1d(window.float().unsqueeze(0), weight, groups=window.shape[0])[0]  # [3C, L]
            qkvs.append(F.silu(conv).t().to(mixed.dtype))
            spans.append((s, e))
            conts.append(cont)
            rows.append(row)

        if use_fla:
            self._prefill_fla(spans, conts, rows, qkvs, raw_g, raw_beta, state, core)
            return
        for (s, e), cont, row, qkv in zip(spans, conts, rows, qkvs):
            q, k, v = split_heads(qkv, heads, d)
            g = kda_gate(raw_g[s:e], self.dt_bias, self.A_log, self.lower_bound)
            beta = torch.sigmoid(raw_beta[s:e].float())
            s0 = state.recurrent[row].float() if cont else q.new_zeros(heads, d, d)
            o, s1 = chunked_kda(q, k, v, g, beta, s0)
            if state is not None:
                state.recurrent[row] = s1
            core[s:e] = o.to(core.dtype)

    def _prefill_fla(self, spans, conts, rows, qkvs, raw_g, raw_beta, state: KDAState | None,
                     core: torch.Tensor) -> None:
        """All prefill chunks in one varlen `chunk_kda` call."""
        heads, d = self.num_heads, self.head_dim
        device = core.device
        lens = [e - s for s, e in spans]
        qkv = torch.cat(qkvs, dim=0)
        total = qkv.shape[0]
        q, k, v = (part.contiguous().view(1, total, heads, d) for part in qkv.view(total, 3, heads * d).unbind(1))
        g = torch.cat([raw_g[s:e] for s, e in spans], dim=0).view(1, total, heads, d)
        beta = torch.cat([raw_beta[s:e] for s, e in spans], dim=0).view(1, total, heads)
        cu_cpu = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
        h0 = None
        if state is not None:
            h0 = torch.zeros(len(spans), heads, d, d, dtype=torch.float32, device=device)
            cont = [j for j, c in enumerate(conts) if c]
            if cont:
                h0[cont] = state.recurrent[[rows[j] for j in cont]].float()
        lb = self.lower_bound
        o, ht = fla_kda().chunk_kda(
            q=q, k=k, v=v, g=g, beta=beta, scale=d ** -0.5, initial_state=h0,
            output_final_state=state is not None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=lb,
            # FLA's faster intra-chunk path holds for gates bounded in [-5, 0).
            safe_gate=lb is not None and -5 <= lb < 0,
            cu_seqlens=cu_cpu.to(device), cu_seqlens_cpu=cu_cpu)
        if state is not None:
            state.recurrent[rows] = ht.to(state.recurrent.dtype)
        o = o.view(total, heads, d).to(core.dtype)
        for (s, e), start in zip(spans, cu_cpu.tolist()):
            core[s:e] = o[start:start + e - s]
