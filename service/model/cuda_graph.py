"""CUDA graphs of the decode step at fixed batch sizes.

A decode step (one token per sequence, logits for every row) at batch n replays the graph of
the smallest captured size >= n. Rows past n (padding) run as a fresh one-token sequence in a
scratch KV block and a scratch KDA state row that the engine never hands out (the worker
allocates one of each past the engine's; `scratch_indices`): KDA layers read-modify-write
their rows in place, so a padding row on a live sequence's row would apply its step twice, and
a padding row's hidden state differs from the row it copies once a KDA layer ran, so its MLA
KV write would race that row's own. The capture runs every row there too. Every input (token,
position, KV slot, context length, state row, block table) lives in one device buffer that the
host fills with a single copy per step.

The graphs read the weights and the KV cache at their pool addresses. Sleep keeps those
addresses (DESIGN §2), so graphs captured once stay valid across level-1 and level-2 cycles
and weight reloads: nothing is ever recaptured. Activations live in a private graph memory
pool of torch's allocator, which sleep does not touch.

At TP > 1 the graphs hold the ranks' collectives: the device all-reduce/all-gather
(tail/device_comm.py) and the fused tail, whose comm regions sleep never releases and whose
flags are pool state restored at the same address. Their kernels record a timeout in an error
word instead of raising; `run` reads those after each replay and raises as the eager call would.

While capturing, each decoder layer runs as torch.compile'd code (fusion.CompiledForward, one
compile for every layer of the same structure, batch size dynamic): a layer becomes a few
Inductor kernels around the library GEMMs, the grouped GEMMs and the MLA decode custom op, and
the graph records those kernels. Weights and KV cache are inputs of the compiled code, read at
their pool addresses like any eager kernel's; the compiled code runs only during capture, so
eager steps (prefills, mixed batches) are untouched. LATENTSERVE_COMPILE=chains or 0 captures
the uncompiled layers; a compiler failure falls back to them (logged, in `stats()`).
"""

from __future__ import annotations

import contextlib

import torch

from ..engine.plan import SeqChunk
from ..log import get_logger
from . import fusion, mla_decode, moe_kernels, pdl
from .attn_metadata import AttnMetadata
from .decode_inputs import (
    CONTEXT,
    FIELDS,
    IDS,
    POSITIONS,
    SLOTS,
    STATE,
    DecodeInputs,
    buffer_len,
    fill_scratch,
)
from .kda import KDAState
from .kda_ops import fla_available
from .moe import MoE, grouped_mm_fast

log = get_logger("cuda_graph")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def scratch_indices(config) -> tuple[int, int]:
    """(KV block, KDA state row) that no sequence ever gets: the engine's block manager owns
    blocks 0..kv_blocks()-1 and its scheduler state slots 0..max_num_seqs-1; the worker
    allocates one more of each (`_allocate_kv_cache`)."""
    return config.kv_blocks(), config.max_num_seqs


def unsupported_reason(model, kv_caches: list, max_batch: int | None = None) -> str | None:
    """Why this model cannot run its decode step in a CUDA graph (at batches up to max_batch), or None."""
    w = model.model.norm.weight
    if not w.is_cuda:
        return "not on CUDA"
    if model.tp.world_size != 1 and getattr(model.tp, "device_comm", None) is None:
        return ("TP > 1 without the device collectives (ranks on several nodes, or "
                "LATENTSERVE_CUDA_ALLREDUCE=0): torch.distributed cannot be captured")
    states = [c for c in kv_caches if isinstance(c, KDAState)]
    if states:
        if any(s.recurrent.dtype != torch.float32 for s in states):
            return "KDA recurrent state rows are not float32 (FLA's in-place decode kernel needs them so)"
        if not fla_available():  # the torch recurrent step is graph-safe too, only slower
            log.info("kda_decode_torch_path", reason="fla (fla-core) does not import")
    has_moe = any(isinstance(layer.mlp, MoE) for layer in model.layers)
    if has_moe and not grouped_mm_fast(w) and not _gemv_experts_only(model, w, max_batch):
        return (f"MoE needs torch._grouped_mm's fused kernels (bf16 on sm_90/sm_100), got {w.dtype}, or every "
                f"captured batch within the Triton GEMV experts' {moe_kernels.gemv_max_tokens()} tokens")
    kv = next((c for c in kv_caches if isinstance(c, torch.Tensor)), None)
    if kv is None:
        return None
    probe = torch.empty(1, 1, kv.shape[-1], dtype=w.dtype, device=w.device)
    if not mla_decode.supported(probe, kv, model.config.kv_lora_rank):
        return "the Triton MLA decode kernel does not fit (Triton missing, or latent/rope widths not powers of 2)"
    return None


def _gemv_experts_only(model, w: torch.Tensor, max_batch: int | None) -> bool:
    """Every captured batch takes the Triton GEMV experts (the fallback without grouped GEMMs
    syncs with the host per expert, which a capture cannot)."""
    if max_batch is None:
        return False
    probe = torch.empty(max_batch, 1, dtype=w.dtype, device=w.device)
    return moe_kernels.experts_supported(probe, model.config.hidden_act)


