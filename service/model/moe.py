"""DeepSeek-V3 MoE with the optional Kimi-K3 latent projection (DESIGN §1).

Routed experts are sharded along their intermediate dim, so every rank computes an
un-reduced partial of the routed output; the router, the latent down/up projections and the
latent norm are replicated. Latent layers hand both partials to their `TailRunner`, which
reduces them (fused or not) and applies the norm and the up-projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel import TPGroup
from ..tail.base import TailRunner, latent_norm
from . import add_norm, cpu_kernels, dense_mm, fp8_moe, gemv, moe_entry, moe_grouped, moe_kernels
from .fusion import fused
from .layers import GatedMLP, KeepFloat32, ReplicatedLinear, RMSNorm, act_and_mul, act_params, frozen


class TopkRouter(KeepFloat32, nn.Module):
    """Sigmoid (or softmax) scores in fp32; experts chosen on score + bias (group-limited when
    n_group > 1); weights are the unbiased scores of the chosen experts."""

    fp32_tensors = ("e_score_correction_bias",)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.softmax = cfg.scoring_func == "softmax"
        self.weight = frozen(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        # A weight trainers update (load balancing), hence a parameter, not a buffer.
        self.e_score_correction_bias = frozen(cfg.n_routed_experts, dtype=torch.float32)

    def choice(self) -> tuple:
        """How the kernels choose: (n_group, topk_group, top_k, norm_topk_prob, scaling, softmax)."""
        return self.n_group, self.topk_group, self.top_k, self.norm_topk_prob, float(self.scaling), self.softmax

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and ids from fp32 logits computed elsewhere (moe_entry), on the device."""
        return torch.ops.latentserve.moe_route_select(logits, self.e_score_correction_bias, *self.choice())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (weights [M, k] fp32, expert ids [M, k])."""
        if moe_kernels.route_supported(x, self.weight.shape[0], self.n_group):
            out = moe_kernels.call(torch.ops.latentserve.moe_route, x, self.weight, self.e_score_correction_bias,
                                   self.n_group, self.topk_group, self.top_k, self.norm_topk_prob,
                                   float(self.scaling), self.softmax)
            if out is not None:
                return out
        if moe_kernels.select_supported(x, self.weight.shape[0], self.n_group):  # prefill: cuBLAS logits
            out = moe_kernels.call(self.select, F.linear(x.float(), self.weight.float()))
            if out is not None:
                return out
        return route(x, self.weight, self.e_score_correction_bias, self.n_group, self.topk_group, self.top_k,
                     self.norm_topk_prob, self.scaling, self.softmax)


@fused
def route(x, weight, bias, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float,
          softmax: bool = False):
    logits = F.linear(x.float(), weight.float())
    scores = logits.softmax(dim=-1) if softmax else logits.sigmoid()
    choice = scores + bias
    if n_group > 1:
        m, e = choice.shape
        grouped = choice.view(m, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_mm_fast(x: torch.Tensor) -> bool:
    """torch._grouped_mm has fused CUTLASS kernels for bf16 on sm_90/sm_100 only; elsewhere it
    falls back to a loop that syncs with the host, no better than `per_expert`."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


