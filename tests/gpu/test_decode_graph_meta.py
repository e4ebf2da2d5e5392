"""The decode graphs' inputs without the graphs: k3-tiny's forward over DecodeGraphs' packed buffer
and metadata (`pack_decode`, `_meta`: state rows from the buffer, padding rows on the scratch
KV block and KDA state row) for 3 sequences in the batch of 4, one of them fresh (position 0 on a
dirty state row), equals the eager step: same logits, same writes to every row and block a
sequence owns, and the padding row wrote only the scratch.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (the MLA decode and MoE
kernels interpreted; the KDA torch path).
"""

from __future__ import annotations

import numpy as np
import torch
from kernel_env import DEVICE, GRAPH_SHAPES, kernel_marks, require_kernel_device

require_kernel_device()

from _model_utils import build_model  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.engine.plan import SeqChunk  # noqa: E402
from service.model import cuda_graph, decode_inputs  # noqa: E402
from service.model.attn_metadata import AttnMetadata  # noqa: E402
from service.model.kda import KDAState, kda_state_shapes  # noqa: E402

pytestmark = kernel_marks(600)
# MLA widths the Triton decode kernel takes.
OVERRIDES = GRAPH_SHAPES
BS, BLOCKS, SEQS, BATCH, WIDTH = 16, 12, 3, 4, 8
SCRATCH = (BLOCKS, SEQS)  # one past what the "engine" hands out, as the worker allocates


def caches(cfg) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_kda_layer(i):
            out.append(KDAState(**{k: (torch.randn((SEQS + 1, *s), generator=g) * 0.3).to(DEVICE, dt or torch.float32)
                                   for k, (s, dt) in kda_state_shapes(cfg, 1).items()}))
        else:
            out.append(torch.randn(BLOCKS + 1, BS, cfg.kv_cache_dim, generator=g).to(DEVICE))
    return out


def clone(cs: list) -> list:
    return [KDAState(c.conv.clone(), c.recurrent.clone()) if isinstance(c, KDAState) else c.clone() for c in cs]


def graph_inputs(model, kv_caches) -> cuda_graph.DecodeGraphs:
    """A DecodeGraphs holding the input buffer and its views, without capturing (no CUDA graph)."""
    g = object.__new__(cuda_graph.DecodeGraphs)
    g.model, g.kv_caches, g.block_size, g.width, g.max_batch, g.scratch = model, kv_caches, BS, WIDTH, BATCH, SCRATCH
    g.compiled = None
    g.inputs = torch.zeros(cuda_graph.buffer_len(BATCH, WIDTH), dtype=torch.long, device=DEVICE)
    fields = g.inputs[: cuda_graph.FIELDS * BATCH].view(cuda_graph.FIELDS, BATCH)
    g.ids, g.positions, g.slots, g.context = (fields[f] for f in (cuda_graph.IDS, cuda_graph.POSITIONS,
                                                                   cuda_graph.SLOTS, cuda_graph.CONTEXT))
    g.state_slots = fields[cuda_graph.STATE]
    g.tables = g.inputs[cuda_graph.FIELDS * BATCH:].view(BATCH, WIDTH)
    g.rows = torch.arange(BATCH + 1, device=DEVICE)
    return g


def test_packed_inputs_and_scratch_padding_match_the_eager_step():
    cfg = PRESETS["k3-tiny"].with_overrides(OVERRIDES)
    model = build_model(cfg, device=DEVICE)
    base = caches(cfg)
    chunks = [SeqChunk(0, [11], 20, [0, 1], state_slot=2), SeqChunk(1, [12], 0, [2], state_slot=0),
              SeqChunk(2, [13], 40, [3, 4, 5], state_slot=1)]
    ref_caches, ours = clone(base), clone(base)
    with torch.inference_mode():
        meta = AttnMetadata.build(chunks, BS, DEVICE)
        ids = torch.tensor([c.token_ids[0] for c in chunks], device=DEVICE)
        ref = model.compute_logits(model(ids, meta, ref_caches)[meta.logits_indices])
        g = graph_inputs(model, ours)
        buf = np.zeros(cuda_graph.buffer_len(BATCH, WIDTH), dtype=np.int64)
        decode_inputs.pack_decode(chunks, BATCH, BATCH, WIDTH, BS, buf, SCRATCH)
        g.inputs.copy_(torch.from_numpy(buf))
        out = g._forward(BATCH, g._meta(BATCH))
    assert out.shape[0] == BATCH and torch.isfinite(out).all()
    torch.testing.assert_close(out[:SEQS], ref, rtol=1e-4, atol=1e-4)
    for i, (a, b, c) in enumerate(zip(ours, ref_caches, base)):
        if isinstance(a, KDAState):
            for part in ("conv", "recurrent"):
                x, y, z = getattr(a, part), getattr(b, part), getattr(c, part)
                torch.testing.assert_close(x[:SEQS], y[:SEQS], rtol=1e-4, atol=1e-4, msg=f"layer {i} {part} rows")
                assert not torch.equal(x[SEQS], z[SEQS]), f"layer {i}: the padding row did not use the scratch {part}"
        else:
            torch.testing.assert_close(a[:BLOCKS], b[:BLOCKS], rtol=1e-4, atol=1e-4, msg=f"layer {i} KV blocks")
            assert not torch.equal(a[BLOCKS], c[BLOCKS]), f"layer {i}: the padding row did not write the scratch block"
