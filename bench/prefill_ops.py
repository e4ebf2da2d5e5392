"""One MLA layer's eager forward over a mixed step (decodes plus whole prompts), with prompts
batched by length (`MLAAttention._whole_prompts`) against the per-prompt path in the same run:
top-level aten ops (each at least one kernel launch on a GPU, where an eager step is
launch-bound) and wall time per layer.

    python bench/prefill_ops.py [--preset tiny] [--device cpu] [--prompts 64] [--prompt-len 128] [--decodes 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.config import resolve_model  # noqa: E402
from service.engine.plan import SeqChunk  # noqa: E402
from service.model.attention import MLAAttention, kv_cache_shape  # noqa: E402
from service.model.attn_metadata import AttnMetadata  # noqa: E402
from service.model.layers import RotaryEmbedding  # noqa: E402
from service.parallel import TPGroup  # noqa: E402

BLOCK = 16


def mixed_step(prompts: int, length: int, decodes: int, context: int) -> tuple[list[SeqChunk], int]:
    chunks, block = [], 0
    for i in range(decodes):
        n = -(-(context + 1) // BLOCK)
        chunks.append(SeqChunk(i, [5], context, list(range(block, block + n))))
        block += n
    for i in range(prompts):
        n = -(-length // BLOCK)
        chunks.append(SeqChunk(decodes + i, list(range(3, 3 + length)), 0, list(range(block, block + n))))
        block += n
    return chunks, block


def measure(attn, x, cos, sin, meta, cache, device: str, reps: int) -> dict:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    attn(x, cos, sin, meta, cache)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attn(x, cos, sin, meta, cache)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::")
              and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        attn(x, cos, sin, meta, cache)
    sync()
    return {"aten_ops": ops, "ms": (time.perf_counter() - t0) / reps * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cfg, _ = resolve_model(args.preset)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    attn = MLAAttention(cfg, TPGroup.single(), 0, dtype).to(args.device)
    chunks, blocks = mixed_step(args.prompts, args.prompt_len, args.decodes, args.context)
    meta = AttnMetadata.build(chunks, BLOCK, args.device)
    x = torch.randn(meta.num_tokens, cfg.hidden_size, device=args.device, dtype=dtype)
    cos, sin = (None, None) if cfg.mla_use_nope else RotaryEmbedding(cfg).to(args.device).lookup(meta.positions)
    cache = torch.randn(kv_cache_shape(cfg, blocks, BLOCK), device=args.device, dtype=dtype)
    with torch.no_grad():
        batched = measure(attn, x, cos, sin, meta, cache, args.device, args.reps)
        per_prompt = AttnMetadata.build(chunks, BLOCK, args.device)
        per_prompt._prefill_groups = ([], per_prompt.prefill_chunks, None)  # the per-prompt path
        baseline = measure(attn, x, cos, sin, per_prompt, cache, args.device, args.reps)
    out = {"preset": args.preset, "device": args.device, "prompts": args.prompts, "prompt_len": args.prompt_len,
           "decodes": args.decodes, "batched": batched, "per_prompt": baseline,
           "ops_ratio": baseline["aten_ops"] / batched["aten_ops"], "time_ratio": baseline["ms"] / batched["ms"]}
    print(json.dumps(out))
    print(f"one MLA layer, {args.decodes} decodes + {args.prompts} prompts of {args.prompt_len}: "
          f"{batched['aten_ops']} aten ops ({baseline['aten_ops']} per prompt: {out['ops_ratio']:.1f}x fewer), "
          f"{batched['ms']:.1f} ms ({baseline['ms']:.1f} ms per prompt: {out['time_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
