"""The CUDA C MLA split kernel's split count (mla_cuda.splits): pure host arithmetic, so it is
checked here on CPU; the kernel itself at these counts is tests/gpu/test_mla_cuda.py's."""

from __future__ import annotations

import pytest

from service.model import mla_cuda, mla_decode


@pytest.mark.parametrize("batch,heads,expected", [(1, 16, 32), (3, 16, 32), (8, 16, 32), (8, 32, 16), (8, 8, 32),
                                                  (16, 16, 16), (64, 16, 4), (256, 16, 1), (300, 16, 1)])
def test_about_256_programs_of_at_most_32_splits(monkeypatch, batch, heads, expected):
    monkeypatch.delenv("LATENTSERVE_MLA_CUDA_SPLITS", raising=False)
    got = mla_cuda.splits(batch, heads)
    assert got == expected
    assert got & (got - 1) == 0  # a power of 2: the merge kernels compile once per count


def test_twice_the_triton_kernels_programs_at_eight_sequences(monkeypatch):
    """Run 119 (H100): 32 splits at 8 sequences, 0.99x of the Triton kernel's 16 for the step."""
    monkeypatch.delenv("LATENTSERVE_MLA_CUDA_SPLITS", raising=False)
    assert mla_cuda.splits(8, 16) == 2 * mla_decode.num_splits(8, 16)
    assert mla_cuda.splits(1, 16) == mla_decode.num_splits(1, 16)


def test_switch_overrides_the_count(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_MLA_CUDA_SPLITS", "8")
    assert mla_cuda.splits(1, 16) == 8
