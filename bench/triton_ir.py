"""What Triton makes of the MLA decode kernel for the H200, without a GPU: for each launch shape,
the shared memory, how many KV tiles the software pipeline keeps in flight, registers, spills,
how many programs fit on one SM, and the SASS instructions of one tile (the innermost loop with
tensor-core MMAs, by Triton's own nvdisasm). Compiled for sm_90 from the kernel's source, with the
16-byte divisibility the JIT infers at a real launch (without it Triton pipelines nothing).

    pip install triton==3.6.0      # any machine: the compiler and ptxas need no GPU
    python bench/triton_ir.py [--block-n 16 32] [--warps 4 8] [--stages 2 3 4 5] [--write-kv] [--prefetch]
                              [--tma [--block-size 32]]

--tma compiles mla_decode_tma.py's kernel instead (KV tiles by TMA; blocks of --block-size slots).
--moe-down-early compiles moe_down_early.py's kernel (small's 768-wide shard, bf16) at its two launch
shapes: registers, spills, and how many weight loads the PTX issues before the PDL wait.
2026-12-06, write-kv, 32-token tiles, 4 warps, 3 stages: the cp.async kernel's tile is 932
instructions for 68 MMAs; the TMA kernel's 450 (479 with the split's block ids in registers, 44
bytes spilled a thread where 636 were).

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

from service.model import mla_decode, mla_decode_tma, moe_down_early, moe_entry, moe_select  # noqa: E402

REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 228 * 1024, 64
POINTERS = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "ctx_ptr": "*i64",
            "o_ptr": "*fp32", "lse_ptr": "*fp32", "new_ptr": "*bf16", "new_slot_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32"}
UNSPECIALIZED = ("stride_bt", "scale")  # do_not_specialize, and a float


def _compile(fn, consts: dict, types: dict, warps: int, stages: int, maxnreg: int | None = None):
    """fn compiled for sm_90 as a GPU launch specialises it: constexprs, the pointers' and other
    arguments' types (`types` over POINTERS, i32 otherwise), 16-divisible non-constexpr arguments
    except the unspecialized ones and tensor descriptors."""
    names = fn.arg_names
    types = {**POINTERS, **types}
    sig = {n: "constexpr" if n in consts else "fp32" if n == "scale" else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and n not in UNSPECIALIZED and not sig[n].startswith(("tensordesc", "fp"))}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs,
                                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages, "maxnreg": maxnreg})


def compile_split(block_n: int, warps: int, stages: int, write_kv: int, prefetch: bool, maxnreg: int | None = None):
    """write_kv: the kernel's WRITE_KV (0: none, 1: the new row attended after the loop, 2: written first)."""
    consts = dict(BLOCK_SIZE=16, D_LAT=512, D_PE=64, BLOCK_H=mla_decode.BLOCK_H, BLOCK_N=block_n, NUM_SPLITS=1,
                  WRITE_KV=write_kv, IEEE=False, PDL=True, PREFETCH_BT=prefetch, ROPE=0)
    return _compile(mla_decode._mla_decode_split, consts, {}, warps, stages, maxnreg)


