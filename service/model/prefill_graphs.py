"""Piecewise CUDA graphs of the steps the decode graphs do not take: prefills and mixed steps.

An eager prefill step of `small` (8 x 1024 tokens, 24 layers) launches ~1100 kernels from
Python; on the H200 its wall time was the host's: 91 ms for 53 ms of device time, and 65-95 ms
for the same code in three runs (bench/RESULTS.md). Everything in a layer but attention proper
depends on the step's token count only, so it is captured once per token-count bucket: one
graph from each layer's attention output to the next layer's attention input (gate and o_proj,
both residual adds, the MoE or MLP, the next norm and q/kv projections), the first from the
embedding, the last ending in the final norm. Attention proper (`MLAAttention.attend`: the KV
write, the prompts' SDPA, the absorbed decodes; `KimiDeltaAttention.attend`: the short convs and
the recurrence, from and into the state rows), which depends on the chunks' lengths and
positions, runs eagerly between the replays on the step's real tokens. vLLM's piecewise graphs
cut the model at the same place. With Kimi-K3's attention residuals the pieces carry the running
block sum and its next term instead of the residual stream (`DecoderLayer.enter` / `leave`).

Rows past the step's tokens, up to the bucket, are padding: whatever token and position the
buffers last held (valid ones: zeros at first, then an earlier step's). Every captured op is
row-independent, attention never reads those rows and no cache write covers them.

As with the decode graphs, weights and the KV cache are read at their pool addresses, which
sleep keeps, and activations live in a private graph pool. The pieces hand attention its inputs
(`step_buffers`: MLA's q and latent, KDA's pre-conv q|k|v and raw gates) through static buffers
shared by every layer of a kind and every bucket, as is the bank of block sums, so a bucket's
graphs hold only one layer's activations at a time. TP 1 only; other plans, and any capture that
fails, run eagerly (logged). LATENTSERVE_PREFILL_GRAPHS=0 runs every step eagerly (read per
step: the bench's baseline).
"""

from __future__ import annotations

import os
import time

import torch

from ..log import get_logger
from . import moe_grouped
from .attn_metadata import AttnMetadata
from .moe import grouped_mm_fast

log = get_logger("prefill_graphs")

SMALL_SIZES = (64, 128, 256, 512)  # then multiples of STEP up to max_num_batched_tokens
STEP = 512


def default_sizes(max_tokens: int) -> list[int]:
    """Buckets for steps of up to max_tokens tokens: padding is at most 2x below 512 tokens and
    under 512 rows above."""
    sizes = [s for s in SMALL_SIZES if s < max_tokens]
    sizes += list(range(STEP, max_tokens + STEP - 1, STEP))
    return sorted(set(sizes))


def enabled() -> bool:
    return os.environ.get("LATENTSERVE_PREFILL_GRAPHS", "1") != "0"


def unsupported_reason(model) -> str | None:
    if not model.model.norm.weight.is_cuda:
        return "not on CUDA"
    if model.tp.world_size != 1:
        return "TP > 1: the pieces' collectives are not captured for prefill-sized steps yet"
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or experts.w13_scale_inv is not None:
            continue
        probe = experts.w13.new_empty(SMALL_SIZES[0], experts.w13.shape[-1])
        if not (moe_grouped.supported(probe, experts.w13, experts.w2, experts.act_name) or grouped_mm_fast(probe)):
            # e.g. fp32: the per-expert loop reads its plan on the host, which a capture cannot
            return f"no graph-safe grouped MoE for {probe.dtype} (Triton's or torch._grouped_mm's)"
    return None


