"""The decode graphs' inputs on the host: one int64 buffer per step, copied to the device at once.

Per row (a sequence) the token id, position, KV slot, context length and KDA state row
([max_batch] each), then the block tables [max_batch, width]. Rows past a step's sequences are
padding: a fresh one-token sequence in the scratch KV block and state row (`fill_scratch`).
`DecodeInputs` keeps what the buffer holds between steps, so steady decoding rewrites only what
changed: a step scheduled ahead is packed before its token ids are known (`prepare`), and a row
that holds the same sequence as in the step before gets only the blocks its table gained.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from ..engine.plan import SeqChunk

IDS, POSITIONS, SLOTS, CONTEXT, STATE = range(5)  # the per-row fields, before the block tables
FIELDS = 5


def buffer_len(max_batch: int, width: int) -> int:
    return FIELDS * max_batch + max_batch * width


def _views(buf: np.ndarray, max_batch: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    return (buf[: FIELDS * max_batch].reshape(FIELDS, max_batch),
            buf[FIELDS * max_batch:].reshape(max_batch, width))


def fill_scratch(buf: np.ndarray, start: int, stop: int, max_batch: int, width: int, block_size: int,
                 scratch: tuple[int, int]) -> None:
    """Rows start..stop-1 of `buf`: token 0 at position 0 of the scratch block, on the scratch state
    row. Position 0 makes each step zero the scratch row first (a fresh sequence) and context 1
    reads only the slot the row itself wrote, so padding rows touch nothing a sequence owns."""
    fields, tables = _views(buf, max_batch, width)
    block, row = scratch
    fields[IDS, start:stop] = 0
    fields[POSITIONS, start:stop] = 0
    fields[SLOTS, start:stop] = block * block_size
    fields[CONTEXT, start:stop] = 1
    fields[STATE, start:stop] = row
    tables[start:stop, 0] = block


def _write_tables(tables: np.ndarray, tabs: list[list[int]], blocks: list[int]) -> None:
    """Every row's first `blocks` entries in one flat write: a list fed to a 2-d fancy index was
    ~60% of the pack at 256 streams of ~70 blocks; np.fromiter into flat offsets takes half."""
    n, width = len(tabs), tables.shape[1]
    counts = np.array(blocks)
    total = int(counts.sum())
    offsets = np.arange(total) + np.repeat(np.arange(n) * width - (np.cumsum(counts) - counts), counts)
    tables.reshape(-1)[offsets] = np.fromiter(
        itertools.chain.from_iterable(t[:k] for t, k in zip(tabs, blocks)), np.int64, total)


class RowTables:
    """Which sequence's table each row of the buffer holds, and how far: a step whose rows hold
    the same sequences as the last packed step writes only the blocks a table gained (at 256
    streams one row in block_size). A table only grows while its sequence decodes; the last block
    written must still be in place, else the row is written whole. `forget` after any write this
    does not see (a step not packed here, the capture)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        self.seq_ids: list[int] = []
        self.written: list[int] = []  # blocks written per row
        self.last: list[int] = []  # the last of them

    def write(self, tables: np.ndarray, chunks: list[SeqChunk], tabs: list[list[int]], blocks: list[int]) -> None:
        seq_ids = [c.seq_id for c in chunks]
        if seq_ids != self.seq_ids:
            _write_tables(tables, tabs, blocks)
            self.seq_ids, self.written = seq_ids, list(blocks)
            self.last = [t[k - 1] for t, k in zip(tabs, blocks)]
            return
        written, last = self.written, self.last
        for i, (t, k, w) in enumerate(zip(tabs, blocks, written)):
            if k == w and t[k - 1] == last[i]:
                continue  # steady: nothing new in this row
            start = w if k > w and len(t) >= w and t[w - 1] == last[i] else 0
            tables[i, start:k] = t[start:k]
            written[i], last[i] = k, t[k - 1]