def compile_tma(block_n: int, warps: int, stages: int, write_kv: int, block_size: int):
    consts = dict(BLOCK_SIZE=block_size, D_LAT=512, D_PE=64, BLOCK_H=mla_decode.BLOCK_H, BLOCK_N=block_n,
                  NUM_SPLITS=1, WRITE_KV=write_kv, IEEE=False, PDL=True, ROPE=0, MAX_TILES=8192 // block_n)
    descs = {"lat_desc": f"tensordesc<bf16[{block_n},256]>", "pe_desc": f"tensordesc<bf16[{block_n},64]>"}
    return _compile(mla_decode_tma._mla_decode_tma, consts, descs, warps, stages)


def compile_down_early(block_n: int, warps: int, shard: int = 768):
    k1, k2 = moe_down_early.spans(shard)
    consts = dict(BLOCK_N=block_n, K1=k1, K2=k2, PDL=True)
    types = {"h_ptr": "*bf16", "w2_ptr": "*bf16", "ids_ptr": "*i64", "weights_ptr": "*fp32", "part_ptr": "*fp32"}
    return _compile(moe_down_early._down_early_kernel, consts, types, warps, 1)


def compile_entry(select: bool):
    """moe_entry.py's one-row kernel as small's batch 1 launches it (bf16, the add-norm fold, 4-row
    whole-K programs over K = 2048), with or without the experts chosen in it (small's 64 experts
    in 8 groups, top 4 groups, top 8)."""
    consts = dict(ACT=0, CLIP_UP=False, BLOCK_N=4, BLOCK_K=2048, PDL=True, FP8=False, BN=16, BK=16, SUB=16,
                  FOLD=True, SELECT=select)
    if select:
        consts.update(moe_entry.select_constants(moe_select.meta(64, 8, 4, 8, True, False)))
    bf16 = ("x_ptr", "down_ptr", "shared_ptr", "router_ptr", "latent_ptr", "h_ptr", "down_s_ptr", "shared_s_ptr",
            "add_ptr", "g_ptr", "sum_ptr")
    types = {**dict.fromkeys(bf16, "*bf16"), "logits_ptr": "*fp32", "bias_ptr": "*fp32", "wts_ptr": "*fp32",
             "ids_ptr": "*i64", "count_ptr": "*i32", **dict.fromkeys(("beta", "linear_beta", "eps", "scaling"), "fp32")}
    return _compile(moe_entry._entry_kernel, consts, types, 4, 4)


def loads_before_wait(ptx: str) -> tuple[int, int]:
    """(global loads before the first griddepcontrol.wait, global loads in all) of a kernel's PTX."""
    head, _, _ = ptx.partition("griddepcontrol.wait")
    return head.count("ld.global"), ptx.count("ld.global")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def assemble(ptx: str, disassemble: bool = False) -> tuple[str, str | None]:
    """ptx through Triton's own ptxas for sm_90a: (its -v report, and with disassemble the cubin's
    SASS by Triton's nvdisasm)."""
    with tempfile.TemporaryDirectory() as d:
        path, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", path, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout if disassemble else None
    return report, sass


def tile_loop(sass: str) -> tuple[int, int, int]:
    """(instructions, MMAs, local-memory accesses) of the shortest backward-branch loop holding a
    tile's MMAs: the tile loop, not the mbarrier spin-waits around it."""
    at, label, ins = {}, None, []
    for line in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", line)
        a = re.search(r"/\*([0-9a-f]{4,5})\*/", line)
        if m:
            label = m.group(1)
        elif a:
            ins.append((int(a.group(1), 16), line))
            if label is not None:
                at[label], label = ins[-1][0], None
    best = (0, 0, 0)
    for addr, line in ins:
        m = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", line)
        if m and at.get(m.group(1), addr + 1) < addr:
            body = [x for a, x in ins if at[m.group(1)] <= a <= addr]
            mma = sum("HMMA" in x for x in body)
            if mma and (not best[0] or len(body) < best[0]):
                best = (len(body), mma, sum("LDL" in x or "STL" in x for x in body))
    return best


def usage(report: str) -> tuple[int, int]:
    """(registers a thread, spilled bytes) from a ptxas -v report."""
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = re.search(r"(\d+) bytes spill stores", report)
    return regs, int(spill.group(1)) if spill else 0


def registers(ptx: str) -> tuple[int, int]:
    """(registers a thread, spilled bytes) of ptx, by Triton's own ptxas."""
    return usage(assemble(ptx)[0])


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
    ap.add_argument("--tma", action="store_true", help="mla_decode_tma.py's kernel (KV tiles by TMA)")
    ap.add_argument("--block-size", type=int, default=32, help="--tma: KV cache block size (a multiple of BLOCK_N)")
    ap.add_argument("--moe-down-early", action="store_true", help="moe_down_early.py's kernel instead")
    args = ap.parse_args()
    if args.moe_down_early:
        for bn, warps in ((16, 4), (32, 8)):
            ptx = compile_down_early(bn, warps).asm["ptx"]
            regs, spill = registers(ptx)
            early, total = loads_before_wait(ptx)
            print(f"moe_down_early BLOCK_N {bn} warps {warps}: {regs} registers, {spill} B spilled, "
                  f"{programs_per_sm(regs, 0, warps)} programs an SM; {early} of {total} global loads before the "
                  f"PDL wait", flush=True)
        return
    for bn, warps, stages, pf in itertools.product(args.block_n, args.warps, args.stages,
                                                  (False, True) if args.prefetch else (False,)):
        if args.tma:
            k = compile_tma(bn, warps, stages, int(args.write_kv), args.block_size)
            kv = re.search(r"memdesc<(\d+)x\d+x256x", k.asm["ttgir"])
        else:
            k = compile_split(bn, warps, stages, int(args.write_kv), pf, args.maxnreg)
            kv = re.search(r"memdesc<(\d+)x\d+x512x", k.asm["ttgir"])
        report, sass = assemble(k.asm["ptx"], disassemble=True)
        regs, spill = usage(report)
        n, mma, local = tile_loop(sass)
        smem = k.metadata.shared
        print(f"{'TMA ' if args.tma else ''}BLOCK_N {bn:3d} warps {warps} stages {stages} prefetch {pf!s:5}: "
              f"shared {smem / 1024:6.1f} KB, KV buffers {kv.group(1) if kv else 0}, {regs} registers, {spill} B "
              f"spilled, {programs_per_sm(regs, smem, warps)} programs an SM; a tile {n} instructions ({mma} MMAs, "
              f"{local} local)", flush=True)


if __name__ == "__main__":
    main()
