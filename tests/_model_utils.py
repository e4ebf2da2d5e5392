"""Helpers for the model tests: build a model, greedy loops (cache-less and paged), TP spawn."""

from __future__ import annotations

import os
import random
import traceback

import torch
import torch.multiprocessing as mp

from service.config import ModelConfig
from service.engine.plan import SeqChunk
from service.model.attn_metadata import AttnMetadata
from service.model.model import CausalLM
from service.parallel import TPGroup
from service.weights import init_dummy_weights, materialize_plain

# Greedy runs may part ways only where the reference's top-2 logits are this close: float
# rounding can flip a near-tie, a bug gives a large margin.
NEAR_TIE = 1e-4


def build_model(cfg: ModelConfig, tp: TPGroup | None = None, dtype=torch.float32, seed: int | None = 0,
                tail_factory=None, device: str = "cpu") -> CausalLM:
    tp = tp or TPGroup.single()
    with torch.device("meta"):
        model = CausalLM(cfg, tp, tail_factory=tail_factory, dtype=dtype)
    materialize_plain(model, device)
    if seed is not None:
        init_dummy_weights(model, cfg, tp, seed=seed)
    return model.eval()


@torch.inference_mode()
def full_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """Cache-less forward of one sequence: fp32 logits [len, vocab]."""
    device = model.model.norm.weight.device
    meta = AttnMetadata.build([SeqChunk(0, list(tokens), 0, [])], 16, device)
    return model.compute_logits(model(torch.tensor(tokens, device=device), meta, None))


def params(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def join_shards(name: str, parts: list[torch.Tensor], full_shape: torch.Size) -> torch.Tensor:
    """The full tensor from TP shards: concatenated along the one dim where they are smaller;
    replicas must agree. Expert w13 and the MLPs' gate_up_proj stack each rank's gate and up
    shards, so those two are joined separately."""
    if name.endswith("gate_up_proj.weight"):
        halves = [p.unflatten(0, (2, -1)) for p in parts]
        return join_shards("", halves, (2, full_shape[0] // 2, full_shape[1])).flatten(0, 1)
    if name.endswith("experts.w13"):
        halves = [p.unflatten(1, (2, -1)) for p in parts]
        return join_shards("", halves, halves[0].shape[:2] + (full_shape[1] // 2, full_shape[2])).flatten(1, 2)
    dims = [d for d in range(len(full_shape)) if parts[0].shape[d] != full_shape[d]]
    if not dims:
        for p in parts[1:]:
            assert torch.equal(p, parts[0]), f"replicated tensor {name} differs across ranks"
        return parts[0]
    assert len(dims) == 1
    return torch.cat(parts, dim=dims[0])


def margin(row: torch.Tensor) -> float:
    top = row.float().topk(2).values
    return float(top[0] - top[1])


def greedy_full(logits_fn, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Full recompute every step (no cache). Returns new tokens and the top-2 margin of each."""
    seq, margins = list(prompt), []
    for _ in range(steps):
        row = logits_fn(seq)[-1]
        margins.append(margin(row))
        seq.append(int(row.argmax()))
    return seq[len(prompt):], margins


def assert_same_greedy(ref: list[list[int]], ref_margins: list[list[float]], ours: list[list[int]]) -> int:
    """Token-for-token equality, except after a divergence at a reference near-tie.
    Returns how many sequences matched in full."""
    full = 0
    for i, (r, m, o) in enumerate(zip(ref, ref_margins, ours)):
        assert len(o) == len(r), f"prompt {i}: {len(o)} tokens vs {len(r)}"
        diff = next((j for j in range(len(r)) if r[j] != o[j]), None)
        if diff is None:
            full += 1
            continue
        assert m[diff] < NEAR_TIE, (f"prompt {i} diverges at token {diff} (margin {m[diff]:.2e}):\n"
                                    f"  reference {r}\n  ours      {o}")
    return full


class PagedRunner:
    """A minimal engine: paged KV caches (and KDA state rows, NaN-filled like the KV, so a row a
    fresh sequence reads before writing shows up), scattered block ids, chunked prefill, and
    batches that mix prefill chunks with decodes of sequences admitted earlier. Sequence i owns
    state row i + 1, so row 0 is never one's."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 state_rows: int = 32):
        cfg = model.config
        self.model, self.block_size = model, block_size
        self.device = model.model.norm.weight.device

        def nan(*shape, dtype=None):
            return torch.full(shape, float("nan"), dtype=dtype or model.dtype, device=self.device)

        self.caches = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_kda_layer(i):
                from service.model.kda import KDAState, kda_state_shapes

                rows = {k: nan(state_rows, *shape, dtype=dt) for k, (shape, dt) in
                        kda_state_shapes(cfg, model.tp.world_size).items()}
                self.caches.append(KDAState(**rows))
            else:
                self.caches.append(nan(num_blocks, block_size, cfg.kv_cache_dim))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # block tables are not the identity

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        meta = AttnMetadata.build(chunks, self.block_size, self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)
        hidden = self.model(ids, meta, self.caches)
        return self.model.compute_logits(hidden[meta.logits_indices])

    def greedy(self, prompts: list[list[int]], steps: int, prefill_chunk: int = 5) -> list[list[int]]:
        n = len(prompts)
        seqs = [list(p) for p in prompts]
        computed = [0] * n  # tokens whose KV is in the cache
        tables: list[list[int]] = [[] for _ in range(n)]
        out: list[list[int]] = [[] for _ in range(n)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(n)]  # per sequence, per new token
        tick = 0
        while any(len(o) < steps for o in out):
            chunks, owners = [], []
            for i in range(min(n, tick + 1)):  # sequence i joins at step i
                if len(out[i]) >= steps:
                    continue
                todo = len(seqs[i]) - computed[i]
                take = min(todo, prefill_chunk)
                end = computed[i] + take
                while len(tables[i]) * self.block_size < end:
                    tables[i].append(self.free.pop())
                last = end == len(seqs[i])
                chunks.append(SeqChunk(i, seqs[i][computed[i]:end], computed[i], list(tables[i]), needs_logits=last,
                                       state_slot=i + 1))
                if last:
                    owners.append(i)
                computed[i] = end
            tick += 1
            if not chunks:
                continue
            logits = self.step(chunks)
            for i, row in zip(owners, logits):
                tok = int(row.argmax())
                self.logits[i].append(row)
                out[i].append(tok)
                seqs[i].append(tok)
        return out


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- tensor parallel runs in spawned processes --------------------------------------------------

def _tp_entry(rank: int, world: int, init_file: str, fn, args) -> None:
    torch.set_num_threads(1)
    tp = TPGroup.init(rank, world, f"file://{init_file}")
    try:
        fn(tp, *args)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        tp.destroy()


def run_tp(world: int, tmp_dir: str, fn, *args) -> None:
    """Run fn(tp, *args) on `world` ranks (gloo over a FileStore); fn must be importable."""
    init_file = os.path.join(tmp_dir, "tp_init")
    mp.spawn(_tp_entry, args=(world, init_file, fn, args), nprocs=world, join=True)
