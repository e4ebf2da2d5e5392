"""A family of optional Triton kernels that must never cost a request.

The first call of each op in a process is the one that builds and launches its kernels on this
GPU; if it fails, the whole family is off for good (logged) and callers take their torch path,
so a kernel problem costs speed, not a request. Later errors propagate: a kernel that ran once
and then fails is a real fault.
"""

from __future__ import annotations

import torch

from ..log import get_logger


class KernelGuard:
    def __init__(self, family: str):
        self.family = family
        self.failure: str | None = None  # why the family is off, once a first call failed
        self._verified: set[str] = set()  # ops that ran once in this process
        self._log = get_logger(family)

    def call(self, op, *args):
        """`op(*args)`, or None when this is its first call in the process and it fails."""
        name = str(op)
        # is_compiling first: traced code must not read _verified, or dynamo guards on the set's
        # contents and the first eager call (lm_head's GEMV, say) forces a recompile, inside a
        # CUDA graph capture if that is where the compiled code runs next.
        if torch.compiler.is_compiling() or name in self._verified:
            return op(*args)
        try:
            out = op(*args)
        except Exception as e:  # noqa: BLE001 - any build/launch failure of the first call
            self.failure = f"{name}: {type(e).__name__}: {e}"[:500]
            self._log.error(f"{self.family}_off", error=self.failure)
            return None
        self._verified.add(name)
        return out
