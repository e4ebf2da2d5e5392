"""The decode-throughput protocol, shared verbatim by both sides of bench/throughput.py.

Plain Python, no imports beyond the standard library: it is loaded both in the product
venv (our engine) and in .venv-vllm (vllm_generate.py), so both engines are measured by
the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def bench_prompts(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    # Deterministic, distinct prompts (no shared prefix to exploit), ids clear of specials 0..3.
    return [[4 + (b * 7919 + i * 104729) % (vocab_size - 4) for i in range(prompt_len)] for b in range(batch)]


def measure_decode(generate: Callable[[list[list[int]], int], object], prompts: list[list[int]],
                   tokens: int, repeats: int = 2) -> dict:
    """Decode rate = extra tokens over extra time versus a prefill-only run (max_tokens=1),
    so prefill cost does not dilute the number. Best of `repeats`: on a shared box other
    load only ever slows a run down."""
    t_prefill = t_full = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(prompts, 1)
        t_prefill = min(t_prefill, time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate(prompts, tokens)
        t_full = min(t_full, time.perf_counter() - t0)
    batch = len(prompts)
    return {
        "batch": batch,
        "tokens": tokens,
        "prefill_s": t_prefill,
        "total_s": t_full,
        "decode_tokens_per_s": batch * (tokens - 1) / max(t_full - t_prefill, 1e-9),
        "e2e_tokens_per_s": batch * tokens / t_full,
    }
