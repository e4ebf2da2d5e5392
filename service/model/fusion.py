"""torch.compile on CUDA, at two grains, with the eager code as the fallback.

A decode step on a GPU is launch-bound: each layer ran ~135 kernels, most of them tiny
elementwise ops (an RMSNorm is 7, rope 10, the router's group-limited top-k ~15).

- `fused(fn)` compiles such a pure function once per process (dynamic shapes, so every batch
  size and width shares it); it runs in every step, eager ones included.
- `CompiledForward` compiles a whole module's forward (the decoder layer): the decode CUDA
  graphs (cuda_graph.py) route each layer's call through it while they capture, so one layer
  of a decode step becomes a few Inductor kernels around the library GEMMs. Layers of the same
  structure share the compiled code (dynamo guards on their parameters' shapes, not on which
  module); the fused chains inside are traced as plain torch code.

CPU tensors keep the eager function: nothing is launch-bound there and CI needs no compiler.
A compiler failure turns that compiled path off for good (logged) and runs the eager code; an
error of the computation itself propagates. LATENTSERVE_COMPILE picks the grain: `0` nothing
compiled (the bench's baseline), `chains` only the `fused` chains, `layers` (the default) both.
Compiled layers first measured 2x slower than the chains (2026-12-03: Inductor turned the
KV-cache write into a copy of the whole cache); with that write an opaque op
(attention.write_kv) they are the faster grain at every batch size (bench/RESULTS.md: 4.04 vs
4.21 ms at batch 1, 10.9 vs 12.4 ms at batch 256 on the H200), hence the default.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..log import get_logger

log = get_logger("fusion")
# One compiled variant per (dtype, eps, weight or none, rope layout, batch 1 or more): several
# models in one process (tests, bench baselines) pass dynamo's default limit of 8.
_RECOMPILE_LIMIT = 64


def compile_mode() -> str:
    """'off', 'chains' or 'layers' (LATENTSERVE_COMPILE=0 / chains / layers, the default)."""
    value = os.environ.get("LATENTSERVE_COMPILE", "layers").strip().lower()
    return "off" if value == "0" else "chains" if value == "chains" else "layers"


def compile_enabled() -> bool:
    return compile_mode() != "off"


def layers_enabled() -> bool:
    return compile_mode() == "layers"


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), _RECOMPILE_LIMIT))
            return


def _compiler_errors() -> tuple[type[BaseException], ...]:
    """Failures of the compiler itself; a kernel's runtime error (OOM, bad input) is not one."""
    import torch._dynamo.exc as dynamo_exc

    names = [(dynamo_exc, "TorchDynamoException"), (dynamo_exc, "FailOnRecompileLimitHit")]
    try:
        import torch._inductor.exc as inductor_exc

        names.append((inductor_exc, "InductorError"))
    except ImportError:
        pass
    return tuple(getattr(mod, name) for mod, name in names if hasattr(mod, name))


def fused(fn):
    compiled = None
    broken = False
    errors: tuple[type[BaseException], ...] = ()

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        nonlocal compiled, broken, errors
        # is_compiling first: inside a compiled layer the chain is traced as plain torch code.
        if torch.compiler.is_compiling() or broken or not x.is_cuda or not compile_enabled():
            return fn(x, *args)
        if compiled is None:
            _raise_recompile_limit()
            errors = _compiler_errors()
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(x, *args)
        except errors as e:  # a compiler failure costs speed, never a request
            broken = True
            log.error("fusion_off", function=fn.__name__, error=f"{type(e).__name__}: {e}"[:500])
            return fn(x, *args)

    call.eager = fn
    return call


def _no_duck_shapes():
    """Dynamic dims that happen to equal another dim (batch 8 and 8 heads, batch 256 and 256
    block-table columns) get their own symbols, so one graph stays general in the batch size."""
    try:
        import torch.fx.experimental._config as fx_config

        return fx_config.patch(use_duck_shape=False)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def _module_forward(module, *args):
    return module.forward(*args)


class CompiledForward:
    """`self(module, *args)` = `module.forward(*args)`, through one torch.compile shared by every
    module it serves. Options go to torch.compile (dynamic=True: one graph for every batch size
    above 1, one for batch 1). `error` holds the compiler failure that turned it off, if any."""

    def __init__(self, name: str, **options):
        self.name = name
        self.options = {"fullgraph": False, **options}
        self.compiled = None
        self.broken = False
        self.error: str | None = None
        self.calls = 0
        self._errors: tuple[type[BaseException], ...] = ()

    def __call__(self, module, *args):
        if self.broken or not compile_enabled():
            return module.forward(*args)
        if self.compiled is None:
            _raise_recompile_limit()
            self._errors = _compiler_errors()
            self.compiled = torch.compile(_module_forward, **self.options)
        try:
            with _no_duck_shapes():
                out = self.compiled(module, *args)
        except self._errors as e:  # a compiler failure costs speed, never a request
            self.broken = True
            self.error = f"{type(e).__name__}: {e}"[:500]
            log.error("fusion_off", function=self.name, error=self.error)
            return module.forward(*args)
        self.calls += 1
        return out


@contextlib.contextmanager
def compiled_calls(modules, compiled: CompiledForward):
    """Inside the block, calling any of `modules` runs `compiled(module, *args)` (nn.Module's own
    slot for a compiled call, `_compiled_call_impl`, which `Module.compile` sets); restored after.
    Modules without that slot (another torch) stay eager."""
    saved = []
    try:
        for m in modules:
            if hasattr(m, "_compiled_call_impl"):
                saved.append((m, m._compiled_call_impl))
                m._compiled_call_impl = functools.partial(compiled, m)
        yield
    finally:
        for m, prev in saved:
            m._compiled_call_impl = prev
