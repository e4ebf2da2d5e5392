"""The MoE tail: the call site every MoE layer goes through, fused or not.

`out = sum_r shared_r + W_up . RMSNorm(sum_r routed_r)` over TP ranks r (DESIGN §1).

`TailRunner` (one per MoE layer) picks the fused collective per call when it is enabled and
the batch is small enough, else the unfused reference path (process-group all-reduces).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..model.fusion import fused
from ..model.layers import linear
from ..parallel import TPGroup


class TailTimeout(RuntimeError):
    """A fused-tail spin-wait passed its deadline: peers' data never arrived."""


class FusedTailCollective(Protocol):
    """One per rank, shared by all MoE layers (they run one after another)."""

    max_tokens: int

    def fused_tail(self, routed_partial: torch.Tensor, shared_partial: torch.Tensor,
                   norm_weight: torch.Tensor | None, up_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """routed_partial [M, L], shared_partial [M, H] (un-reduced partials); norm_weight [L] or None
        (no latent norm); up_weight [H, L] (full, replicated); returns out [M, H], bit-identical
        on every rank."""

    def epoch(self) -> int: ...


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def latent_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`routed_expert_norm` of the reduced latent; a model without one (latent_moe_use_norm false)
    up-projects the sum as it is, as vLLM's Kimi-K3 does."""
    return x if weight is None else rms_norm(x, weight, eps)


def unfused_tail(tp: TPGroup, routed_partial: torch.Tensor, shared_partial: torch.Tensor,
                 norm_weight: torch.Tensor | None, up_weight: torch.Tensor, eps: float) -> torch.Tensor:
    routed = tp.all_reduce(routed_partial.contiguous())
    latent = latent_norm(routed, norm_weight, eps)
    out = linear(latent, up_weight)
    return out + tp.all_reduce(shared_partial.contiguous())


@torch.compiler.disable
def _opaque_fused_tail(collective, routed_partial, shared_partial, norm_weight, up_weight, eps):
    """A compiled decoder layer calls the fused tail through here: a graph break, so its kernel
    launches run as eager code between the layer's compiled parts (and into a CUDA graph)."""
    return collective.fused_tail(routed_partial, shared_partial, norm_weight, up_weight, eps)


class TailRunner:
    """Per-layer tail: fused when enabled and M <= the collective's token limit, else unfused."""

    def __init__(self, layer_idx: int, tp: TPGroup, mode: str = "auto",
                 collective: FusedTailCollective | None = None):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"fused_tail must be 'auto', 'on' or 'off', got {mode!r}")
        self.layer_idx = layer_idx
        self.tp = tp
        self.mode = mode
        self.collective = collective
        self.fused_calls = 0
        self.unfused_calls = 0
        self.disabled_reason: str | None = None
        if mode == "off":
            self.disabled_reason = "fused_tail=off"
        elif collective is None:
            self.disabled_reason = "no fused collective on this rank (TP 1, or ranks span nodes)"

    @property
    def fused(self) -> bool:
        return self.collective is not None and self.mode != "off"

    def __call__(self, routed_partial: torch.Tensor, shared_partial: torch.Tensor,
                 norm_weight: torch.Tensor | None, up_weight: torch.Tensor, eps: float) -> torch.Tensor:
        m = routed_partial.shape[0]
        # Counted in eager calls only: a count read inside torch.compile would be a guard that
        # changes on every call (a recompile each time).
        count = not torch.compiler.is_compiling()
        if self.fused and m <= self.collective.max_tokens:
            if count:
                self.fused_calls += 1
            else:  # traced by a compiled layer: the collective's host code stays out of the graph
                return _opaque_fused_tail(self.collective, routed_partial, shared_partial, norm_weight,
                                          up_weight, eps)
            return self.collective.fused_tail(routed_partial, shared_partial, norm_weight, up_weight, eps)
        if count:
            self.unfused_calls += 1
        return unfused_tail(self.tp, routed_partial, shared_partial, norm_weight, up_weight, eps)

    def state(self, live: bool = True) -> dict:
        """live=False: the flags' memory is asleep (unmapped on a GPU), so the epoch is not read."""
        return {
            "layer": self.layer_idx,
            "fused": self.fused,
            "fused_calls": self.fused_calls,
            "unfused_calls": self.unfused_calls,
            "epoch": self.collective.epoch() if self.collective is not None and live else None,
            "reason": self.disabled_reason,
        }
