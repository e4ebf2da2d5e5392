"""cuBLAS products kept opaque to Inductor, so a residual add never becomes `addmm`.

Above the GEMV's rows (gemv.max_rows) a decode step's dense projections run on cuBLAS. In a
compiled decoder layer Inductor folds `h + x @ W.T` into `addmm(h, x, W.T)`, and cuBLAS's addmm
first copies h into a fresh output, then multiplies with beta = 1. That is a device-to-device
copy a residual add: attention's output into the stream, and the latent MoE's up-projection onto
the shared experts' down-projection (run 78's profile at 256 rows: 2 copies of 1.6 us a MoE layer,
22 kernels a layer). Through these ops the first add joins the norm kernel that follows it, and
the second product accumulates onto the first in place: no copy.

On by default since run 83 (H100, `small`, 256 sequences): 22.0 -> 20.0 kernels a layer, the step
0.99x (7.994 -> 7.868 ms); 1.00x at 1-64, where the GEMV runs. Run 89 (another H100): the addmm
build 1.02x the default at 256. LATENTSERVE_OPAQUE_MM=0: the bench's `addmm` baseline.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Decode-sized products only: a prefill's products are long enough for a copy not to matter, and
# an eager prefill would pay the custom op's dispatch at every projection.
MAX_ROWS = 512


def enabled(x: torch.Tensor) -> bool:
    return (x.is_cuda and x.numel() <= MAX_ROWS * x.shape[-1]
            and os.environ.get("LATENTSERVE_OPAQUE_MM", "1") == "1")


@torch.library.custom_op("latentserve::mm_t", mutates_args=())
def mm_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T, as F.linear."""
    return F.linear(x, weight)


@mm_t.register_fake
def _(x, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("latentserve::mm_t_sum", mutates_args=())
def mm_t_sum(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor) -> torch.Tensor:
    """x @ weight^T + x2 @ weight2^T into rows of x's leading shape: the second product first,
    then the first added onto it by cuBLAS (beta = 1, the output its own input: no copy)."""
    out = F.linear(x2.reshape(-1, x2.shape[-1]), weight2)
    out.addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


@mm_t_sum.register_fake
def _(x, weight, x2, weight2):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
