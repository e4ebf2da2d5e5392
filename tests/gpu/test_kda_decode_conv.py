"""The all-decode step's short convs as one Triton kernel (kda_ops.decode_conv) against the torch
ops of KimiDeltaAttention._decode: the post-conv q, k, v and the history rows it advances in
place, with fresh sequences on rows that hold NaN, rows out of order, a channel count that is not
a power of two. Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kda_reference import conv_step
from kernel_env import DEVICE, kernel_marks, require_kernel_device

require_kernel_device()

from service.model import kda_ops  # noqa: E402, F401 - registers latentserve::kda_decode_conv

pytestmark = kernel_marks(120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p,width", [(96, 4), (256, 4), (40, 3)])
def test_decode_conv_matches_the_torch_ops(dtype, p, width):
    g = torch.Generator().manual_seed(p + width)
    slots, b = 8, 5
    conv = torch.randn(slots, 3 * p, width - 1, generator=g).to(dtype).float()  # model-dtype values in fp32
    conv[[2, 6]] = float("nan")  # unwritten rows: the fresh sequences' below
    rows = torch.tensor([6, 1, 3, 2, 7])
    positions = torch.tensor([0, 5, 1, 0, 40])
    mixed = torch.randn(b, 3 * p, generator=g).to(dtype)
    ws = [(0.6 * torch.randn(p, 1, width, generator=g)).to(dtype) for _ in range(3)]
    ref_qkv, ref_hist = conv_step(mixed, conv, rows, positions, ws)

    conv_dev = conv.to(DEVICE)
    q, k, v = torch.ops.latentserve.kda_decode_conv(mixed.to(DEVICE), conv_dev, rows.to(DEVICE),
                                                   positions.to(DEVICE), *(w.to(DEVICE) for w in ws))
    got = torch.cat([q, k, v], dim=-1).cpu()
    assert got.dtype == dtype and all(t.is_contiguous() and t.shape == (b, p) for t in (q, k, v))
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7  # the four taps' fp32 sum order and silu's form
    torch.testing.assert_close(got.float(), ref_qkv.float(), atol=tol, rtol=tol)
    after = conv_dev.cpu()
    torch.testing.assert_close(after[rows], ref_hist, atol=0, rtol=0)  # moved, not computed: exact
    untouched = [0, 4, 5]
    torch.testing.assert_close(after[untouched], conv[untouched], atol=0, rtol=0, equal_nan=True)
