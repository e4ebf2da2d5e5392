"""A decoder layer's dense weights into L2 while its first kernels run (sm_90's bulk prefetch).

At 1-8 rows a decode step is a chain of small dependent kernels, and each starts by waiting on
HBM for its weights: the four GEMVs of a `small` layer move their 26 MB at ~0.4 of the copy
bandwidth (run 74's no-PDL profile), the MoE entry and absorb kernels likewise, while HBM idles
through the latency-bound attention between them. A layer's weights are known before it runs
and never written by a step, so when layer i starts a kernel on a side stream issues one
`cp.async.bulk.prefetch.L2` per 16 KB of them (fire and forget: its programs exit at once) and
the layer's kernels then find them in L2. What it leaves out: the routed experts (3-D, chosen
only by the router) and tensors under 64 KB.

At many rows the layer streams its KV cache (75-300 MB at 64-256 rows) through L2 first, which
would evict what was prefetched, so it only runs up to LATENTSERVE_L2_PREFETCH rows (0, the
default: off; the bench's `l2_prefetch` baselines set it). LATENTSERVE_L2_PREFETCH_EVICT_LAST=1
marks the lines evict-last, so the layer's own streams evict them last.

The side stream forks from the step's stream at the layer's start and joins it at the step's
end, in a CUDA graph as in an eager step. Addresses are read once: parameters keep theirs across
sleep and weight updates (DESIGN §2), as the captured graphs already require.
"""

from __future__ import annotations

import os

import torch

from ..log import get_logger

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

log = get_logger("l2_prefetch")
CHUNK = 16 << 10  # bytes a prefetch instruction asks for
MIN_BYTES = 64 << 10  # smaller tensors (norm weights, biases) are not worth a request
BLOCK = 32  # chunks a program issues: one warp, one instruction a thread


def max_rows() -> int:
    return int(os.environ.get("LATENTSERVE_L2_PREFETCH", "0"))


def layer_weights(layer: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of one layer worth prefetching: 1- and 2-D parameters and buffers of 64 KB or
    more. Stacked routed experts are 3-D (their scales too) and left out."""
    seen, out = set(), []
    for t in [*layer.parameters(), *layer.buffers()]:
        if t.dim() > 2 or t.numel() * t.element_size() < MIN_BYTES or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out.append(t)
    return out


def chunks(tensors: list[torch.Tensor], chunk: int = CHUNK) -> tuple[list[int], list[int]]:
    """(addresses, sizes) covering each tensor's bytes in pieces of at most `chunk`, 16-byte
    aligned as the instruction needs: a tensor's ragged ends (under 16 bytes each) are left out,
    so no request reaches outside it. Padded to a multiple of BLOCK with the first piece again."""
    addrs, sizes = [], []
    for t in tensors:
        start = -(-t.data_ptr() // 16) * 16
        end = (t.data_ptr() + t.numel() * t.element_size()) // 16 * 16
        for a in range(start, end, chunk):
            addrs.append(a)
            sizes.append(min(chunk, end - a))
    while addrs and len(addrs) % BLOCK:
        addrs.append(addrs[0])
        sizes.append(sizes[0])
    return addrs, sizes


def supported(device: torch.device) -> bool:
    if triton is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


class LayerPrefetch:
    """`issue(i, layer, h)` before layer i of a step (h: its input rows), `join()` after the last."""

    def __init__(self, rows: int, evict_last: bool):
        self.rows, self.evict_last = rows, evict_last
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.side: torch.cuda.Stream | None = None
        self.forked = False

    @classmethod
    def from_env(cls) -> LayerPrefetch | None:
        rows = max_rows()
        if rows <= 0:
            return None
        return cls(rows, os.environ.get("LATENTSERVE_L2_PREFETCH_EVICT_LAST", "0") == "1")

    def _table(self, i: int, layer: torch.nn.Module, device: torch.device):
        if i not in self.tables:
            if torch.cuda.is_current_stream_capturing():
                return None  # a host-to-device copy cannot be captured; warm-ups build the tables
            addrs, sizes = chunks(layer_weights(layer))
            self.tables[i] = (torch.tensor(addrs, dtype=torch.int64, device=device),
                              torch.tensor(sizes, dtype=torch.int32, device=device))
            if i == 0:
                log.info("l2_prefetch_table", layer=0, mib=round(sum(sizes) / 2**20, 1), requests=len(sizes),
                         rows=self.rows, evict_last=self.evict_last)
        return self.tables[i]

    def issue(self, i: int, layer: torch.nn.Module, h: torch.Tensor) -> None:
        if h.shape[0] > self.rows or not supported(h.device):
            return
        table = self._table(i, layer, h.device)
        if table is None or table[0].numel() == 0:
            return
        main = torch.cuda.current_stream(h.device)
        if self.side is None:
            self.side = torch.cuda.Stream(h.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            addrs, sizes = table
            _prefetch_kernel[(addrs.numel() // BLOCK,)](addrs, sizes, EVICT_LAST=self.evict_last, BLOCK=BLOCK,
                                                         num_warps=1)
        self.forked = True

    def join(self) -> None:
        if self.forked:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.forked = False


if triton is not None:

    @triton.jit
    def _prefetch_kernel(addr_ptr, size_ptr, EVICT_LAST: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        addr = tl.load(addr_ptr + i)
        size = tl.load(size_ptr + i)
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
                "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;\nmov.u32 $0, 0;\n}",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;",
                                      "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
