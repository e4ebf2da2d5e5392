"""What Triton makes of the MLA decode kernel for the H200, without a GPU: for each launch shape,
the shared memory, how many KV tiles the software pipeline keeps in flight, registers, spills,
and so how many programs fit on one SM. Compiled for sm_90 from the kernel's source, with the
16-byte divisibility the JIT infers at a real launch (without it Triton pipelines nothing).

    pip install triton==3.6.0      # any machine: the compiler and ptxas need no GPU
    python bench/triton_ir.py [--block-n 16 32] [--warps 4 8] [--stages 2 3 4 5] [--write-kv] [--prefetch]

Why it exists (bench/RESULTS.md, 2026-12-04): `num_stages` barely moved the kernel in sweeps
because the block-table load took the pipeline's first stages and the KV tile got one buffer
at 3-4 stages; the engine's variant (it writes the new token) held 255 registers a thread.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import triton
    from triton.backends.compiler import GPUTarget
except ImportError:
    sys.exit("bench/triton_ir.py needs Triton (pip install triton==3.6.0); no GPU is needed")

from service.model import mla_decode  # noqa: E402

REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64
POINTERS = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "ctx_ptr": "*i64",
            "o_ptr": "*fp32", "lse_ptr": "*fp32", "new_ptr": "*bf16", "new_slot_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32"}
UNSPECIALIZED = ("stride_bt", "scale")  # do_not_specialize, and a float


def compile_split(block_n: int, warps: int, stages: int, write_kv: int, prefetch: bool, maxnreg: int | None = None):
    """write_kv: the kernel's WRITE_KV (0: none, 1: the new row attended after the loop, 2: written first)."""
    fn = mla_decode._mla_decode_split
    names = fn.arg_names
    consts = dict(BLOCK_SIZE=16, D_LAT=512, D_PE=64, BLOCK_H=mla_decode.BLOCK_H, BLOCK_N=block_n, NUM_SPLITS=1,
                  WRITE_KV=write_kv, IEEE=False, PDL=True, PREFETCH_BT=prefetch, ROPE=0)
    sig = {n: "constexpr" if n in consts else "fp32" if n == "scale" else POINTERS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and n not in UNSPECIALIZED}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs,
                                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg})


def registers(ptx: str) -> tuple[int, int]:
    """(registers a thread, spilled bytes) from ptxas -v, Triton's own ptxas."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", err).group(1))
    spill = re.search(r"(\d+) bytes spill stores", err)
    return regs, int(spill.group(1)) if spill else 0


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    warp_regs = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
    return min(REGS_PER_SM // (warp_regs * warps), SMEM_PER_SM // (smem + 1024), WARPS_PER_SM // warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 5])
    ap.add_argument("--write-kv", action="store_true", help="the engine's variant: writes the new token")
    ap.add_argument("--prefetch", action="store_true", help="also PREFETCH_BT (next tile's block table a step ahead)")
    ap.add_argument("--maxnreg", type=int, help="cap registers a thread (ptx .maxnreg)")
    args = ap.parse_args()
    for bn, warps, stages, pf in itertools.product(args.block_n, args.warps, args.stages,
                                                  (False, True) if args.prefetch else (False,)):
        k = compile_split(bn, warps, stages, int(args.write_kv), pf, args.maxnreg)
        ttgir = k.asm["ttgir"]
        kv = re.search(r"memdesc<(\d+)x\d+x512x", ttgir)
        regs, spill = registers(k.asm["ptx"])
        smem = k.metadata.shared
        print(f"BLOCK_N {bn:3d} warps {warps} stages {stages} prefetch {pf!s:5}: shared {smem / 1024:6.1f} KB, "
              f"KV buffers {kv.group(1) if kv else 0}, {regs} registers, {spill} B spilled, "
              f"{programs_per_sm(regs, smem, warps)} programs an SM", flush=True)


if __name__ == "__main__":
    main()
