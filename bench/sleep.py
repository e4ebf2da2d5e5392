"""Sleep/wake cost of the memory pool, per level, for a model of configurable size.

    python bench/sleep.py                       # CPU, 0.25 GiB of bf16 parameters
    python bench/sleep.py --device cuda --param-gib 8 --kv-gib 4

Level 1 offload/restore bandwidth is printed next to a plain copy of the same bytes measured in
the same run (CUDA: pinned host <-> device; CPU: memcpy), with the ratio; level-2 weights wake
is printed in ms per GiB mapped. The first cycle of each level pays one-off costs (pinned host
allocation) and is reported apart from the median of the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from service.memory.pool import MemoryPool  # noqa: E402

GIB = 1 << 30


def log(msg: str) -> None:
    print(f"[sleep-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Stack(nn.Module):
    def __init__(self, hidden: int, layers: int, state_elems: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        self.register_buffer("rope", torch.empty(state_elems))


def checksum(model: nn.Module) -> float:
    return float(sum(p.float().sum() for p in model.parameters()))


def reference_copy(nbytes: int, device: torch.device, repeat: int) -> tuple[float, float]:
    """Seconds for out (device->host) and in (host->device) of nbytes, medians."""
    if device.type == "cpu":
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]), statistics.median(times[1:])
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    outs, ins = [], []
    for _ in range(repeat + 1):
        for dst, src, acc in ((host, dev, outs), (dev, host, ins)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            acc.append(start.elapsed_time(end) / 1e3)
    return statistics.median(outs[1:]), statistics.median(ins[1:])


def freed(report: dict, device: torch.device) -> int:
    """Device memory given back (CUDA), or this process's RSS drop (CPU: MemAvailable is shared)."""
    if device.type == "cuda":
        return report["free_memory_after"] - report["free_memory_before"]
    return report["rss_before"] - report["rss_after"]


