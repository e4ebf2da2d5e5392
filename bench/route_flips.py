"""How far a small change to each MLA layer's output moves `tiny`'s decode logits, with its own
sparse routing (top-4 of 16) and with every token routed to all experts (the GPU graph tests'
kernel_env.DENSE_ROUTING).

    python3 bench/route_flips.py [--rows 1 4] [--noise 0.003 0.01] [--tries 5] [--json out.json]

One eager decode step (bf16, the MLA widths of test_mla_cuda: latent 512, rope 64, random KV
caches) is the baseline; then the same step with seeded Gaussian noise of --noise times each MLA
output's RMS added to it, --tries times. A kernel swapped for another with the same math (the CUDA
C MLA kernel for the Triton one) changes those outputs by about that much. It prints each try's
relative error of the step's logits, whole and per row; the last line is the largest with each
routing and their ratio. A row that moves by ~0.1 or more under ~1e-2 of noise is a token whose
expert choice flipped: what a whole-step bound in a test cannot tell from a broken kernel.
Runs on a CPU (a numerical question, not a timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

from kernel_env import DENSE_ROUTING, MLA_CUDA_SHAPES  # noqa: E402

from service import LLM  # noqa: E402
from service.engine.plan import SeqChunk  # noqa: E402
from service.model.attention import MLAAttention  # noqa: E402


class Noise:
    """A forward hook adding `scale` x the output's RMS of seeded Gaussian noise (0: none)."""

    def __init__(self, seed: int):
        self.scale, self.gen = 0.0, torch.Generator().manual_seed(seed)

    def __call__(self, module, args, out):
        if not self.scale:
            return out
        rms = out.float().pow(2).mean().sqrt()
        return out + (torch.randn(out.shape, generator=self.gen) * rms * self.scale).to(out.dtype)


def rel(a: torch.Tensor, b: torch.Tensor, dim=None) -> torch.Tensor:
    a, b = a.double(), b.double()
    return (a - b).norm(dim=dim) / b.norm(dim=dim)


def measure(routing: str, overrides: dict, args) -> list[dict]:
    llm = LLM(model="tiny", hf_overrides={**MLA_CUDA_SHAPES, **overrides}, dtype="bfloat16", device="cpu", seed=0,
              distributed_executor_backend="uni", max_num_seqs=max(args.rows))
    try:
        worker = llm.executor.rank0
        gen = torch.Generator().manual_seed(0)
        for kv in worker.kv_caches:
            kv.copy_(torch.randn(kv.shape, generator=gen))
        noise = Noise(seed=1)
        for m in worker.model.modules():
            if isinstance(m, MLAAttention):
                m.register_forward_hook(noise)
        rows_out = []
        for rows in args.rows:
            chunks = [SeqChunk(i, [7 + i], 20 + 3 * i, [2 * i, 2 * i + 1]) for i in range(rows)]
            with torch.inference_mode():
                base = worker._eager_forward(chunks, worker.kv_caches)
                for scale in args.noise:
                    for t in range(args.tries):
                        noise.scale = scale
                        out = worker._eager_forward(chunks, worker.kv_caches)
                        noise.scale = 0.0
                        row = dict(routing=routing, rows=rows, noise=scale, try_=t, whole=round(rel(out, base).item(), 4),
                                   per_row=[round(x, 4) for x in rel(out, base, dim=-1).tolist()])
                        print(json.dumps(row), flush=True)
                        rows_out.append(row)
        return rows_out
    finally:
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--noise", type=float, nargs="+", default=[3e-3, 1e-2])
    p.add_argument("--tries", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    results = measure("sparse", {}, args) + measure("dense", DENSE_ROUTING, args)
    worst = {r: max(max(x["per_row"]) for x in results if x["routing"] == r) for r in ("sparse", "dense")}
    print(json.dumps(dict(largest_row_error=worst, sparse_over_dense=round(worst["sparse"] / worst["dense"], 2))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(tries=results, largest_row_error=worst), f, indent=1)


if __name__ == "__main__":
    main()
