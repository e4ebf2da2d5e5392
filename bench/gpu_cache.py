"""Triton's and Inductor's compile caches carried from one device lease to the next.

Every lease starts on a bare machine, so each session's first calls compile every Triton kernel
and Inductor graph again: run 69's server took 109 s to get ready cold and 84 s warm in the same
call, and run 71's kernel tests ran out at 300 s on compiles. The caches are keyed by source,
options and target, so a cache from an earlier lease of the same chip serves the next one, and a
stale entry is never used.

    python3 bench/gpu_cache.py dirs                      # the exports gpu_check.sh makes
    python3 bench/gpu_cache.py restore .gpu/cache        # before the work: unpack the parts found
    python3 bench/gpu_cache.py save "$OUT" --max-mib 30  # after it: pack the caches into parts

`save` writes xz-compressed tar parts of at most 15 MiB (the device returns files of up to 16
MiB, 8 files a call), Triton's cache first, and leaves out whole subtrees, largest first, while
the archive is over --max-mib. xz at preset 2 (--preset): run 77's 493 MiB of caches took 162 s
of device time at preset 6 (19.8 MiB); on this CPU preset 6 takes 116 s, 2 takes 16 s for 29.1
MiB, and unpacking either takes ~2 s. Copy the parts that come back into .gpu/cache/, which travels
with `carry [".gpu"]`.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tarfile

ROOT = os.environ.get("LATENTSERVE_GPU_CACHE_ROOT", "/tmp/latentserve_compile_cache")
DIRS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
PART = 15 << 20
PREFIX = "compile_cache.tar.xz.part"


def dirs() -> None:
    for var, sub in DIRS.items():
        print(f"export {var}={os.path.join(ROOT, sub)}")


def restore(src: str) -> int:
    parts = sorted(glob.glob(os.path.join(src, PREFIX + "*")))
    if not parts:
        print(f"[gpu-cache] no cache in {src}: compiling cold", file=sys.stderr)
        return 0
    data = b"".join(open(p, "rb").read() for p in parts)
    os.makedirs(ROOT, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(ROOT, filter="data")
        n = len(tar.getmembers())
    print(f"[gpu-cache] restored {n} entries ({len(data) >> 20} MiB in {len(parts)} parts) into {ROOT}",
          file=sys.stderr)
    return 0


def _subtrees() -> list[tuple[int, str]]:
    """(bytes, path relative to ROOT) of each cache entry directory, largest first."""
    out = []
    for sub in DIRS.values():
        base = os.path.join(ROOT, sub)
        if not os.path.isdir(base):
            continue
        for top in os.listdir(base):
            path = os.path.join(base, top)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            out.append((size, os.path.relpath(path, ROOT)))
    return sorted(out, reverse=True)


def _pack(keep: list[str], preset: int = 2) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=preset) as tar:
        for rel in sorted(keep, key=lambda r: not r.startswith("triton")):
            tar.add(os.path.join(ROOT, rel), arcname=rel)
    return buf.getvalue()


def save(out: str, max_mib: int, preset: int = 2) -> int:
    trees = _subtrees()
    if not trees:
        print(f"[gpu-cache] nothing under {ROOT}", file=sys.stderr)
        return 0
    keep = [rel for _, rel in trees]
    cap = max_mib << 20
    data = _pack(keep, preset)
    alone: dict[str, int] = {}
    while len(data) > cap and keep:
        if not alone:  # over: each entry compressed alone, once, so that a drop need not repack all
            alone = {rel: len(_pack([rel], preset)) for rel in keep}
        # Inductor's entries go first (its kernels are Triton's too, and recompile from there).
        drop = next((r for _, r in trees if r in keep and r.startswith("inductor")), None)
        keep.remove(drop or next(r for _, r in trees if r in keep))
        if keep and sum(alone[r] for r in keep) <= cap:  # may fit now: pack to know
            data = _pack(keep, preset)
    if not keep:
        print(f"[gpu-cache] even one entry is over {max_mib} MiB: nothing saved", file=sys.stderr)
        return 1
    os.makedirs(out, exist_ok=True)
    for i in range(0, len(data), PART):
        with open(os.path.join(out, f"{PREFIX}{i // PART:02d}"), "wb") as f:
            f.write(data[i:i + PART])
    print(f"[gpu-cache] saved {len(keep)} of {len(trees)} entries, {len(data) / 2**20:.1f} MiB in "
          f"{-(-len(data) // PART)} parts", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dirs")
    r = sub.add_parser("restore")
    r.add_argument("src")
    s = sub.add_parser("save")
    s.add_argument("out")
    s.add_argument("--max-mib", type=int, default=30)
    s.add_argument("--preset", type=int, default=2, choices=range(10), help="xz preset (0-9)")
    args = ap.parse_args()
    if args.cmd == "dirs":
        dirs()
        return 0
    return restore(args.src) if args.cmd == "restore" else save(args.out, args.max_mib, args.preset)


if __name__ == "__main__":
    sys.exit(main())
