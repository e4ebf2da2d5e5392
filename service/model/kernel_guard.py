"""A family of optional Triton kernels that must never cost a request.

The first call of each op in a process is the one that builds and launches its kernels on this
GPU; if it fails, the whole family is off for good (logged) and callers take their torch path,
so a kernel problem costs speed, not a request. A later call can build too: a new launch shape
is a new compile, and Triton refuses one that needs more shared memory or registers than the GPU
has (run 47: the GEMV's 256-row tiles, 240 KB, at the first 256-row step, after every smaller
shape had run). Such build errors turn the family off the same way. Any other later error
propagates: a kernel that ran once and then fails is a real fault.
"""

from __future__ import annotations

import torch

from ..log import get_logger


class KernelGuard:
    def __init__(self, family: str):
        self.family = family
        self.failure: str | None = None  # why the family is off, once a call failed to build or run
        self._verified: set[str] = set()  # ops that ran once in this process
        self._log = get_logger(family)

    def call(self, op, *args):
        """`op(*args)`, or None when it fails on its first call in the process or cannot build a
        new launch shape later (the family is then off)."""
        name = str(op)
        # is_compiling first: traced code must not read _verified, or dynamo guards on the set's
        # contents and the first eager call (lm_head's GEMV, say) forces a recompile, inside a
        # CUDA graph capture if that is where the compiled code runs next.
        if torch.compiler.is_compiling():
            return op(*args)
        try:
            out = op(*args)
        except Exception as e:  # noqa: BLE001 - any failure of a first call; a build failure of any
            if name in self._verified and not _build_failure(e):
                raise
            self.failure = f"{name}: {type(e).__name__}: {e}"[:500]
            self._log.error(f"{self.family}_off", error=self.failure)
            return None
        self._verified.add(name)
        return out


# Triton's errors for a kernel it could not build or load for this GPU (by name: CPU installs have
# no Triton to import them from).
_BUILD_ERRORS = {"OutOfResources", "PTXASError", "CompilationError"}


def _build_failure(e: Exception) -> bool:
    return any(cls.__name__ in _BUILD_ERRORS for cls in type(e).__mro__)
