"""The MoE router's selection inside the gate/up kernel (moe.route_in_gate_up) against its own
kernel, at the `small` preset's experts and at Kimi-K3's (896 experts, top 16), one GPU.

    python bench/moe_route.py [--tokens 1 4 8 16] [--json out.json]

Each line times, as CUDA graphs of back-to-back calls (bench/gemv.graph_seconds), the routed
experts from fp32 router logits two ways: `separate` = the selection kernel then the expert
kernels (moe_kernels.route_select + experts, today's default), `inline` = every gate/up program
choosing for itself (moe_kernels.routed_experts), and prints inline/separate. Inline removes a
launch but repeats the selection (TOP_K argmaxes over E scores) in each of M x TOP_K x N-tiles
programs, so its cost grows with the expert count: Kimi-K3 at TP 8 (shard 384) is where it
could lose. Each call gets other logits, so other experts, and the weights do not stay in L2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gemv import graph_seconds  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.model import moe_kernels  # noqa: E402
from service.model.layers import act_params  # noqa: E402

# (label, preset, tensor-parallel ranks the expert width is split over)
CASES = [("small", "small", 1), ("k3_tp8", "k3", 8), ("k3_tp1", "k3", 1)]
VARIANTS = 16


def _separate(ws, bias, route, act, logits):
    weights, ids = torch.ops.latentserve.moe_route_select(logits, bias, *route)
    return torch.ops.latentserve.moe_experts(*ws, weights, ids, *act)


def _inline(ws, bias, route, act, logits):
    return torch.ops.latentserve.moe_routed_experts(*ws, logits, bias, *route, *act)


def case(label: str, preset: str, tp: int, tokens: list[int]) -> list[dict]:
    cfg = PRESETS[preset]
    e, width, shard = cfg.n_routed_experts, cfg.moe_latent_size or cfg.hidden_size, cfg.moe_intermediate_size // tp
    w13 = torch.empty(e, 2 * shard, width, device="cuda", dtype=torch.bfloat16).normal_(0, width ** -0.5)
    w2 = torch.empty(e, width, shard, device="cuda", dtype=torch.bfloat16).normal_(0, shard ** -0.5)
    bias = torch.zeros(e, device="cuda")
    act, beta, linear_beta = act_params(cfg)
    route = (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob, float(cfg.routed_scaling_factor),
             cfg.scoring_func == "softmax")
    rows = []
    for m in tokens:
        x = torch.randn(m, width, device="cuda").to(torch.bfloat16)
        logits = [torch.randn(m, e, device="cuda") for _ in range(VARIANTS)]
        ws = (x, w13, w2)
        separate = functools.partial(_separate, ws, bias, route, (act, beta, linear_beta))
        inline = functools.partial(_inline, ws, bias, route, (act, beta, linear_beta))
        same = torch.equal(separate(logits[0]), inline(logits[0]))
        t_sep, t_in = graph_seconds(separate, logits), graph_seconds(inline, logits)
        row = {"case": label, "experts": e, "top_k": cfg.num_experts_per_tok, "width": width, "shard": shard,
               "tokens": m, "separate_us": round(t_sep * 1e6, 2), "inline_us": round(t_in * 1e6, 2),
               "inline_over_separate": round(t_in / t_sep, 3), "bit_equal": same}
        print(f"moe-route {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--cases", nargs="+", default=[c[0] for c in CASES])
    ap.add_argument("--json")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and moe_kernels.enabled()):
        sys.exit("moe_route.py needs a CUDA GPU and Triton")
    rows = []
    for label, preset, tp in CASES:
        if label in args.cases:
            print(f"moe-route case {label}: {preset} at TP {tp}", flush=True)
            rows += case(label, preset, tp, args.tokens)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