def scratch_reason(kv_caches: list, scratch: tuple[int, int]) -> str | None:
    block, row = scratch
    for c in kv_caches:
        if isinstance(c, torch.Tensor) and c.shape[0] <= block:
            return f"the KV cache has no scratch block {block} for padding rows"
        if isinstance(c, KDAState) and c.recurrent.shape[0] <= row:
            return f"the KDA state has no scratch row {row} for padding rows"
    return None


def collective_checks(model) -> list:
    """Host reads of the TP collectives' error words, run after each replay (a capture cannot
    read them): the fused tail's, then the device all-reduce's; each raises as its eager call does."""
    checks = {id(r.collective): r.collective.check for r in model.tail_runners()
              if r.collective is not None and hasattr(r.collective, "check")}
    comm = getattr(model.tp, "device_comm", None)
    return list(checks.values()) + ([comm.check] if comm is not None else [])


class DecodeGraphs:
    """Captures at construction; `run(chunks)` returns fp32 logits [n, vocab], or None when the
    step is not a graphable decode (then the caller runs it eagerly)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_model_len: int,
                 batch_sizes=DEFAULT_BATCH_SIZES, compile_layers: bool | None = None,
                 scratch: tuple[int, int] = (0, 0)):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch = scratch  # (KV block, KDA state row): padding rows and the capture run there
        self.sizes = sorted(set(int(b) for b in batch_sizes))
        self.max_batch = self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        device = model.model.norm.weight.device
        n = self.max_batch
        self.inputs = torch.zeros(buffer_len(n, self.width), dtype=torch.long, device=device)
        self.staging = torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=True)
        self._staging_np = self.staging.numpy()
        self._copied = torch.cuda.Event()
        # Packing waits until the previous step's copy has left the staging buffer.
        self.host = DecodeInputs(self._staging_np, self.sizes, self.width, block_size, scratch,
                                 before_write=self._copied.synchronize)
        fields = self.inputs[: FIELDS * n].view(FIELDS, n)
        self.ids, self.positions, self.slots, self.context = fields[IDS], fields[POSITIONS], fields[SLOTS], fields[CONTEXT]
        self.state_slots = fields[STATE]
        self.tables = self.inputs[FIELDS * n:].view(n, self.width)
        self.rows = torch.arange(n + 1, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.replays = 0
        self._checks = collective_checks(model)
        self.unchecked = False  # a replay whose error words nobody has read yet
        if compile_layers is None:
            compile_layers = fusion.layers_enabled()
        self.compiled = (fusion.CompiledForward("decoder_layer", dynamic=True, **pdl.inductor_options(device))
                         if compile_layers else None)
        self._capture()

    def _meta(self, b: int) -> AttnMetadata:
        rows = self.rows[:b]
        return AttnMetadata(
            positions=self.positions[:b], slot_mapping=self.slots[:b], query_start_loc=self.rows[: b + 1],
            context_lens=self.context[:b], block_tables=self.tables[:b], logits_indices=rows,
            block_size=self.block_size, query_lens=[1] * b, query_starts=list(range(b + 1)),
            start_positions=[0] * b, context_lens_list=[1] * b, max_position=0,
            decode_token_idx=rows, decode_block_tables=self.tables[:b], decode_slots=None, decode_bias=None,
            prefill_chunks=[], decode_context_lens=self.context[:b], state_slots=self.state_slots[:b])

    def _forward(self, b: int, meta: AttnMetadata) -> torch.Tensor:
        hidden = self.model(self.ids[:b], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _compiled_layers(self):
        if self.compiled is None:
            return contextlib.nullcontext()
        # The KV caches and state rows keep their shapes for the engine's life: no symbolic dims.
        for kv in self.kv_caches:
            for t in (kv.conv, kv.recurrent) if isinstance(kv, KDAState) else (kv,):
                torch._dynamo.mark_static(t)
        layers = self.model.layers
        if self.model.model.attn_res:
            # Attention-residual layers: their attention and MLP modules are compiled, the mixes
            # (each its own fused chain) stay out, as measured; a whole layer would also trace the
            # mix's in-place write of the bank, an input.
            layers = [m for layer in layers for m in (layer.self_attn, layer.mlp)]
        return fusion.compiled_calls(layers, self.compiled)

    def _no_compiling(self):
        """Inside a capture, compiled code must not compile again: a recompile there benchmarks
        and syncs, which invalidates the capture with no word of why. The warm-ups compile; a
        guard that still fails during capture raises (with dynamo's reason) instead."""
        if self.compiled is None or not hasattr(torch.compiler, "set_stance"):
            return contextlib.nullcontext()
        return torch.compiler.set_stance("fail_on_recompile")

    @torch.inference_mode()
    def _capture(self) -> None:
        # Every row in the scratch block and state row: capture writes nothing a sequence owns.
        self._staging_np[:] = 0
        fill_scratch(self._staging_np, 0, self.max_batch, self.max_batch, self.width, self.block_size, self.scratch)
        self.host.forget()
        self.inputs.copy_(self.staging)
        with self._compiled_layers():
            self._capture_all()
        torch.cuda.synchronize()
        if self.compiled is not None:
            log.info("decode_layers_compiled", compiled=not self.compiled.broken, error=self.compiled.error)

    def _warm_up(self, b: int, meta: AttnMetadata) -> None:
        """One step outside any graph: Triton compiles, cuBLAS plans, dynamo compiles."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(b, meta)
        torch.cuda.current_stream().wait_stream(side)

    def _capture_all(self) -> None:
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            meta = self._meta(b)
            self._warm_up(b, meta)
            for attempt in (1, 2):
                graph = torch.cuda.CUDAGraph()
                try:
                    # thread_local: other engines' threads in this process may touch CUDA meanwhile.
                    with self._no_compiling(), torch.cuda.graph(graph, pool=self.mempool,
                                                                capture_error_mode="thread_local"):
                        self.logits[b] = self._forward(b, meta)
                    break
                except RuntimeError as e:
                    # State that changed after the warm-up (something its eager parts did) can
                    # fail a guard; one more warm-up compiles that case outside the capture.
                    if attempt == 2 or "recompile" not in str(e):
                        raise
                    log.warning("decode_capture_recompile", batch=b, reason=str(e)[:800])
                    self._warm_up(b, meta)
            self.graphs[b] = graph
            self.captures += 1

    def batch_for(self, n: int) -> int:
        return self.host.batch_for(n)

    def prepare(self, chunks: list[SeqChunk]) -> bool:
        """Pack a decode step scheduled ahead but for its token ids (`DecodeInputs.prepare`); its
        `run` (the same chunk list, ids filled in) then writes only those."""
        return self.host.prepare(chunks)

    def run(self, chunks: list[SeqChunk], check: bool = True) -> torch.Tensor | None:
        """check=False leaves the collectives' error words to `check()`: reading them waits for the
        replay, which an engine overlapping its host work with the step must not do at launch."""
        b = self.host.pack(chunks)
        if b is None:
            return None
        self.inputs.copy_(self.staging, non_blocking=True)
        self._copied.record()
        self.graphs[b].replay()
        self.replays += 1
        # A copy: the graph's output buffer is overwritten by the next replay.
        logits = self.logits[b][: len(chunks)].clone()
        self.unchecked = bool(self._checks)  # TP 1 has no collective: nothing to read, no wait
        if check:
            self.check()
        return logits

    def check(self) -> None:
        """Raise if a collective's kernel in the last replay gave up (it recorded why in its err)."""
        if self.unchecked:
            self.unchecked = False
            for check in self._checks:
                check()

    def stats(self) -> dict:
        compiled = None
        if self.compiled is not None:
            compiled = {"ok": not self.compiled.broken, "calls": self.compiled.calls, "error": self.compiled.error}
        return {"batch_sizes": self.sizes, "captures": self.captures, "replays": self.replays,
                "prepared_packs": self.host.prepared_packs,
                "graph_ids": {b: id(g) for b, g in self.graphs.items()}, "compiled_layers": compiled}


def graph_batch_sizes(config) -> list[int]:
    """The configured decode graph batch sizes a step can reach (up to max_num_seqs)."""
    return [b for b in config.cuda_graph_batch_sizes if b <= config.max_num_seqs]


def for_worker(model, kv_caches: list[torch.Tensor], config) -> DecodeGraphs | None:
    """The worker's decode graphs, or None (logged) when they are off or cannot run."""
    if config.enforce_eager or not str(config.device).startswith("cuda"):
        return None
    sizes = graph_batch_sizes(config)
    scratch = scratch_indices(config)
    reason = unsupported_reason(model, kv_caches, max(sizes, default=None)) or scratch_reason(kv_caches, scratch)
    if reason is None and not sizes:
        reason = f"no cuda_graph_batch_sizes <= max_num_seqs={config.max_num_seqs}"
    if reason is not None:
        log.warning("cuda_graphs_off", reason=reason)
        return None
    # Compiled layers first; a capture they break (not a compiler error: those fall back inside)
    # is retried with the uncompiled layers, and only then does the engine serve eagerly.
    for compile_layers in ([True, False] if fusion.layers_enabled() else [False]):
        try:
            graphs = DecodeGraphs(model, kv_caches, config.block_size, config.max_model_len, sizes,
                                  compile_layers=compile_layers, scratch=scratch)
        except Exception as e:  # serve eagerly rather than not at all
            log.error("cuda_graph_capture_failed", compiled_layers=compile_layers, error=f"{type(e).__name__}: {e}"[:1200])
            continue
        log.info("cuda_graphs_captured", batch_sizes=graphs.sizes, compiled_layers=graphs.stats()["compiled_layers"])
        return graphs
    return None
