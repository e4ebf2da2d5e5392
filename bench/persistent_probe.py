"""Probe for batch 1: a chain of one-row GEMVs as one persistent kernel against one PDL launch each.

    python bench/persistent_probe.py [--layers 2 4 8] [--width 2048] [--json out.json]

y_{l+1} = W_l @ y_l for l < L, W_l [width, width] bf16. That is the dependent chain of a batch-1
decode layer, where every op's weights are known before its input is
(bench/notes/batch1-launch-floor.md). Two ways, each replayed in a CUDA graph, with weights
cycled past L2:

- `launches`: one `gemv` launch per W_l (service/model/gemv.py, whole-K rows, PDL on sm_90):
  what a decode step does today.
- `persistent`: one launch of one program per SM. Program p owns rows p*R..(p+1)*R of every
  layer. It loads its rows of W_{l+1} into registers, then spins on layer l's arrival counter
  (acquire) until every program has stored its rows of y_l (release), then multiplies. So the
  weight stream of the next op overlaps the wait for the previous one. Counters reset themselves:
  the last program through a layer's wait zeroes it, so the graph replays.

Prints us per layer for each, their ratio, and the achieved bandwidth against the copy
bandwidth measured in the same run. Both results are checked against torch. If `persistent` is
not clearly faster at 4-8 layers, a per-layer megakernel will not reach issue 12's batch-1 goal
in Triton either.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gemv import graph_seconds  # noqa: E402
from gpu import copy_bandwidth  # noqa: E402

from service.model import gemv  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

L2_SAFE = 256 << 20

if triton is not None:

    @triton.jit
    def _wait(cnt_ptr, target):
        """Spin until the counter reaches target; acquire, so the stores released before the
        increments are visible to this program's loads after it."""
        while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
            pass

    @triton.jit
    def _chain_kernel(x_ptr, w_ptr, y_ptr, cnt_ptr, L: tl.constexpr, WIDTH: tl.constexpr, ROWS: tl.constexpr,
                      PROGRAMS: tl.constexpr):
        """y_ptr [L, WIDTH]: layer l's output; cnt_ptr [2 * L] int32 (arrivals, passes) at 0."""
        p = tl.program_id(0)
        n = p * ROWS + tl.arange(0, ROWS)
        nmask = n < WIDTH
        k = tl.arange(0, WIDTH)
        w = tl.load(w_ptr + n[:, None] * WIDTH + k[None, :], mask=nmask[:, None], other=0.0)
        xv = tl.load(x_ptr + k).to(tl.float32)
        for layer in tl.static_range(L):
            y = tl.sum(w.to(tl.float32) * xv[None, :], 1)
            tl.store(y_ptr + layer * WIDTH + n, y.to(y_ptr.dtype.element_ty), mask=nmask)
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + 2 * layer, 1, sem="release", scope="gpu")
            if layer + 1 < L:  # the next layer's rows first, the wait behind them
                w = tl.load(w_ptr + (layer + 1) * WIDTH * WIDTH + n[:, None] * WIDTH + k[None, :],
                            mask=nmask[:, None], other=0.0)
                _wait(cnt_ptr + 2 * layer, PROGRAMS)
                xv = tl.load(y_ptr + layer * WIDTH + k, cache_modifier=".cg").to(tl.float32)
                if tl.atomic_add(cnt_ptr + 2 * layer + 1, 1, sem="acq_rel", scope="gpu") == PROGRAMS - 1:
                    tl.atomic_xchg(cnt_ptr + 2 * layer, 0, sem="relaxed", scope="gpu")
                    tl.atomic_xchg(cnt_ptr + 2 * layer + 1, 0, sem="relaxed", scope="gpu")
            else:  # the last layer: its counters are back at 0 once every program has arrived
                if tl.atomic_add(cnt_ptr + 2 * layer + 1, 1, sem="acq_rel", scope="gpu") == PROGRAMS - 1:
                    _wait(cnt_ptr + 2 * layer, PROGRAMS)
                    tl.atomic_xchg(cnt_ptr + 2 * layer, 0, sem="relaxed", scope="gpu")
                    tl.atomic_xchg(cnt_ptr + 2 * layer + 1, 0, sem="relaxed", scope="gpu")


def persistent(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cnt: torch.Tensor, programs: int) -> torch.Tensor:
    layers, width = w.shape[0], w.shape[1]
    rows = triton.next_power_of_2(triton.cdiv(width, programs))
    _chain_kernel[(triton.cdiv(width, rows),)](x, w, y, cnt, L=layers, WIDTH=width, ROWS=rows,
                                               PROGRAMS=triton.cdiv(width, rows), num_warps=8)
    return y[-1]


def launches(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for layer in range(w.shape[0]):
        x = torch.ops.latentserve.gemv(x, w[layer])
    return x


def measure(layers: int, width: int, bw: float) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copies = max(2, -(-L2_SAFE // (layers * width * width * 2)))
    ws = [torch.randn(layers, width, width, device="cuda").div_(width ** 0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(1, width, device="cuda").bfloat16()
    y = torch.empty(layers, width, device="cuda", dtype=torch.bfloat16)
    cnt = torch.zeros(2 * layers, dtype=torch.int32, device="cuda")
    ref = x.float()
    for layer in range(layers):
        ref = (ref @ ws[0][layer].float().t()).bfloat16().float()
    got_l = launches(x, ws[0]).float()
    got_p = persistent(x[0], ws[0], y, cnt, sms).float()
    tol = 0.05 * ref.abs().max().item()
    t_l = graph_seconds(lambda w: launches(x, w), ws)  # noqa: B023 - called at once
    t_p = graph_seconds(lambda w: persistent(x[0], w, y, cnt, sms), ws)  # noqa: B023
    nbytes = layers * width * width * 2
    row = {"layers": layers, "width": width, "launches_us_per_layer": round(t_l / layers * 1e6, 2),
           "persistent_us_per_layer": round(t_p / layers * 1e6, 2), "persistent_over_launches": round(t_p / t_l, 3),
           "launches_of_copy_bw": round(nbytes / t_l / bw, 3), "persistent_of_copy_bw": round(nbytes / t_p / bw, 3),
           "launches_ok": bool((got_l[0] - ref[0]).abs().max().item() <= tol),
           "persistent_ok": bool((got_p - ref[0]).abs().max().item() <= tol),
           "counters_reset": bool(cnt.eq(0).all().item())}
    print(f"persistent-probe {json.dumps(row)}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and triton is not None and gemv.supported(
            torch.empty(1, args.width, device="cuda", dtype=torch.bfloat16),
            torch.empty(args.width, args.width, device="cuda", dtype=torch.bfloat16))):
        sys.exit("persistent_probe.py needs a CUDA GPU with Triton")
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = [measure(n, args.width, bw) for n in args.layers]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
