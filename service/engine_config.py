"""Engine configuration: everything a rank needs to build its shard, pool, tail and KV cache."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError, ModelConfig, resolve_model
from .weights import fp8
from .weights.specs import check_fp8_layout

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# Largest batch the fused MoE tail takes (above it, the unfused path). CPU: it wins up to 64+
# tokens (bench/RESULTS.md, bench/tail.py). H200 (bench/tail.py --device cuda, virtual ranks, bf16,
# 2026-12-02): the fused tail matches the unfused path's compute alone up to M = 8 and costs
# ~1 us more per token above, so with the two all-reduces it saves (10-20 us each) it wins to ~16.
CPU_FUSED_TAIL_MAX_TOKENS = 64
GPU_FUSED_TAIL_MAX_TOKENS = 16


@dataclass
class EngineConfig:
    model: str = "tiny"
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    seed: int = 0
    hf_overrides: dict[str, Any] | None = None
    device: str = "cpu"
    # "fp8": quantize a bf16 checkpoint (or the dummy model) to FP8 128x128 block-scaled weights
    # at load, as vLLM's --quantization fp8; an FP8 checkpoint (quantization_config) needs nothing.
    quantization: str | None = None
    # Without a checkpoint: "seeded" draws every weight on the CPU from per-name seeds (the same
    # model at any TP size; about a minute for 8 GB); "device" draws them on the rank's device
    # (seconds; benchmarks only: the model differs between TP sizes and runs).
    dummy_weights: str = "seeded"
    # sleep mode and the memory pool
    enable_sleep_mode: bool = False
    sleep_preserve_parameter_names: list[str] = field(default_factory=list)
    pool_layout: str = "segregated"
    poison_discarded: bool = False
    # fused MoE tail
    fused_tail: str = "auto"
    # None: the measured crossover of the device (GPU_/CPU_FUSED_TAIL_MAX_TOKENS, set by resolve())
    fused_tail_max_tokens: int | None = None
    tail_deadline_s: float = 10.0
    # KV cache and batching
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    # CUDA graphs of the decode step (CUDA only; sizes above max_num_seqs are dropped)
    enforce_eager: bool = False
    cuda_graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    # Process a step's outputs (detokenize, stop strings, outputs) while the next step runs on the
    # device, as vLLM's async output processing: auto = on CUDA (where a launch returns before the
    # device finishes), off on the CPU (where it would only report every token a step later).
    async_output: str = "auto"
    # process group of the TP ranks: auto = nccl on CUDA, gloo on CPU
    tp_backend: str = "auto"
    # Ray
    ray_address: str | None = None
    num_cpus_per_rank: float | None = None  # None: min(1, CPUs in the cluster / TP)
    # filled by resolve()
    model_config: ModelConfig | None = None
    checkpoint_dir: str | None = None

    def resolve(self) -> EngineConfig:
        cfg, ckpt = resolve_model(self.model, self.hf_overrides)
        cfg = fp8.with_quantization(cfg, self.quantization)
        cfg.validate(self.tensor_parallel_size)
        check_fp8_layout(cfg, self.tensor_parallel_size)
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.fused_tail not in ("auto", "on", "off"):
            raise ConfigError(f"fused_tail must be auto, on or off, got {self.fused_tail!r}")
        if self.tp_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"tp_backend must be auto, nccl or gloo, got {self.tp_backend!r}")
        if self.dummy_weights not in ("seeded", "device"):
            raise ConfigError(f"dummy_weights must be seeded or device, got {self.dummy_weights!r}")
        if self.async_output not in ("auto", "on", "off"):
            raise ConfigError(f"async_output must be auto, on or off, got {self.async_output!r}")
        if self.pool_layout not in ("segregated", "interleaved"):
            raise ConfigError(f"pool_layout must be segregated or interleaved, got {self.pool_layout!r}")
        if not (0 < self.block_size <= 512 and self.block_size & (self.block_size - 1) == 0):
            raise ConfigError(f"block_size must be a power of 2 from 1 to 512, got {self.block_size}")
        max_len = self.max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len={max_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        tail_tokens = self.fused_tail_max_tokens
        if tail_tokens is None:
            tail_tokens = GPU_FUSED_TAIL_MAX_TOKENS if self.device.startswith("cuda") else CPU_FUSED_TAIL_MAX_TOKENS
        return dataclasses.replace(self, model_config=cfg, checkpoint_dir=ckpt, max_model_len=max_len,
                                   fused_tail_max_tokens=tail_tokens)

    @property
    def overlap_outputs(self) -> bool:
        """Whether the engine processes a step's outputs while the next step runs (async_output)."""
        return self.async_output == "on" or (self.async_output == "auto" and self.device.startswith("cuda"))

    @property
    def process_group_backend(self) -> str:
        if self.tp_backend != "auto":
            return self.tp_backend
        return "nccl" if self.device.startswith("cuda") else "gloo"

    @property
    def torch_dtype(self):
        import torch

        name = self.dtype
        if name == "auto":
            name = self.model_config.torch_dtype if self.model_config and self.model_config.torch_dtype else None
            if name not in ("float32", "bfloat16", "float16"):
                name = "bfloat16" if self.device.startswith("cuda") else "float32"
        return getattr(torch, name)

    def kv_blocks(self) -> int:
        if self.num_kv_blocks:
            return self.num_kv_blocks
        cfg = self.model_config
        # Only MLA layers keep per-token KV; KDA layers hold a fixed state per sequence.
        per_token = cfg.kv_cache_dim * max(len(cfg.mla_layers), 1) * self.torch_dtype.itemsize
        wanted = -(-self.max_num_seqs * self.max_model_len // self.block_size)
        fits = self.kv_cache_memory_bytes // (per_token * self.block_size)
        return max(8, min(wanted, fits))


# ---- the command line's engine options (service/cli.py and `serve` in server/app.py) ----
def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's command-line options (generate, serve, verify-sleep share them)."""
    p.add_argument("--model", default="tiny", help="preset (tiny, tiny-dense-moe, small, k3-tiny, k3) or checkpoint dir (DeepSeek-V3, Kimi-Linear or Kimi-K3 layout)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-overrides", type=json.loads, default=None, help='JSON, e.g. \'{"num_hidden_layers": 4}\'')
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize bf16 weights to FP8 128x128 block-scaled at load (FP8 checkpoints need no flag)")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster (e.g. auto); default: local")
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--sleep-preserve-parameter-names", nargs="*", default=[], metavar="GLOB")
    p.add_argument("--fused-tail", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--block-size", type=int, default=16, help="KV cache slots a block (a power of 2: 1-512)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="KV cache size per rank")
    p.add_argument("--cuda-graph-batch-sizes", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64], metavar="1,2,4",
                   help="decode batch sizes captured as CUDA graphs (those above --max-num-seqs are dropped)")
    p.add_argument("--dummy-weights", default="seeded", choices=["seeded", "device"],
                   help="without a checkpoint: seeded CPU draw (TP-invariant) or drawn on the device (fast; benches)")
    p.add_argument("--tail-deadline-s", type=float, default=10.0)
    p.add_argument("--async-output", default="auto", choices=["auto", "on", "off"],
                   help="process a step's outputs while the next step runs (auto: on CUDA only)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from the options `add_engine_args` added."""
    return dict(
        model=args.model, tensor_parallel_size=args.tp, dtype=args.dtype, seed=args.seed,
        hf_overrides=args.hf_overrides, quantization=args.quantization, enable_sleep_mode=args.enable_sleep_mode,
        sleep_preserve_parameter_names=args.sleep_preserve_parameter_names, fused_tail=args.fused_tail,
        device=args.device, ray_address=args.ray_address, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, tail_deadline_s=args.tail_deadline_s,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=int(args.kv_cache_memory_gib * (1 << 30)),
        cuda_graph_batch_sizes=args.cuda_graph_batch_sizes, dummy_weights=args.dummy_weights,
        async_output=args.async_output,
    )


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