class PrefillGraphs:
    """Captures at construction; `forward(ids, meta, caches)` returns the final hidden states
    [T, H] (a view of a buffer the next step overwrites), or None when the step has more tokens
    than the largest bucket or the switch is off."""

    def __init__(self, model, sizes: list[int]):
        self.model = model
        self.sizes = sorted(set(int(s) for s in sizes))
        n = self.sizes[-1]
        w = model.model.norm.weight
        self.ids = torch.zeros(n, dtype=torch.long, device=w.device)
        self.positions = torch.zeros(n, dtype=torch.long, device=w.device)
        self.hidden = torch.zeros(n, w.shape[0], dtype=w.dtype, device=w.device)
        # Attention's inputs and output, one set per kind of attention (MLA, KDA), shared by its
        # layers and every bucket; attention residuals' bank of block sums likewise.
        self.buffers: dict[type, tuple[tuple, torch.Tensor]] = {}
        for layer in model.layers:
            kind = type(layer.self_attn)
            if kind not in self.buffers:
                self.buffers[kind] = layer.self_attn.step_buffers(n, w.dtype, w.device)
        bank = model.model.new_bank(self.hidden)
        self.bank = bank.zero_() if bank is not None else None
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._ropes: dict[int, tuple] = {}  # each bucket's cos/sin, read by all its graphs
        self.replays = 0
        self._capture()

    def _views(self, layer, rows: int) -> tuple[tuple, torch.Tensor]:
        inputs, out = self.buffers[type(layer.self_attn)]
        return tuple(t[:rows] for t in inputs), out[:rows]

    def _piece(self, k: int, b: int, state: dict) -> dict:
        """Piece k of bucket b: layer k-1 after its attention (none for k = 0: the embedding),
        then layer k up to its attention (none for the last: the final norm)."""
        m, layers = self.model.model, self.model.layers
        bank = self.bank[:b] if self.bank is not None else None
        if k == 0:
            h, pending = m.embed_tokens(self.ids[:b]), None
            rope = m.rope(self.positions[:b])
        else:
            prev = layers[k - 1]
            _, out = self._views(prev, b)
            h, pending = prev.leave(state["h"], prev.self_attn.output(out, state["gate"]), bank)
            rope = state["rope"]
        if k == len(layers):
            self.hidden[:b].copy_(m.final(h, pending, bank))
            return {}
        layer = layers[k]
        h, x = layer.enter(h, pending, bank)
        _, gate = layer.project(x, rope, into=self._views(layer, b)[0])
        return {"h": h, "gate": gate, "rope": rope}

    @torch.inference_mode()
    def _capture(self) -> None:
        pieces = len(self.model.layers) + 1
        for b in reversed(self.sizes):  # largest first: the smaller buckets reuse its pool memory
            side = torch.cuda.Stream()  # warm-up: Triton compiles, cuBLAS plans, kernel guards verify
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                state: dict = {}
                for k in range(pieces):
                    state = self._piece(k, b, state)
            torch.cuda.current_stream().wait_stream(side)
            graphs, state = [], {}
            for k in range(pieces):
                graph = torch.cuda.CUDAGraph()
                # thread_local: other engines' threads in this process may touch CUDA meanwhile.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    new = self._piece(k, b, state)
                if k == 0:
                    self._ropes[b] = new["rope"]
                graphs.append(graph)
                state = new  # the previous piece's h and gate are free once this one holds them
            self.graphs[b] = graphs
        torch.cuda.synchronize()

    def bucket(self, tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= tokens), None)

    def forward(self, ids: torch.Tensor, meta: AttnMetadata, caches: list) -> torch.Tensor | None:
        t = ids.shape[0]
        b = self.bucket(t)
        if b is None or not enabled():
            return None
        self.model.model.check(meta, caches)
        self.ids[:t].copy_(ids)
        self.positions[:t].copy_(meta.positions)
        graphs = self.graphs[b]
        for k, layer in enumerate(self.model.layers):
            graphs[k].replay()
            inputs, out = self._views(layer, t)
            layer.self_attn.attend(*inputs, meta, caches[k], out=out)
        graphs[-1].replay()
        self.replays += 1
        return self.hidden[:t]

    def stats(self) -> dict:
        return {"token_sizes": self.sizes, "graphs": sum(len(g) for g in self.graphs.values()),
                "replays": self.replays}


def for_worker(model, config) -> PrefillGraphs | None:
    """The worker's prefill graphs, or None (logged) when they are off or cannot run."""
    if config.enforce_eager or not str(config.device).startswith("cuda") or not enabled():
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        log.warning("prefill_graphs_off", reason=reason)
        return None
    sizes = default_sizes(config.max_num_batched_tokens)
    try:
        graphs = PrefillGraphs(model, sizes)
    except Exception as e:  # serve eagerly rather than not at all
        log.error("prefill_graph_capture_failed", error=f"{type(e).__name__}: {e}"[:1200])
        return None
    log.info("prefill_graphs_captured", **graphs.stats())
    return graphs


def warm_up_mixed_steps(execute, config) -> None:
    """One mixed step (decodes beside prompts) at each decode graph batch size, all of it in the
    scratch KV block and state row, so Triton compiles at startup what only mixed steps run: the
    MLA decode kernel that leaves the KV write to write_kv, the absorb kernels on gathered rows.
    Each is a compile of ~a second at its first use, which a request would otherwise wait for.
    `execute(plan)` is the worker's; every rank runs the same steps (their collectives match)."""
    from ..engine.plan import SeqChunk, StepPlan
    from .cuda_graph import graph_batch_sizes, scratch_indices

    block, row = scratch_indices(config)
    sizes = sorted({*graph_batch_sizes(config), 1})
    bs = config.block_size
    t0 = time.perf_counter()
    for b in sizes:
        # Decodes three blocks into a context (the scratch block, repeated), whole prompts, and a
        # prompt's later chunk, which attends with a mask on another SDPA kernel: its first use
        # in a served mixed step took ~1 s (bench/RESULTS.md, run 23).
        chunks = [SeqChunk(-1, [0], 2 * bs, [block] * 3, state_slot=row) for _ in range(b)]
        chunks += [SeqChunk(-2, [0] * bs, 0, [block], state_slot=row) for _ in range(2)]
        half = max(1, bs // 2)
        chunks.append(SeqChunk(-3, [0] * half, bs - half, [block], state_slot=row))
        execute(StepPlan(chunks))
    if str(config.device).startswith("cuda"):
        torch.cuda.synchronize()
    log.info("mixed_steps_warmed_up", batch_sizes=sizes, seconds=round(time.perf_counter() - t0, 2))

