"""MLA prefill of whole prompts as batches: prompts that start at position 0 in a step attend
through one kv_b GEMM over the step's latents and one SDPA per prompt length
(`MLAAttention._whole_prompts`), instead of a gather, a GEMM and an SDPA per prompt. A mixed step
(decodes, prompts of equal lengths back to back and apart, a prompt's later chunk) must give
what the per-prompt path gives, token for token."""

from __future__ import annotations

import pytest
import torch

from service.config import resolve_model
from service.engine.plan import SeqChunk
from service.model import attention
from service.model.attention import MLAAttention, kv_cache_shape
from service.model.attn_metadata import AttnMetadata
from service.model.layers import RotaryEmbedding
from service.parallel import TPGroup

BLOCK = 4


def chunks() -> list[SeqChunk]:
    out, next_block = [], 0

    def chunk(seq_id: int, n: int, start: int) -> SeqChunk:
        nonlocal next_block
        blocks = -(-(start + n) // BLOCK)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        return SeqChunk(seq_id=seq_id, token_ids=list(range(3, 3 + n)), start_pos=start, block_table=table)

    # decode, prompt 5, prompt 3, prompt 5 (apart from the first), later chunk of 4 at 6,
    # prompts 2 and 2 back to back, decode
    for i, (n, start) in enumerate([(1, 7), (5, 0), (3, 0), (5, 0), (4, 6), (2, 0), (2, 0), (1, 3)]):
        out.append(chunk(i, n, start))
    return out


@pytest.mark.parametrize("scores", [attention.CPU_SCORES, 1])  # whole groups; one prompt per SDPA
@pytest.mark.parametrize("preset", ["tiny", "k3-tiny"])
def test_whole_prompts_in_batches_equal_the_per_prompt_path(preset, scores, monkeypatch):
    monkeypatch.setattr(attention, "CPU_SCORES", scores)
    cfg, _ = resolve_model(preset)
    torch.manual_seed(0)
    attn = MLAAttention(cfg, TPGroup.single(), 0, torch.float32)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    plan = chunks()
    meta = AttnMetadata.build(plan, BLOCK, "cpu")
    groups, others, span = meta.prefill_groups()
    assert sorted(len(g[1]) for g in groups) == [1, 2, 2] and others == [4]
    assert [g[2] is None for g in groups] == [False, True, True]  # the 5s lie apart: gathered
    x = torch.randn(meta.num_tokens, cfg.hidden_size)
    cos, sin = RotaryEmbedding(cfg).lookup(meta.positions) if not cfg.mla_use_nope else (None, None)
    cache = torch.randn(kv_cache_shape(cfg, 64, BLOCK))  # the later chunk's and decodes' earlier context
    ref_cache = cache.clone()
    with torch.no_grad():
        ours = attn(x, cos, sin, meta, cache)
        monkeypatch.setattr(AttnMetadata, "prefill_groups", lambda self: ([], self.prefill_chunks, None))
        ref = attn(x, cos, sin, AttnMetadata.build(plan, BLOCK, "cpu"), ref_cache)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