class FusedExperts(nn.Module):
    """All routed experts of a layer in two tensors, this rank's intermediate shard:
    w13 [E, 2*I/tp, W] (gate rows, then up rows: one matmul for both) and w2 (down) [E, W, I/tp]."""

    def __init__(self, cfg: ModelConfig, width: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        num_experts = cfg.n_routed_experts
        shard = cfg.moe_intermediate_size // tp.world_size
        self.act = act_and_mul(cfg)
        self.act_name, self.act_beta, self.act_linear_beta = act_params(cfg)
        self.num_experts = num_experts
        self.shard = shard
        self.w13 = frozen(num_experts, 2 * shard, width, dtype=dtype)
        self.w2 = frozen(num_experts, width, shard, dtype=dtype)
        # An FP8 model registers the experts' block scales here (model/fp8.quantize_parameters).
        self.register_parameter("w13_scale_inv", None)
        self.register_parameter("w2_scale_inv", None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [M, W]; weights/ids [M, k]. Returns this rank's partial sum over experts [M, W]."""
        if self.w13_scale_inv is not None:  # FP8 block-scaled experts (model/fp8_moe.py)
            return fp8_moe.experts(self, x, weights, ids)
        grouped = moe_grouped.supported(x, self.w13, self.w2, self.act_name)
        if self._gemv_kernels(x, grouped):  # few tokens
            out = moe_kernels.call(torch.ops.latentserve.moe_experts, x, self.w13, self.w2, weights, ids,
                                   self.act_name, self.act_beta, self.act_linear_beta)
            if out is not None:
                return out
        # More tokens: the Triton grouped GEMM (prefill too, unless a cap hands it to torch._grouped_mm).
        if self._grouped_kernels(x, grouped):
            out = moe_kernels.call(torch.ops.latentserve.moe_grouped_experts, x, self.w13, self.w2, weights, ids,
                                   self.act_name, self.act_beta, self.act_linear_beta)
            if out is not None:
                return out
        return self.torch_experts(x, weights, ids, self.w13, self.w2)

    def torch_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
        """`forward` in torch ops, where no Triton kernel took it, with these expert weights (the
        layer's own, or its FP8 ones dequantized by fp8_moe)."""
        if grouped_mm_fast(x):  # LATENTSERVE_MOE_GROUPED=torch: the bench's baseline
            return self.grouped(x, weights, ids, w13, w2)
        if x.device.type == "cpu" and x.shape[0] <= 64:
            out = cpu_kernels.moe_silu(x, w13, w2, weights, ids) if self.act_name == "silu" else None
            if out is None:
                out = self.padded(x, weights, ids, w13, w2)
            if out is not None:
                return out
        return self.per_expert(x, weights, ids, w13, w2)

    def _gemv_kernels(self, x: torch.Tensor, grouped: bool) -> bool:
        """The GEMV expert kernels take these tokens (16-bit ones: up to the grouped GEMM's start)."""
        return moe_kernels.experts_supported(x, self.act_name) and not (
            grouped and x.shape[0] >= moe_kernels.grouped_from_tokens())

    def _grouped_kernels(self, x: torch.Tensor, grouped: bool) -> bool:
        limit = moe_grouped.max_tokens()
        return grouped and (limit is None or x.shape[0] <= limit or not grouped_mm_fast(x))

    def parts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """Where `forward` runs our Triton kernels (the GEMV experts, the grouped GEMM): their
        weighted fp32 outputs a (token, slot) pair [M * k, W], not yet summed
        (moe_experts_parts, moe_grouped_experts_parts); else None."""
        if self.w13_scale_inv is not None:
            return None
        grouped = moe_grouped.supported(x, self.w13, self.w2, self.act_name)
        if self._gemv_kernels(x, grouped):
            op = torch.ops.latentserve.moe_experts_parts
        elif self._grouped_kernels(x, grouped):
            op = torch.ops.latentserve.moe_grouped_experts_parts
        else:
            return None
        return moe_kernels.call(op, x, self.w13, self.w2, weights, ids, self.act_name, self.act_beta,
                                self.act_linear_beta)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor | None = None,
                w2: torch.Tensor | None = None) -> torch.Tensor:
        """Two grouped GEMMs over the (token, expert) pairs sorted by expert. No host sync and
        static shapes, so it runs inside CUDA graphs; deterministic (no atomics)."""
        w13, w2 = self.w13 if w13 is None else w13, self.w2 if w2 is None else w2
        m, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group; empty groups allowed
        xs = x.index_select(0, order // k)
        h = self._act(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs).float()
        y = y * weights.flatten().index_select(0, order).unsqueeze(1)
        # Back to (token, slot) order, then a fixed-order sum over the k slots.
        pairs = torch.empty_like(y).index_copy_(0, order, y)
        return pairs.view(m, k, -1).sum(dim=1).to(x.dtype)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.act(gate_up[:, : self.shard], gate_up[:, self.shard:])

    def padded(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor | None = None,
               w2: torch.Tensor | None = None) -> torch.Tensor | None:
        """CPU, few tokens: each expert's rows padded to the busiest expert's count, so all
        experts run as two batched matmuls (~15 ops for the layer, not ~8 per active expert);
        the zero padding rows are never read back. Slot-order sum, as `grouped`. None when the
        padding would more than triple the rows (skewed or very sparse routing)."""
        w13, w2 = self.w13 if w13 is None else w13, self.w2 if w2 is None else w2
        m, k = ids.shape
        num, width = self.num_experts, x.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=num)
        cap = int(counts.max())  # the layer's one host sync
        if num * cap > 3 * flat.numel():
            return None
        expert = flat[order]
        row = expert * cap + torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert]
        xs = x.new_zeros(num * cap, width).index_copy_(0, row, x[order // k])
        gate_up = torch.bmm(xs.view(num, cap, width), w13.transpose(1, 2))
        h = self.act(gate_up[..., : self.shard], gate_up[..., self.shard:])
        y = torch.bmm(h, w2.transpose(1, 2)).view(num * cap, width)[row].float()
        y = y * weights.flatten()[order].unsqueeze(1)
        pairs = torch.empty_like(y).index_copy_(0, order, y)
        return pairs.view(m, k, width).sum(dim=1).to(x.dtype)

    def per_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor | None = None,
                   w2: torch.Tensor | None = None) -> torch.Tensor:
        w13, w2 = self.w13 if w13 is None else w13, self.w2 if w2 is None else w2
        k = ids.shape[1]
        out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        tokens = order // k
        token_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts)
        active = counts.nonzero().flatten()
        # One host sync for the whole layer: (expert, first row, rows) of every active expert.
        plan = torch.stack([active, (counts.cumsum(0) - counts)[active], counts[active]]).tolist()
        # One matmul chain per expert that got tokens: no per-token loop.
        for e, start, n in zip(*plan):
            tok = tokens[start:start + n]
            xe = x[tok]
            h = self._act(F.linear(xe, w13[e]))
            y = F.linear(h, w2[e]).float() * token_weights[start:start + n, None]
            out.index_add_(0, tok, y)
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_idx: int, dtype: torch.dtype,
                 tail: TailRunner | None):
        super().__init__()
        self.tp = tp
        self.layer_idx = layer_idx
        self.latent = cfg.is_latent
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        width = cfg.moe_latent_size or h
        self.gate = TopkRouter(cfg, dtype)
        self.experts = FusedExperts(cfg, width, tp, dtype)
        self.shared_experts = (GatedMLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, tp, dtype)
                               if cfg.n_shared_experts else None)
        self.tail = None
        if self.latent:
            self.routed_expert_down_proj = ReplicatedLinear(h, width, dtype)
            self.routed_expert_norm = RMSNorm(width, self.eps, dtype) if cfg.latent_moe_use_norm else None
            self.routed_expert_up_proj = ReplicatedLinear(width, h, dtype)
            self.tail = tail if tail is not None else TailRunner(layer_idx, tp, "off")

    def forward(self, x: torch.Tensor, entry: tuple | None = None, routing: tuple | None = None) -> torch.Tensor:
        """entry: `moe_entry`'s outputs for x, computed by the caller (`folded`); routing: the
        (weights, ids) its kernel chose too, if it did."""
        norm = self._norm_weight() if self.latent else None
        entry = entry if entry is not None else self._entry(x)
        if entry is not None:  # router, latent down and shared gate/up in one kernel (moe_entry)
            latent, h, logits = entry
            weights, ids = routing if routing is not None else self.gate.select(logits)
            out = self._slots_tail(latent, weights, ids, h, norm)
            if out is not None:
                return out
            routed_partial = self._normed_routed(latent, weights, ids, norm)
            if routed_partial is not None:  # normed already
                norm = None
            else:
                routed_partial = self.experts(latent, weights, ids)
            out = self._one_rank_tail(routed_partial, h, norm)
            if out is not None:
                return out
            shared_partial = self.shared_experts.down_proj(h, reduce=False)
        else:
            routed_in = self.routed_expert_down_proj(x) if self.latent else x
            routed_partial = self.experts(routed_in, *self.gate(x))
            shared_partial = (self.shared_experts(x, reduce=False) if self.shared_experts is not None
                              else torch.zeros_like(x))
        if not self.latent:
            return self.tp.all_reduce(routed_partial + shared_partial)
        return self.tail(routed_partial, shared_partial, norm, self.routed_expert_up_proj.weight, self.eps)

    def _norm_weight(self) -> torch.Tensor | None:
        return self.routed_expert_norm.weight if self.routed_expert_norm is not None else None

    def _one_rank_tail(self, routed: torch.Tensor, h: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor | None:
        """TP 1, up to gemv.max_rows() tokens: the latent's up-projection and the shared experts'
        down-projection land in the same rows, so one GEMV launch sums both (tail.unfused_tail's
        math, with the sum rounded once); above, two cuBLAS launches (dense_mm.mm_t_sum); None
        where neither applies. norm: the latent norm's weight, None where there is none or
        `routed` is normed already."""
        down = self.shared_experts.down_proj
        if self.tp.world_size != 1:
            return None
        up, scale = self.routed_expert_up_proj.weight, down.weight_scale_inv  # scale: an FP8 model's
        if not gemv.pair_supported(routed, up, h, down.weight, scale):
            same = routed.dtype == up.dtype == h.dtype == down.weight.dtype  # latent_norm keeps the dtype
            if scale is not None or not same or not dense_mm.enabled(routed):
                return None
            # cuBLAS's rows: the second product accumulates onto the first
            return torch.ops.latentserve.mm_t_sum(latent_norm(routed, norm, self.eps), up, h, down.weight)
        if norm is not None and routed.shape[0] <= gemv.pair_norm_max_rows():  # the norm in the same launch
            return gemv.run(torch.ops.latentserve.gemv_pair_normed, routed, norm, self.eps, up, h, down.weight, 0,
                            scale)
        return gemv.run(torch.ops.latentserve.gemv_pair, latent_norm(routed, norm, self.eps), up, h, down.weight,
                        scale)

    def _normed_routed(self, latent: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       norm: torch.Tensor | None) -> torch.Tensor | None:
        """TP 1 from two rows (LATENTSERVE_MOE_SLOT_NORM, on by default): the experts' outputs
        summed and latent-normed (weight `norm`) in one kernel (moe_slot_sum_norm), where the norm
        was a kernel of its own before the paired GEMV (one row keeps the pair norm); else None."""
        if not (moe_kernels.slot_norm_enabled() and self.tp.world_size == 1 and norm is not None
                and latent.shape[0] > gemv.pair_norm_max_rows()):
            return None
        parts = self.experts.parts(latent, weights, ids)
        return None if parts is None else moe_kernels.call(torch.ops.latentserve.moe_slot_sum_norm, parts,
                                                           ids.shape[1], norm, self.eps)

    def _slots_tail(self, latent: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, h: torch.Tensor,
                    norm: torch.Tensor | None) -> torch.Tensor | None:
        """`_one_rank_tail` from the experts' unsummed outputs (LATENTSERVE_GEMV_PAIR_SLOTS=1, 0.99x
        at batch 1 in runs 51 and 58): the slot sum, the latent norm, the up-projection and the
        shared down-projection in one launch, where the slot sum was a kernel of its own (1.7 us a
        layer at batch 1 without PDL, run 45). One row, where the pair norm runs; else None."""
        down, up = self.shared_experts.down_proj, self.routed_expert_up_proj.weight
        if not (gemv.pair_slots_enabled() and self.tp.world_size == 1 and norm is not None and latent.shape[0] == 1
                and gemv.pair_norm_max_rows() >= 1
                and gemv.pair_supported(latent, up, h, down.weight, down.weight_scale_inv)):
            return None
        parts = self.experts.parts(latent, weights, ids)
        return None if parts is None else gemv.run(torch.ops.latentserve.gemv_pair_normed, parts, norm, self.eps, up,
                                                   h, down.weight, ids.shape[1], down.weight_scale_inv)

    def folded(self, h: torch.Tensor, add: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + add, this layer's output for norm(h + add)) with the add and the norm inside the entry
        kernel (add_norm.py: one row, LATENTSERVE_FOLD_ADD_NORM), or None where it does not run."""
        if not add_norm.enabled(h, add):
            return None
        weights = self._entry_weights(h, (None, None))  # FP8 weights fail it and keep the compiled norm
        if weights is None:
            return None
        shared = self.shared_experts
        args = (h, add, norm.weight, norm.eps, *weights, shared.act_name, shared.act_beta, shared.act_linear_beta)
        if moe_entry.select_enabled():  # the experts chosen in the entry kernel too
            out = moe_entry.run_select(*args, self.gate.e_score_correction_bias, *self.gate.choice())
            if out is not None:
                latent, gated, logits, h, *routing = out
                return h, self.forward(h, entry=(latent, gated, logits), routing=tuple(routing))
        out = add_norm.run(torch.ops.latentserve.moe_entry_add_norm, *args)
        if out is None:
            return None
        *entry, h = out
        return h, self.forward(h, entry=tuple(entry))

    def _entry_weights(self, x: torch.Tensor, scales: tuple) -> tuple | None:
        """(latent down, shared gate/up, router) weights when the entry kernel takes x with them
        (`scales`: an FP8 model's block scales of the first two, or Nones), else None."""
        shared = self.shared_experts
        if not (self.latent and shared is not None):
            return None
        weights = self.routed_expert_down_proj.weight, shared.gate_up_proj.weight, self.gate.weight
        if not (moe_entry.supported(x, *weights, shared.act_name, *scales)
                and moe_kernels.route_supported(x, weights[2].shape[0], self.gate.n_group)):
            return None
        return weights

    def _entry(self, x: torch.Tensor):
        """(latent, shared experts' activation, router logits) from one kernel, or None."""
        if not (self.latent and self.shared_experts is not None):
            return None
        scales = self.routed_expert_down_proj.weight_scale_inv, self.shared_experts.gate_up_proj.weight_scale_inv  # FP8
        weights = self._entry_weights(x, scales)
        if weights is None:
            return None
        shared = self.shared_experts
        return moe_kernels.call(torch.ops.latentserve.moe_entry, x, *weights, shared.act_name, shared.act_beta,
                                shared.act_linear_beta, *scales)