def pack_decode(chunks: list[SeqChunk], batch: int, max_batch: int, width: int, block_size: int,
                buf: np.ndarray, scratch: tuple[int, int] = (0, 0), rows: RowTables | None = None) -> None:
    """Write a decode step's inputs into `buf` (int64, `buffer_len(max_batch, width)` long).
    Rows len(chunks)..batch-1 are padding (`fill_scratch`). Only the blocks a context covers are
    written; with `rows`, only those its rows do not hold yet."""
    fields, tables = _views(buf, max_batch, width)
    n = len(chunks)
    if n:
        # Column-wise, one numpy write a field (bench/host_step.py: per-element writes were ~3.4 us
        # a sequence, 0.87 ms of a 256-stream step on this CPU).
        pos = [c.start_pos for c in chunks]
        blocks = [p // block_size + 1 for p in pos]
        tabs = [c.block_table for c in chunks]
        fields[IDS, :n] = [c.token_ids[0] for c in chunks]
        fields[POSITIONS, :n] = pos
        fields[SLOTS, :n] = [t[k - 1] * block_size + p % block_size for t, k, p in zip(tabs, blocks, pos)]
        fields[CONTEXT, :n] = pos
        fields[CONTEXT, :n] += 1
        fields[STATE, :n] = [c.state_slot for c in chunks]
        if rows is None:
            _write_tables(tables, tabs, blocks)
        else:
            rows.write(tables, chunks, tabs, blocks)
    if batch > n:
        fill_scratch(buf, n, batch, max_batch, width, block_size, scratch)


def graphable(chunks: list[SeqChunk], max_batch: int, width: int, block_size: int) -> bool:
    """A pure decode step that fits the captured shapes (else the eager path runs, and reports
    any error in the plan itself)."""
    if not chunks or len(chunks) > max_batch:
        return False
    for c in chunks:
        if len(c.token_ids) != 1 or not c.needs_logits:
            return False
        if c.start_pos + 1 > width * block_size or len(c.block_table) * block_size < c.start_pos + 1:
            return False
    return True


class DecodeInputs:
    """The buffer (`buffer_len` long) and what it holds: a step packs it (`pack`), or `prepare`
    packs it ahead, all but the token ids, while the step before still runs (async output).
    `before_write` waits until the last copy has left the buffer."""

    def __init__(self, buf: np.ndarray, sizes: list[int], width: int, block_size: int,
                 scratch: tuple[int, int], before_write: Callable[[], None] = lambda: None):
        self.buf, self.sizes, self.width, self.block_size = buf, sizes, width, block_size
        self.max_batch = sizes[-1]
        self.scratch = scratch
        self.before_write = before_write
        self.rows = RowTables()
        self._prepared: list[SeqChunk] | None = None  # the chunk list the buffer holds but for its ids
        self.prepared_packs = 0

    def batch_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def forget(self) -> None:
        """The buffer was written outside this (the capture): hold nothing."""
        self.rows.forget()
        self._prepared = None

    def prepare(self, chunks: list[SeqChunk]) -> bool:
        """Pack a step whose token ids are not known yet; `pack` of the same list (ids filled in
        place) then writes only the ids. False if the step is not graphable."""
        self._prepared = None
        if not self._write(chunks):
            return False
        self._prepared = chunks
        return True

    def pack(self, chunks: list[SeqChunk]) -> int | None:
        """Pack a step's inputs; returns the graph batch, or None if the step is not graphable.
        Only ids may change between `prepare(chunks)` and this: they are all it writes then."""
        prepared, self._prepared = self._prepared, None
        if chunks is prepared:
            self.buf[IDS * self.max_batch: IDS * self.max_batch + len(chunks)] = [c.token_ids[0] for c in chunks]
            self.prepared_packs += 1
            return self.batch_for(len(chunks))
        return self.batch_for(len(chunks)) if self._write(chunks) else None

    def _write(self, chunks: list[SeqChunk]) -> bool:
        if not graphable(chunks, self.max_batch, self.width, self.block_size):
            # An eager step between two graphed ones may be a preempted sequence's recompute, in
            # new blocks: hold nothing across it.
            self.rows.forget()
            return False
        self.before_write()
        pack_decode(chunks, self.batch_for(len(chunks)), self.max_batch, self.width, self.block_size,
                    self.buf, self.scratch, self.rows)
        return True
