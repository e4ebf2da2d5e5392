"""The rank's memory pool: every long-lived tensor lives in a tagged chunk that can sleep.

Tensors are carved from chunks (page-aligned mmaps on CPU, 2 MiB-granular cuMem mappings on
CUDA). A chunk's class follows from its tag and contents (`sleep.chunk_class`) and decides what
a sleep level does to it (`sleep.chunk_action`). Release keeps every address, so a woken pool
hands out the same data_ptrs it did before. DESIGN §2 is the spec.
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field

import torch

from . import sleep as rules
from .cpu import CpuBackend, rss_bytes

ALIGN = 256  # every tensor starts on a 256-byte boundary: any dtype view, coalesced loads

LAYOUTS = ("segregated", "interleaved")


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(eq=False)
class Entry:
    name: str
    kind: str  # sleep.KIND_PARAMETER / KIND_PRESERVED / KIND_STATE, or the tag for kv_cache / comm
    chunk: Chunk
    offset: int
    nbytes: int
    tensor: torch.Tensor | None = None


@dataclass(eq=False)
class Chunk:
    index: int
    tag: str
    region: object
    capacity: int
    used: int = 0
    entries: list[Entry] = field(default_factory=list)
    asleep: bool = False
    discarded: bool = False  # released without backup and not reloaded since
    backup: object = None

    @property
    def klass(self) -> str:
        return rules.chunk_class(self.tag, (e.kind for e in self.entries))

    @property
    def mixed(self) -> bool:
        kinds = {e.kind for e in self.entries}
        return self.tag == "weights" and rules.KIND_PARAMETER in kinds and len(kinds) > 1

    @property
    def mapped(self) -> int:
        return self.region.mapped


def _make_backend(device: torch.device):
    if device.type == "cpu":
        return CpuBackend()
    if device.type == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(device)
    raise ValueError(f"memory pool: unsupported device {device}")


class MemoryPool:
    def __init__(self, device: torch.device | str = "cpu", *, layout: str = "segregated",
                 poison: bool = False, chunk_bytes: int = 64 << 20):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.device = torch.device(device)
        self.layout = layout
        self.poison = poison
        self.backend = _make_backend(self.device)
        self.granularity = self.backend.granularity
        self.chunk_bytes = _round_up(max(chunk_bytes, 1), self.granularity)
        self.chunks: list[Chunk] = []
        self._open: dict[tuple[str, str], Chunk] = {}  # (tag, group) -> chunk still taking tensors
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, Entry] = {}  # tied parameters' other names
        self._registered_comm: dict[str, int] = {}
        self._asleep: dict[str, int] = {}  # tag -> level it sleeps at
        self._weights_valid = True

    # ---- placement -------------------------------------------------------------------------

    def _group(self, tag: str, kind: str) -> str:
        if tag != "weights" or self.layout == "interleaved":
            return tag
        return "parameter" if kind == rules.KIND_PARAMETER else "state"

    def _new_chunk(self, tag: str, nbytes: int) -> Chunk:
        # Comm chunks hold one buffer each, exported to peers as one allocation.
        capacity = _round_up(max(nbytes, 1), self.granularity)
        if tag != "comm":
            capacity = max(capacity, self.chunk_bytes)
        region = self.backend.reserve(capacity, shareable=(tag == "comm"))
        chunk = Chunk(len(self.chunks), tag, region, capacity)
        self.chunks.append(chunk)
        return chunk

    def _place(self, name: str, tag: str, kind: str, nbytes: int) -> Entry:
        if name in self._entries or name in self._aliases:
            raise ValueError(f"memory pool: name {name!r} is already allocated")
        if tag in self._asleep:
            raise RuntimeError(f"memory pool: cannot allocate {name!r}: tag {tag!r} is asleep")
        key = (tag, self._group(tag, kind))
        chunk = self._open.get(key)
        offset = _round_up(chunk.used, ALIGN) if chunk else 0
        if chunk is None or tag == "comm" or offset + nbytes > chunk.capacity:
            chunk = self._new_chunk(tag, nbytes)
            offset = 0
            if nbytes < chunk.capacity and tag != "comm":  # an oversized tensor keeps its chunk alone
                self._open[key] = chunk
        entry = Entry(name, kind, chunk, offset, nbytes)
        chunk.entries.append(entry)
        chunk.used = offset + nbytes
        self._entries[name] = entry
        return entry

    def _commit(self, entries: list[Entry], shapes_dtypes: list[tuple]) -> None:
        """Back every touched chunk with memory, then create the entries' tensors."""
        for chunk in {id(e.chunk): e.chunk for e in entries}.values():
            self.backend.commit(chunk.region, _round_up(max(chunk.used, 1), self.granularity))
        for entry, (shape, dtype) in zip(entries, shapes_dtypes):
            raw = self.backend.view(entry.chunk.region, entry.offset, entry.nbytes)
            entry.tensor = raw.view(dtype).view(shape)

    # ---- allocation API --------------------------------------------------------------------

    def materialize(self, model: torch.nn.Module, preserve: list[str] = ()) -> None:
        """Replace every parameter and buffer of a meta-built model by pool memory.

        Values of tensors that are not on meta are copied in; meta ones are left for the loader.
        """
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        preserved: set[int] = set()
        unmatched = []
        for glob in preserve:
            hits = {pid for pid, names in aliases.items() if any(fnmatch.fnmatchcase(n, glob) for n in names)}
            if not hits:
                unmatched.append(glob)
            preserved |= hits
        if unmatched:
            raise ValueError(f"sleep_preserve_parameter_names: {unmatched} match no parameter of the model")
        buffer_names: dict[int, str] = {}
        for name, b in model.named_buffers(remove_duplicate=False):
            buffer_names.setdefault(id(b), name)

        # Creation order = module order, parameters then buffers: what "interleaved" packs by.
        plan: list[tuple[torch.Tensor, Entry, bool]] = []  # (source, entry, is_parameter)
        done: dict[int, Entry] = {}
        for module in model.modules():
            for slots, is_param in ((module._parameters, True), (module._buffers, False)):
                for t in slots.values():
                    if t is None or id(t) in done:
                        continue
                    if is_param:
                        names = aliases[id(t)]
                        kind = rules.KIND_PRESERVED if id(t) in preserved else rules.KIND_PARAMETER
                        name = names[0]
                    else:
                        kind, name, names = rules.KIND_STATE, buffer_names[id(t)], []
                    entry = self._place(name, "weights", kind, t.numel() * t.element_size())
                    for alias in names[1:]:
                        self._aliases[alias] = entry
                    done[id(t)] = entry
                    plan.append((t, entry, is_param))
        self._commit([e for _, e, _ in plan], [(t.shape, t.dtype) for t, _, _ in plan])

        new: dict[int, torch.Tensor] = {}
        for src, entry, is_param in plan:
            if src.device.type != "meta":
                entry.tensor.copy_(src.detach())
            new[id(src)] = torch.nn.Parameter(entry.tensor, requires_grad=False) if is_param else entry.tensor
            if is_param:
                entry.tensor = new[id(src)]
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for key, t in slots.items():
                    if t is not None and id(t) in new:
                        slots[key] = new[id(t)]

    def state(self, name: str, shape, dtype, fill=None) -> torch.Tensor:
        """Named non-parameter state in a weights state chunk (kept by every sleep level).

        Starts as zeros unless `fill` is given; asking again for a name returns the same tensor.
        """
        shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
        entry = self._entries.get(name)
        if entry is not None:
            if entry.kind != rules.KIND_STATE or entry.tensor.shape != shape or entry.tensor.dtype != dtype:
                raise ValueError(f"state {name!r} exists as {entry.kind} {tuple(entry.tensor.shape)} "
                                 f"{entry.tensor.dtype}, asked {tuple(shape)} {dtype}")
            return entry.tensor
        entry = self._place(name, "weights", rules.KIND_STATE, shape.numel() * dtype.itemsize)
        self._commit([entry], [(shape, dtype)])
        entry.tensor.fill_(0 if fill is None else fill)
        return entry.tensor

    def allocate(self, tag: str, name: str, shape, dtype) -> torch.Tensor:
        """Uninitialised memory under tag "kv_cache" (released by sleep) or "comm" (never released)."""
        if tag not in ("kv_cache", "comm"):
            raise ValueError(f"allocate: tag must be 'kv_cache' or 'comm', got {tag!r}")
        shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
        entry = self._place(name, tag, tag, shape.numel() * dtype.itemsize)
        self._commit([entry], [(shape, dtype)])
        return entry.tensor

    def register_comm(self, name: str, nbytes: int) -> None:
        """Exchange buffers owned elsewhere (e.g. POSIX shm): never released, reported as kept."""
        self._registered_comm[name] = int(nbytes)

    def export_fd(self, name: str) -> int:
        """A new file descriptor for a comm buffer's allocation (the buffer starts at offset 0)."""
        entry = self._entries[name]
        if entry.chunk.tag != "comm":
            raise ValueError(f"{name!r} is not a comm buffer")
        return self.backend.export_fd(entry.chunk.region)

    def map_peer_fd(self, fd: int, nbytes: int) -> torch.Tensor:
        """Map a peer's comm buffer (from its `export_fd`, passed over a socket) as a uint8 tensor."""
        return self.backend.import_fd(fd, nbytes)

    # ---- sleep and wake --------------------------------------------------------------------

    @property
    def asleep_tags(self) -> set[str]:
        return set(self._asleep)

    @property
    def weights_valid(self) -> bool:
        return self._weights_valid

    def mark_weights_loaded(self) -> None:
        if "weights" in self._asleep:
            raise RuntimeError("cannot mark weights loaded while the weights are asleep")
        for chunk in self.chunks:
            if chunk.tag == "weights":
                chunk.discarded = False
        self._weights_valid = True

    def parameter_chunks_intact(self) -> bool:
        return not any(c.discarded for c in self.chunks if c.tag == "weights")

    def _parameter_bytes(self) -> int:
        kinds = (rules.KIND_PARAMETER, rules.KIND_PRESERVED)
        return sum(e.nbytes for e in self._entries.values() if e.kind in kinds)

    def _start(self, op: str, level, tags: list[str]) -> dict:
        report = rules.new_report(op, level, tags)
        report["parameter_bytes"] = self._parameter_bytes()
        report["free_memory_before"] = self.backend.free_memory()
        report["rss_before"] = rss_bytes()
        report["_t0"] = time.perf_counter()
        return report

    def _finish(self, report: dict, touched: list[Chunk]) -> dict:
        touched_ids = {id(c) for c in touched}
        report["bytes_kept"] = sum(c.mapped for c in self.chunks if not c.asleep and id(c) not in touched_ids)
        report["bytes_kept"] += sum(self._registered_comm.values())
        report["free_memory_after"] = self.backend.free_memory()
        report["rss_after"] = rss_bytes()
        report["seconds"] = time.perf_counter() - report.pop("_t0")
        return report

    def sleep(self, level: int) -> dict:
        level = rules.SleepLevel.parse(level)
        tags = [t for t in rules.RELEASABLE_TAGS if t not in self._asleep]
        report = self._start("sleep", int(level), tags)
        if not tags:
            report["noop"] = "already asleep"
            return self._finish(report, [])
        chunks = [c for c in self.chunks if c.tag in tags]
        actions = {id(c): rules.chunk_action(c.klass, level) for c in chunks}
        self.backend.synchronize()  # kernels still writing into the pool finish before copies
        for c in chunks:
            rules.count_chunk(report, c.klass, c.tag, c.mixed)
            if actions[id(c)] is rules.Action.BACKUP_RELEASE:
                c.backup = self.backend.backup(c.region, _round_up(c.used, ALIGN))
                report["bytes_backed_up"] += c.backup.numel()
        self.backend.synchronize()  # backups land before the memory goes
        for c in chunks:
            self.backend.release(c.region)
            c.asleep = True
            report["bytes_released"] += c.mapped
            if actions[id(c)] is rules.Action.RELEASE:
                c.discarded = True
                report["bytes_discarded"] += c.mapped
                if c.tag == "weights":
                    self._weights_valid = False
        for t in tags:
            self._asleep[t] = int(level)
        return self._finish(report, chunks)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        if tags is None:
            tags = [t for t in rules.RELEASABLE_TAGS if t in self._asleep]
            requested = tags or list(rules.RELEASABLE_TAGS)
        else:
            requested = [tags] if isinstance(tags, str) else list(tags)
            for t in requested:
                if t not in rules.TAGS:
                    raise ValueError(f"wake_up: unknown tag {t!r} (known: {rules.TAGS})")
            tags = [t for t in requested if t in self._asleep]
        level = max((self._asleep[t] for t in tags), default=None)
        report = self._start("wake_up", level, tags)
        report["already_awake"] = [t for t in requested if t not in tags]
        if not tags:
            report["noop"] = "already awake"
            return self._finish(report, [])
        chunks = [c for c in self.chunks if c.tag in tags]
        for c in chunks:
            rules.count_chunk(report, c.klass, c.tag, c.mixed)
            self.backend.remap(c.region)
            report["bytes_mapped"] += c.mapped
        for c in chunks:
            if c.backup is not None:
                self.backend.restore(c.region, c.backup)
                report["bytes_restored"] += c.backup.numel()
            elif self.poison and (c.discarded or c.tag == "kv_cache"):
                self.backend.poison(c.region, c.mapped)
                report["bytes_poisoned"] += c.mapped
        self.backend.synchronize()
        for c in chunks:
            c.backup = None
            c.asleep = False
            if c.tag == "kv_cache":
                c.discarded = False  # the engine rebuilds the cache; nothing to reload
        for t in tags:
            del self._asleep[t]
        return self._finish(report, chunks)

    # ---- inspection ------------------------------------------------------------------------

    def data_ptrs(self) -> dict[str, int]:
        ptrs = {name: e.tensor.data_ptr() for name, e in self._entries.items()}
        ptrs.update({name: e.tensor.data_ptr() for name, e in self._aliases.items()})
        return ptrs

    def describe(self) -> dict:
        by_class: dict[str, int] = {}
        chunk_counts: dict[str, int] = {}
        for c in self.chunks:
            by_class[c.klass] = by_class.get(c.klass, 0) + c.mapped
            chunk_counts[c.klass] = chunk_counts.get(c.klass, 0) + 1
        return {
            "device": str(self.device), "layout": self.layout, "poison": self.poison,
            "granularity": self.granularity, "chunk_bytes": self.chunk_bytes,
            "asleep": dict(self._asleep), "weights_valid": self._weights_valid,
            "bytes_by_class": by_class, "chunk_counts": chunk_counts,
            "mixed_chunks": sum(c.mixed for c in self.chunks),
            "parameter_bytes": self._parameter_bytes(),
            "registered_comm": dict(self._registered_comm),
            "chunks": [{"index": c.index, "tag": c.tag, "class": c.klass, "mixed": c.mixed,
                        "address": c.region.address, "capacity": c.capacity, "mapped": c.mapped,
                        "used": c.used, "asleep": c.asleep, "discarded": c.discarded,
                        "tensors": len(c.entries)} for c in self.chunks],
            "state": {e.name: {"data_ptr": e.tensor.data_ptr(), "nbytes": e.nbytes, "chunk": e.chunk.index}
                      for e in self._entries.values() if e.kind == rules.KIND_STATE},
            "comm": {e.name: {"data_ptr": e.tensor.data_ptr(), "nbytes": e.nbytes,
                              "alloc_bytes": e.chunk.mapped}
                     for e in self._entries.values() if e.kind == "comm"},
        }

    def close(self) -> None:
        """Give every chunk's memory back. Tensors from this pool must not be used afterwards."""
        self.backend.synchronize()  # no kernel still reading or writing the memory as it is unmapped
        for c in self.chunks:
            self.backend.close(c.region)
        self.chunks.clear()
        self._open.clear()
        self._entries.clear()
        self._aliases.clear()
