"""Where the Triton kernel tests run: on a CUDA GPU, or on a CPU with Triton installed and
TRITON_INTERPRET=1 (kernels interpreted on host memory). Each test module calls
`require_kernel_device()` before importing what needs Triton, and marks itself `kernel_marks(t)`:
`gpu` only when not interpreted, so CPU runs with the interpreter are not skipped by conftest.
Triton 3.6's interpreter fails under numpy 2.4 (the pinned one: `int()` of a one-element array
raises), so give the interpreter an older numpy first on the path:

    pip install --target /tmp/np "numpy<2.4"; PYTHONPATH=/tmp/np TRITON_INTERPRET=1 pytest tests/gpu/..."""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"

# `tiny` with power-of-2 MLA latent and rope widths: the Triton MLA decode kernel runs, which the
# decode graphs need (on tiny's own widths they are off).
GRAPH_SHAPES = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, initializer_range=0.1)
# The same at the widths the CUDA C MLA kernel takes (latent 512, rope 64): its graph test, and
# bench/route_flips.py's question of how far a change to those layers moves the logits.
MLA_CUDA_SHAPES = {**GRAPH_SHAPES, "kv_lora_rank": 512, "qk_rope_head_dim": 64}

# Every token routed to all of its layer's experts, in `graph_steps`: the step's logits are then a
# continuous function of each kernel's output. Under tiny's top-4 of 16, noise of 3e-3 or 1e-2 of
# each MLA layer's output (bench/route_flips.py, on a CPU) flipped one token's expert choice in 4 of
# 20 tries and moved that row by 0.11-0.27, the size of runs 120-121's failures; with all four of
# four experts chosen, no row moved by more than 0.034 (bench/RESULTS.md, 2026-12-07).
DENSE_ROUTING = dict(n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)


def require_kernel_device():
    """Triton's module, or a skip of the calling module: no Triton, or neither CUDA nor the interpreter."""
    triton = pytest.importorskip("triton")
    if not torch.cuda.is_available() and not INTERPRET:
        pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
    return triton


def require_cuda_c() -> None:
    """Skip the calling module unless the hand-written CUDA C kernels (nvrtc.py) can run here: an
    sm_90 or later GPU, cuda.bindings, and Triton for the kernels they are compared against."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90 or later GPU", allow_module_level=True)
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64, on the CPU (either may be a GPU tensor)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def experts_reference(x, w13, w2, weights, ids, act) -> torch.Tensor:
    """The routed experts in float64 on the CPU (inputs on any device): sum_j weights[:, j] *
    w2[ids[:, j]] @ act(w13[ids[:, j]] @ x), one expert at a time; act(gate, up) as the model's."""
    x, w13, w2, weights, ids = (t.cpu() for t in (x.double(), w13.double(), w2.double(), weights.double(), ids))
    shard = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].T
        out.index_add_(0, tok, (act(gu[:, :shard], gu[:, shard:]) @ w2[e].T) * weights[tok, slot, None])
    return out


def record_calls(monkeypatch, module, name: str) -> list:
    """module.name wrapped so each call's result is appended to the returned list (the CUDA C
    kernels' `run` returns True once launched)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


def kernel_marks(timeout_s: int) -> list:
    return [pytest.mark.timeout(timeout_s)] + ([] if INTERPRET else [pytest.mark.gpu])


def skip_interpreted_16bit_dot(dtype: torch.dtype) -> None:
    """Skip a 16-bit case under the interpreter: Triton 3.6's computes bf16 tl.dot wrongly (1e10
    off on 16x16), so kernels that reach tl.dot are checked in fp32 there and in bf16 on a GPU."""
    if INTERPRET and dtype != torch.float32:
        pytest.skip("Triton 3.6's interpreter computes bf16 tl.dot wrongly (1e10 off on 16x16)")


class GraphStep(NamedTuple):
    """One decode step's logits: replayed from a graph with a switch on, the eager step with it
    on and off, and the replay's kernel names."""

    replay: torch.Tensor
    eager_on: torch.Tensor
    eager_off: torch.Tensor
    kernels: list[str]

    def errors(self) -> tuple[float, float]:
        """The replay against the eager step with the switch on (the graph's own error) and off
        (the kernel's against the one it replaces), apart so a failure says which it is."""
        return rel_error(self.replay, self.eager_on), rel_error(self.replay, self.eager_off)


