"""The Triton paged MLA decode kernel against a float64 reference of the absorbed attention.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernel interpreted).
"""

from __future__ import annotations

import random

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device

require_kernel_device()

from service.model import mla_decode  # noqa: E402

# Interpreted runs are CPU runs: the gpu marker would make conftest skip them.
pytestmark = kernel_marks(300)


def reference(q, kv, tables, ctx, lora, scale):
    """float64, one sequence at a time, over exactly the context slots."""
    out = []
    bs = kv.shape[1]
    for i in range(q.shape[0]):
        n = int(ctx[i])
        slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(n)]
        c = kv.view(-1, kv.shape[-1])[slots].double()
        s = (q[i].double() @ c.T) * scale  # [H, n]
        out.append(s.softmax(-1) @ c[:, :lora])
    return torch.stack(out)


def case(seed, batch, heads, lora, rope, block_size, dtype, max_ctx):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ctx = [rng.randint(1, max_ctx) for _ in range(batch)]
    ctx[0] = 1  # a one-token context: every split but the first is empty
    width = -(-max(ctx) // block_size) + 1
    num_blocks = batch * width + 3
    kv = torch.full((num_blocks, block_size, lora + rope), float("nan"))  # unused slots poisoned
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(ctx):
        for j in range(-(-n // block_size)):
            blk = free.pop()
            tables[i, j] = blk
            kv[blk] = torch.randn(block_size, lora + rope, generator=g)
        last = -(-n // block_size) - 1
        if n % block_size:  # slots past the context in the last block keep their poison
            kv[tables[i, last], n % block_size:] = float("nan")
    q = torch.randn(batch, heads, lora + rope, generator=g)
    return (q.to(DEVICE, dtype), kv.to(DEVICE, dtype), tables.to(DEVICE), torch.tensor(ctx).to(DEVICE), ctx)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch,heads,splits", [(3, 8, None), (5, 20, 4), (2, 16, 1)])
def test_mla_decode_matches_reference(dtype, tol, batch, heads, splits):
    if INTERPRET and dtype != torch.float32:
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot wrongly (1e10 off on 16x16)")
    lora, rope, block_size = 64, 16, 4
    q, kv, tables, ctx, ctx_list = case(batch * 7 + heads, batch, heads, lora, rope, block_size, dtype, 70)
    assert mla_decode.supported(q, kv, lora)
    scale = (lora + rope) ** -0.5
    out = mla_decode.mla_decode(q, kv, tables, ctx, lora, scale, splits=splits)
    ref = reference(q.cpu(), kv.cpu(), tables.cpu(), ctx_list, lora, scale)
    assert out.shape == (batch, heads, lora) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN from poisoned slots past a context leaked in"
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def test_split_count_depends_on_batch_only():
    # A CUDA graph captured at a batch size must stay valid for every context length.
    # bench/mla_decode.py --sweep on the H200: 32 splits best for one sequence (one program), 16
    # for 8, 4 at 64, one (no merge) from 256 programs on.
    assert mla_decode.num_splits(1, 16) == 32
    assert mla_decode.num_splits(8, 16) == 16
    assert mla_decode.num_splits(64, 16) == 4
    assert mla_decode.num_splits(256, 16) == 1
    assert mla_decode.num_splits(512, 128) == 1
    assert mla_decode.launch_config(1, 16) != mla_decode.launch_config(64, 16)
    # Any batch takes a power-of-2 count (each count is a compile of its own): a mixed step's
    # 5, 13 or 40 decodes reuse what the decode graphs' batches compiled.
    counts = {mla_decode.num_splits(b, 16) for b in range(1, 300)}
    assert counts == {32, 16, 8, 4, 1}, counts
