"""Dummy weights drawn on the rank's own device: seconds for a model of several GB where the
seeded CPU draw (checkpoint.init_dummy_weights, the same model at every TP size) takes a minute
or more. For benchmarks (`--dummy-weights device`): the values differ between TP sizes."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from .specs import weight_specs

_DRAWABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.no_grad()
def init_dummy_weights_on_device(model: torch.nn.Module, cfg: ModelConfig, seed: int = 0) -> None:
    """The same kinds of values as the seeded draw (norms 1, small biases, KDA decay rates and
    time steps in their ranges, matrices N(0, initializer_range)); FP8 scales 1."""
    kinds = {s.param: s.kind for s in weight_specs(cfg)}
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        kind = kinds.get(name, "matrix")
        if kind in ("norm", "scale") or name.endswith("_scale_inv"):
            p.fill_(1.0)
            continue
        # normal_ has no FP8 kernel: draw in bf16 and cast.
        t = p if p.dtype in _DRAWABLE else torch.empty(p.shape, dtype=torch.bfloat16, device=device)
        if kind == "a_log":  # exp(A_log) in [1, 16]
            t.uniform_(1.0, 16.0, generator=gen).log_()
        elif kind == "dt_bias":  # inverse softplus of a time step in [1e-3, 1e-1]
            dt = torch.empty(p.shape, dtype=torch.float32, device=device)
            dt.uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_()
            t.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:
            t.normal_(0.0, 0.01 if kind == "bias" else cfg.initializer_range, generator=gen)
        if t is not p:
            p.copy_(t)