def replay_and_eager(worker, rows: int, monkeypatch, switch: str, on: str) -> GraphStep:
    """One decode step of `rows` sequences replayed from a graph with the switch (a LATENTSERVE_*
    variable) `on`, then the same step eager with it `on` and off ("0")."""
    from service.engine.plan import SeqChunk, StepPlan

    chunks = [SeqChunk(i, [7 + i], 20 + 3 * i, [2 * i, 2 * i + 1]) for i in range(rows)]
    monkeypatch.setenv(switch, on)
    with torch.inference_mode():
        before = worker.decode_graphs.replays
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = worker.execute(StepPlan(chunks))
            torch.cuda.synchronize()
        assert worker.decode_graphs.replays == before + 1, "the step did not replay a graph"
        # The step writes only the new token's cache row, the same each time: it can run again.
        eager_on = worker._eager_forward(chunks, worker.kv_caches)
        monkeypatch.setenv(switch, "0")
        eager_off = worker._eager_forward(chunks, worker.kv_caches)
    return GraphStep(out, eager_on, eager_off, [e.name for e in prof.events()])


def graph_steps(monkeypatch, switch: str, on: str, hf_overrides: dict, rows=(1, 4)) -> dict[int, GraphStep]:
    """`tiny` in bf16, routed densely (DENSE_ROUTING), with the switch set to `on` while its decode
    graphs are captured at `rows` sequences, its KV caches random: {rows: `replay_and_eager`'s GraphStep}."""
    from service import LLM

    monkeypatch.setenv(switch, on)
    llm = LLM(model="tiny", hf_overrides={**hf_overrides, **DENSE_ROUTING}, dtype="bfloat16", device=DEVICE, seed=0,
              distributed_executor_backend="uni", max_num_seqs=max(rows), cuda_graph_batch_sizes=list(rows))
    try:
        worker = llm.executor.rank0
        with torch.inference_mode():
            # Seeded: the global generator's state depends on the tests before (run 120 failed one
            # graph test only after another module's tests had drawn from it).
            gen = torch.Generator(device=worker.kv_caches[0].device).manual_seed(0)
            for kv in worker.kv_caches:
                kv.normal_(generator=gen)
        steps = {r: replay_and_eager(worker, r, monkeypatch, switch, on) for r in rows}
        for r, step in steps.items():  # in the log whether the test passes or not (gpu_check.sh greps it)
            on_err, off_err = step.errors()
            pdl = os.environ.get("LATENTSERVE_PDL", "1")
            print(f"graph step {switch}={on} PDL {pdl} {r} rows: replay vs eager on {on_err:.2e}, off {off_err:.2e}")
        return steps
    finally:
        llm.shutdown()
        torch._dynamo.reset()


@torch.no_grad()
def fill_random(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter of a layer under test from `generator`, in name order: matrices scaled by
    1/sqrt(fan-in), vectors by 1/4, so outputs stay O(1) through a layer's projections."""
    for _, p in sorted(module.named_parameters()):
        p.copy_(torch.randn(p.shape, generator=generator) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 4))


def k3_decode_kernels(monkeypatch, on: bool) -> None:
    """Kimi-K3's four decode kernels on (their defaults, whatever the caller's environment) or off
    (the `fla` path). Rank processes started afterwards inherit the environment."""
    from service.model.model import K3_DECODE_SWITCHES

    for name in K3_DECODE_SWITCHES:
        if on:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, "0")
