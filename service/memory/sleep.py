"""Sleep levels, what each level does to each chunk class, and the sleep/wake report.

DESIGN §2: level 2 discards only chunks that hold nothing but (non-preserved) parameters;
every other weights chunk is backed up and restored at the same address, so non-parameter
state (the fused tail's flags and peer table, rope tables, ...) survives any sleep.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

# Tags a sleep releases; "comm" (exchange buffers mapped by peers) is never released.
RELEASABLE_TAGS = ("weights", "kv_cache")
TAGS = ("weights", "kv_cache", "comm")

# Chunk classes (a weights chunk's class depends on what it holds, see `chunk_class`).
PARAMETER = "parameter"
STATE = "state"
KV_CACHE = "kv_cache"
COMM = "comm"
CHUNK_CLASSES = (PARAMETER, STATE, KV_CACHE, COMM)

# Kinds of tensor inside a chunk.
KIND_PARAMETER = "parameter"
KIND_PRESERVED = "preserved"
KIND_STATE = "state"


class SleepLevel(enum.IntEnum):
    OFFLOAD = 1  # back up all weights to host, release; wake restores everything
    DISCARD = 2  # parameter-only chunks are dropped without backup; the rest as level 1

    @classmethod
    def parse(cls, level) -> SleepLevel:
        try:
            return cls(int(level))
        except (TypeError, ValueError):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}") from None


class Action(enum.Enum):
    KEEP = "keep"
    RELEASE = "release"  # contents are lost
    BACKUP_RELEASE = "backup_release"  # contents come back at the same address on wake


def chunk_class(tag: str, kinds: Iterable[str]) -> str:
    """A weights chunk is "parameter" only when everything in it is a non-preserved parameter."""
    if tag != "weights":
        return tag
    kinds = set(kinds)
    return PARAMETER if kinds and kinds <= {KIND_PARAMETER} else STATE


def chunk_action(klass: str, level: SleepLevel) -> Action:
    if klass == COMM:
        return Action.KEEP
    if klass == KV_CACHE:
        return Action.RELEASE
    if klass == PARAMETER and level == SleepLevel.DISCARD:
        return Action.RELEASE
    return Action.BACKUP_RELEASE


BYTE_FIELDS = ("bytes_released", "bytes_backed_up", "bytes_discarded", "bytes_mapped",
               "bytes_restored", "bytes_poisoned", "bytes_kept")


def new_report(op: str, level: int | None, tags: list[str]) -> dict:
    report = {"op": op, "level": level, "tags": list(tags)}
    report.update({f: 0 for f in BYTE_FIELDS})
    report.update({"parameter_bytes": 0, "chunks": {}, "noop": None, "seconds": 0.0})
    return report


def count_chunk(report: dict, klass: str, tag: str, mixed: bool) -> None:
    chunks = report["chunks"]
    chunks[klass] = chunks.get(klass, 0) + 1
    chunks[f"tag:{tag}"] = chunks.get(f"tag:{tag}", 0) + 1
    if mixed:
        chunks["mixed"] = chunks.get("mixed", 0) + 1


def merge_reports(reports: list[dict]) -> dict:
    """One report for several ranks: bytes, chunks and memory add up; seconds is the slowest rank."""
    if not reports:
        raise ValueError("no reports to merge")
    merged = dict(reports[0])
    merged["chunks"] = {}
    merged["ranks"] = [r.get("rank") for r in reports]
    sums = (*BYTE_FIELDS, "parameter_bytes", "free_memory_before", "free_memory_after",
            "rss_before", "rss_after")
    for field in sums:
        merged[field] = sum(r.get(field) or 0 for r in reports)
    merged["seconds"] = max(r.get("seconds") or 0.0 for r in reports)
    for r in reports:
        for k, v in r.get("chunks", {}).items():
            merged["chunks"][k] = merged["chunks"].get(k, 0) + v
    noops = {r.get("noop") for r in reports}
    merged["noop"] = noops.pop() if len(noops) == 1 else "mixed: " + ", ".join(sorted(map(str, noops)))
    merged.pop("rank", None)
    return merged