def summarise(rows: list[dict], key: str) -> dict:
    vals = [r[key] for r in rows]
    return {"first": vals[0], "median": statistics.median(vals[1:] or vals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--param-gib", type=float, default=0.25)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--state-mib", type=float, default=8)
    ap.add_argument("--kv-gib", type=float, default=0.0625)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)

    layer_bytes = args.hidden * args.hidden * 2
    layers = max(1, round(args.param_gib * GIB / layer_bytes))
    log(f"device={device} layers={layers}x[{args.hidden}x{args.hidden}] bf16 "
        f"= {layers * layer_bytes / GIB:.2f} GiB params, state {args.state_mib} MiB, kv {args.kv_gib} GiB")
    pool = MemoryPool(device, chunk_bytes=args.chunk_mib << 20)
    with torch.device("meta"):
        model = Stack(args.hidden, layers, int(args.state_mib * (1 << 20) / 2)).to(torch.bfloat16)
    t0 = time.perf_counter()
    pool.materialize(model)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.normal_()  # random, not zeros: every page written, nothing special-cased
    kv = pool.allocate("kv_cache", "kv", (int(args.kv_gib * GIB) // 2,), torch.bfloat16)
    kv.fill_(1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    log(f"materialised in {time.perf_counter() - t0:.2f}s: {pool.describe()['chunk_counts']}")
    ref_sum = checksum(model)

    lvl1, lvl2 = [], []
    for i in range(args.repeat + 1):
        s, w = pool.sleep(1), pool.wake_up()
        ok = checksum(model) == ref_sum
        lvl1.append({"sleep_s": s["seconds"], "wake_s": w["seconds"], "backed_up": s["bytes_backed_up"],
                     "restored": w["bytes_restored"], "released": s["bytes_released"],
                     "offload_gbps": s["bytes_backed_up"] / s["seconds"] / 1e9,
                     "restore_gbps": w["bytes_restored"] / w["seconds"] / 1e9, "intact": ok})
        log(f"level 1 #{i}: sleep {s['seconds']:.3f}s wake {w['seconds']:.3f}s "
            f"({lvl1[-1]['offload_gbps']:.1f} / {lvl1[-1]['restore_gbps']:.1f} GB/s) values intact={ok}")
    for i in range(args.repeat + 1):
        s = pool.sleep(2)
        ww = pool.wake_up(["weights"])
        wk = pool.wake_up(["kv_cache"])
        gib = ww["bytes_mapped"] / GIB
        lvl2.append({"sleep_s": s["seconds"], "wake_weights_s": ww["seconds"], "wake_kv_s": wk["seconds"],
                     "released": s["bytes_released"], "discarded": s["bytes_discarded"],
                     "backed_up": s["bytes_backed_up"], "freed": freed(s, device),
                     "weights_mapped": ww["bytes_mapped"], "wake_ms_per_gib": ww["seconds"] * 1e3 / gib})
        log(f"level 2 #{i}: sleep {s['seconds']:.3f}s (released {s['bytes_released'] / GIB:.2f} GiB, "
            f"discarded {s['bytes_discarded'] / GIB:.2f}, backed up {s['bytes_backed_up'] / 2**20:.1f} MiB, "
            f"free +{lvl2[-1]['freed'] / GIB:.2f} GiB) wake weights {ww['seconds'] * 1e3:.1f} ms "
            f"({lvl2[-1]['wake_ms_per_gib']:.2f} ms/GiB) wake kv {wk['seconds'] * 1e3:.1f} ms")
        with torch.no_grad():  # what update_weights does: every parameter page written again
            for p in model.parameters():
                p.normal_()
        pool.mark_weights_loaded()

    nbytes = lvl1[0]["backed_up"]
    log(f"reference copy of {nbytes / GIB:.2f} GiB ({'pinned host<->device' if device.type == 'cuda' else 'memcpy'})")
    ref_out, ref_in = reference_copy(nbytes, device, args.repeat)
    ref_out_gbps, ref_in_gbps = nbytes / ref_out / 1e9, nbytes / ref_in / 1e9
    off, res = summarise(lvl1, "offload_gbps"), summarise(lvl1, "restore_gbps")
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "param_bytes": layers * layer_bytes, "chunk_bytes": pool.chunk_bytes, "level1": lvl1, "level2": lvl2,
        "reference_out_gbps": ref_out_gbps, "reference_in_gbps": ref_in_gbps,
        "offload_ratio": off["median"] / ref_out_gbps, "restore_ratio": res["median"] / ref_in_gbps,
    }
    print()
    print(f"{'metric':44s} {'first':>10s} {'median':>10s}")
    for label, rows, key in (("level 1 sleep s", lvl1, "sleep_s"), ("level 1 wake s", lvl1, "wake_s"),
                             ("level 1 offload GB/s", lvl1, "offload_gbps"),
                             ("level 1 restore GB/s", lvl1, "restore_gbps"),
                             ("level 2 sleep s", lvl2, "sleep_s"), ("level 2 wake weights s", lvl2, "wake_weights_s"),
                             ("level 2 wake weights ms/GiB", lvl2, "wake_ms_per_gib"),
                             ("level 2 wake kv_cache s", lvl2, "wake_kv_s")):
        v = summarise(rows, key)
        print(f"{label:44s} {v['first']:10.4f} {v['median']:10.4f}")
    print(f"{'reference copy out / in GB/s':44s} {ref_out_gbps:10.1f} {ref_in_gbps:10.1f}")
    print(f"{'pool / reference (offload, restore)':44s} {result['offload_ratio']:10.2f} {result['restore_ratio']:10.2f}")
    print(f"{'level 2 discarded / released':44s} {lvl2[-1]['discarded'] / lvl2[-1]['released']:10.3f}")
    print(f"{'level 1 values intact every cycle':44s} {all(r['intact'] for r in lvl1)!s:>10s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
