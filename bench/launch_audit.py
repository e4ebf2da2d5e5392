"""Every Triton launch of a decode step, as the H200 would get it, without a GPU: grid, registers,
spills, shared memory, and so how many programs an SM holds and how full the first wave is.

The model runs on this CPU under Triton's interpreter with every kernel launch recorded and not
executed (decode shapes do not depend on kernel outputs), in fp16 (the interpreter's dots take
no bf16; pointers are compiled as bf16). Each distinct launch is then compiled for sm_90 with
Triton's own ptxas, specialised as the JIT would (16-divisible pointers and ints, ints equal to
1 as constants). What it finds is what a profile cannot show without a run: a launch of 32
programs on 132 SMs (the FP8 W8A16 tiles at 8 rows, 2026-12-05), or a kernel that spills.

    pip install triton==3.6.0        # no GPU needed
    PYTHONPATH=<triton site> python bench/launch_audit.py [--preset small] [--layers 2]
        [--batches 1,8,64,256] [--context 1024] [--quantization fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys

if "--compile" not in sys.argv:  # the recording process; the compiling one imports the real kernels
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime import interpreter
except ImportError:
    sys.exit("bench/launch_audit.py needs Triton (pip install triton==3.6.0); no GPU is needed")
import torch  # noqa: E402

from bench.triton_ir import registers  # noqa: E402
from service import LLM  # noqa: E402
from service.engine.plan import SeqChunk, StepPlan  # noqa: E402

SMS, REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 132, 65536, 233472, 64, 32  # H200 (sm_90)
DTYPES = {torch.float16: "bf16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}
LAUNCHES: list[dict] = []  # this step's launches, as `_spec` writes them


def _record(self, *args, grid, warmup, **kwargs):
    """InterpretedFunction.run, recording the launch instead of running it."""
    if warmup:
        return None
    names = self.arg_names
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    g = grid(values) if callable(grid) else grid
    g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
    no_specialize = set(self.kwargs.get("do_not_specialize", ()) or ())
    LAUNCHES.append(_spec({"fn": self.fn, "values": values, "options": options, "grid": g,
                           "no_specialize": {names[i] if isinstance(i, int) else i for i in no_specialize}}))
    return None


def _spec(rec: dict) -> dict:
    """A recorded launch as plain data: the kernel by module and name, its signature as the JIT
    would specialise it, constexprs, options and grid."""
    fn, values = rec["fn"], rec["values"]
    params = list(inspect.signature(fn).parameters.values())
    constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
    sig, consts, divisible = {}, {}, []
    for p in params:
        v = values.get(p.name, None if p.default is inspect.Parameter.empty else p.default)
        if p.name in constexprs or isinstance(v, bool) or v is None:
            consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                divisible.append(p.name)
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif isinstance(v, int):
            if v == 1 and p.name not in rec["no_specialize"]:
                consts[p.name] = 1
            else:
                sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
                if v % 16 == 0 and p.name not in rec["no_specialize"]:
                    divisible.append(p.name)
        else:
            raise TypeError(f"{fn.__name__}.{p.name}: {type(v).__name__}")
    if "PDL" in consts:
        consts["PDL"] = True  # the H200's launch (model/pdl.py)
    opts = rec["options"]
    return {"module": fn.__module__, "kernel": fn.__name__, "names": [p.name for p in params], "sig": sig,
            "consts": consts, "divisible": divisible, "warps": opts.get("num_warps", 4),
            "stages": opts.get("num_stages", 3), "maxnreg": opts.get("maxnreg"), "grid": rec["grid"]}


def compile_specs(specs: list[dict]) -> list[dict]:
    """In a process without the interpreter: each distinct launch compiled for sm_90."""
    import importlib

    cache, out = {}, []
    for sp in specs:
        key = json.dumps({k: sp[k] for k in ("module", "kernel", "sig", "consts", "divisible", "warps", "stages", "maxnreg")},
                         sort_keys=True, default=str)
        if key not in cache:
            fn = getattr(importlib.import_module(sp["module"]), sp["kernel"])
            names = sp["names"]
            sig = {n: ("constexpr" if n in sp["consts"] else sp["sig"][n]) for n in names}
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sp["divisible"]}
            src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in sp["consts"].items()}, attrs=attrs)
            try:
                c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": sp["warps"], "num_stages": sp["stages"],
                                            "maxnreg": sp["maxnreg"], "launch_pdl": bool(sp["consts"].get("PDL"))})
                regs, spill = registers(c.asm["ptx"])
                cache[key] = {"regs": regs, "spill": spill, "smem": c.metadata.shared}
            except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
                root = e  # Triton's CompilationError quotes the source; the reason is its cause
                while root.__cause__ is not None:
                    root = root.__cause__
                where = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
                cache[key] = {"error": f"{type(e).__name__} at {where}: {type(root).__name__}: {str(root)[:300]}"}
        row = {**cache[key], "kernel": sp["kernel"], "grid": sp["grid"], "warps": sp["warps"]}
        row["programs"] = math.prod(sp["grid"])
        if "regs" in row:
            per_sm = min(WARPS_PER_SM // sp["warps"], BLOCKS_PER_SM, REGS_PER_SM // max(1, row["regs"] * 32 * sp["warps"]),
                         SMEM_PER_SM // max(1, row["smem"]))
            row["per_sm"] = per_sm
            row["first_wave"] = round(min(1.0, row["programs"] / (per_sm * SMS)), 3)  # resident slots filled
        out.append(row)
    return out


def decode_chunks(batch: int, context: int, block_size: int) -> list[SeqChunk]:
    per = -(-(context + 1) // block_size)
    return [SeqChunk(i, [5 + i], context, list(range(i * per, (i + 1) * per)), state_slot=i) for i in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=2, help="num_hidden_layers (the first is dense)")
    ap.add_argument("--overrides", default="{}", help="JSON hf_overrides on top (e.g. K3_SMALL's layer kinds)")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--quantization")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    per = -(-(args.context + 1) // 16)
    overrides = {"num_hidden_layers": args.layers, **json.loads(args.overrides)}
    kw = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM(model=args.preset, hf_overrides=overrides, dtype="float16", device="cpu", distributed_executor_backend="uni",
              enforce_eager=True, max_num_seqs=max(batches), num_kv_blocks=max(batches) * per + 16,
              max_model_len=args.context + 64, max_num_batched_tokens=max(256, max(batches)), **kw)
    worker = llm.executor.rank0
    interpreter.InterpretedFunction.run = _record  # from here on, launches are recorded, not run
    recorded = {}
    for batch in batches:
        LAUNCHES.clear()
        with torch.inference_mode():
            worker.execute(StepPlan(decode_chunks(batch, args.context, 16)))
        recorded[batch] = list(LAUNCHES)
    llm.shutdown()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile"], input=json.dumps(recorded),
                         capture_output=True, text=True, env=env, check=True)
    report = {int(b): rows for b, rows in json.loads(res.stdout.strip().splitlines()[-1]).items()}
    for batch, rows in report.items():
        print(f"\nbatch {batch}: {len(rows)} Triton launches, {args.layers} layers (torch and cuBLAS ops not listed)")
        print(f"  {'kernel':26s} {'grid':>14s} {'progs':>6s} {'warps':>5s} {'regs':>4s} {'spill':>5s} "
              f"{'smem KB':>7s} {'/SM':>3s} {'wave':>5s}")
        for r in rows:
            if "error" in r:
                print(f"  {r['kernel']:26s} {str(tuple(r['grid'])):>14s} compile failed: {r['error']}")
                continue
            flag = "  <- fewer programs than SMs" if r["programs"] < SMS else ""
            flag += "  <- spills" if r["spill"] else ""
            print(f"  {r['kernel']:26s} {str(tuple(r['grid'])):>14s} {r['programs']:6d} {r['warps']:5d} {r['regs']:4d} "
                  f"{r['spill']:5d} {r['smem'] / 1024:7.1f} {r['per_sm']:3d} {r['first_wave']:5.2f}{flag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "sms": SMS, "report": report}, f, indent=1)


def compile_main() -> None:
    recorded = json.loads(sys.stdin.read())
    print(json.dumps({b: compile_specs(specs) for b, specs in recorded.items()}))


if __name__ == "__main__":
    compile_main() if "--compile" in sys.argv else main()
