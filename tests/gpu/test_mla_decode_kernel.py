"""The Triton paged MLA decode kernel against a float64 reference of the absorbed attention.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernel interpreted).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from kernel_env import DEVICE, kernel_marks, rel_error, require_kernel_device, skip_interpreted_16bit_dot

require_kernel_device()

from service.model import mla_decode, mla_decode_tma  # noqa: E402

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
    skip_interpreted_16bit_dot(dtype)
    lora, rope, block_size = 64, 16, 4
    q, kv, tables, ctx, ctx_list = case(batch * 7 + heads, batch, heads, lora, rope, block_size, dtype, 70)
    assert mla_decode.supported(q, kv, lora)
    scale = (lora + rope) ** -0.5
    out = mla_decode.mla_decode(q, kv, tables, ctx, lora, scale, splits=splits)
    ref = reference(q.cpu(), kv.cpu(), tables.cpu(), ctx_list, lora, scale)
    assert out.shape == (batch, heads, lora) and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN from poisoned slots past a context leaked in"
    err = rel_error(out, ref)
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


# (writes the new token, heads): 20 heads are two head blocks, of which only the first writes the row.
WRITES = [(False, 16), (True, 16), (True, 20)]


@pytest.mark.parametrize("write,heads", WRITES, ids=["read", "write", "write_20h"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_launch_variants_match_reference(dtype, tol, write, heads, monkeypatch):
    """The prefetching launches (next tile's block-table entries loaded a step ahead: the
    default's 32-token tiles at 3 stages and 16-token tiles at 4) and the few-program one,
    reading the cache and writing each sequence's new token itself (attended after the tile
    loop), over contexts that end mid-tile, with one split,
    four and sixteen (empty splits included)."""
    skip_interpreted_16bit_dot(dtype)
    lora, rope, block_size, batch = 64, 16, 16, 5
    q, kv, tables, ctx, ctx_list = case(11, batch, heads, lora, rope, block_size, dtype, 90)
    new, expected_kv = new_tokens(kv, tables, ctx_list, dtype, seed=3) if write else ({}, kv.clone())
    # Then LATENTSERVE_MLA_SMALL_WARPS's 16-warp candidate at the few-program tile sizes, and
    # LATENTSERVE_MLA_SMALL_PIPELINE's launches (3 stages, block tables a step ahead).
    monkeypatch.delenv("LATENTSERVE_MLA_SMALL_PIPELINE", raising=False)
    cfgs = [mla_decode.launch_config(64, heads), {"BLOCK_N": 16, "num_warps": 4, "num_stages": 4, "PREFETCH_BT": True},
            {**mla_decode.launch_config(1, heads), "BLOCK_N": 16},
            {**mla_decode.launch_config(1, heads), "num_warps": 16}, {**mla_decode.launch_config(8, heads), "num_warps": 16}]
    monkeypatch.setenv("LATENTSERVE_MLA_SMALL_PIPELINE", "1")
    cfgs += [mla_decode.launch_config(1, heads), mla_decode.launch_config(8, heads)]
    check_launches(q, kv, tables, ctx, ctx_list, lora, tol, cfgs, new, expected_kv)


def new_tokens(kv, tables, ctx_list, dtype, seed):
    """The last position of each context as the step's new token: (the kernel's new_kv / new_slots
    arguments, the cache as it must be after the call)."""
    block_size, width = kv.shape[1], kv.shape[2]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(ctx_list), width, generator=g).to(DEVICE, dtype)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(ctx_list)]).to(DEVICE)
    expected_kv = kv.clone()
    expected_kv.view(-1, width)[slots] = rows
    return {"new_kv": rows, "new_slots": slots}, expected_kv


def check_launches(q, kv, tables, ctx, ctx_list, lora, tol, cfgs, new, expected_kv, label=""):
    """Each launch shape in cfgs at 1, 4 and 16 splits against the float64 reference over
    expected_kv, and the cache it leaves equal to expected_kv."""
    scale = kv.shape[-1] ** -0.5
    ref = reference(q.cpu(), expected_kv.cpu(), tables.cpu(), ctx_list, lora, scale)
    for cfg, splits in itertools.product(cfgs, (1, 4, 16)):
        cache = kv.clone()
        out = mla_decode._mla_decode(q, cache, tables, ctx, lora, scale, splits=splits, cfg=cfg, **new)
        assert torch.isfinite(out).all(), "NaN from poisoned slots past a context leaked in"
        err = rel_error(out, ref)
        assert err < tol, f"{label}{cfg}, {splits} splits: relative error {err:.2e}"
        assert torch.equal(cache.nan_to_num(), expected_kv.nan_to_num()), "the cache holds other rows than expected"


def test_prefetch_launch_is_the_default_from_17_programs(monkeypatch):
    monkeypatch.delenv("LATENTSERVE_MLA_SMALL_PIPELINE", raising=False)  # the default, whatever the shell set
    assert mla_decode.launch_config(64, 16)["PREFETCH_BT"] is True
    assert "PREFETCH_BT" not in mla_decode.launch_config(8, 16)  # few programs: the split table's shapes
    monkeypatch.setenv("LATENTSERVE_MLA_PREFETCH", "0")  # bench/gpu.py's mla_no_prefetch baseline
    assert "PREFETCH_BT" not in mla_decode.launch_config(64, 16)


def test_small_warps_switch_reaches_only_the_few_program_launches(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_MLA_SMALL_WARPS", "16")  # bench/gpu.py's mla_16_warps candidate
    assert mla_decode.launch_config(1, 16)["num_warps"] == mla_decode.launch_config(8, 16)["num_warps"] == 16
    assert mla_decode.launch_config(64, 16)["num_warps"] == 4


def test_small_pipeline_switch_reaches_only_the_few_program_launches(monkeypatch):
    default = mla_decode.launch_config(64, 16)
    monkeypatch.setenv("LATENTSERVE_MLA_SMALL_PIPELINE", "1")  # bench/gpu.py's mla_small_pipeline candidate
    one, eight = mla_decode.launch_config(1, 16), mla_decode.launch_config(8, 16)
    assert (one["BLOCK_N"], eight["BLOCK_N"]) == (16, 32)
    assert one["num_stages"] == eight["num_stages"] == 3 and one["PREFETCH_BT"] and eight["PREFETCH_BT"]
    assert mla_decode.launch_config(64, 16) == default


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_tma_tiles_match_reference(dtype, tol, write):
    """LATENTSERVE_MLA_TMA's kernel (mla_decode_tma.py): tiles copied by TMA from inside one cache
    block of 32 or 64 slots, the positions after the last whole tile by masked loads, over contexts
    that end mid-tile and mid-block, poisoned slots past them, 1 to 16 splits and 20 heads (two
    head blocks); the same call with 16-slot blocks takes the plain kernel."""
    skip_interpreted_16bit_dot(dtype)
    lora, rope, heads, batch = 64, 16, 20, 5
    for block_size, block_n in ((32, 32), (64, 32), (64, 16)):
        q, kv, tables, ctx, ctx_list = case(block_size + block_n, batch, heads, lora, rope, block_size, dtype, 200)
        assert mla_decode_tma.supported(kv, lora, block_n)
        new, expected_kv = new_tokens(kv, tables, ctx_list, dtype, seed=5) if write else ({}, kv.clone())
        cfg = {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3, "TMA": True}
        check_launches(q, kv, tables, ctx, ctx_list, lora, tol, [cfg], new, expected_kv, f"blocks of {block_size}, ")
    assert not mla_decode_tma.supported(torch.zeros(4, 16, lora + rope, dtype=dtype, device=DEVICE), lora, 32)


def test_tma_switch_reaches_only_the_prefetching_launches(monkeypatch):
    assert not mla_decode.launch_config(64, 16)["TMA"]
    monkeypatch.setenv("LATENTSERVE_MLA_TMA", "1")  # bench/gpu.py's mla_tma candidate
    assert mla_decode.launch_config(64, 16)["TMA"] and mla_decode.launch_config(256, 16)["TMA"]
    assert "TMA" not in mla_decode.launch_config(8, 16)
    # The ids vector's length, a constexpr: at least 64 (few compiles as a mixed step's tables
    # widen), over MAX_TILES the cp.async kernel (8192 blocks of 32 slots in one split: 8192 tiles).
    assert mla_decode_tma.max_tiles(torch.zeros(3, 4), 32, 1, 32) == 64
    assert mla_decode_tma.max_tiles(torch.zeros(3, 8192), 32, 1, 32) > mla_decode_tma.MAX_TILES
