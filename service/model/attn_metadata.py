"""What attention needs to know about one step's batch of chunks (AttnMetadata), built once per
step on the host from the step plan and handed to every layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.plan import SeqChunk


@dataclass
class AttnMetadata:
    """Everything attention needs about one step's batch of chunks, built once per step."""

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor | None  # [T] long; None when the chunks carry no block tables
    query_start_loc: torch.Tensor  # [N+1] long: chunk i owns tokens [qsl[i], qsl[i+1])
    context_lens: torch.Tensor  # [N] long: start_pos + len, the context after this step
    block_tables: torch.Tensor  # [N, max_blocks] long, padded with block 0 (masked out)
    logits_indices: torch.Tensor  # [num chunks needing logits] long: each one's last token
    block_size: int
    # Host-side copies, so per-layer loops never synchronise with the device.
    query_lens: list[int]
    query_starts: list[int]  # N+1 entries
    start_positions: list[int]
    context_lens_list: list[int]
    max_position: int
    # Single-token chunks, run together in the absorbed form.
    decode_token_idx: torch.Tensor  # [B] long, token index of each decode
    decode_block_tables: torch.Tensor  # [B, max decode blocks] long
    # [B, longest decode context] long: cache slot of each context position; positions past a
    # sequence's context repeat its slot 0 (written, so finite), and `decode_bias` masks them.
    decode_slots: torch.Tensor | None
    decode_bias: torch.Tensor | None  # [B, 1, longest decode context] float32: 0 or -inf
    prefill_chunks: list[int]  # chunk indices with more than one token
    # [B] long, each decode's context after this step (the Triton kernel and CUDA graphs read it;
    # None only in metadata built by hand, which must then give decode_slots).
    decode_context_lens: torch.Tensor | None = None
    # Linear-attention (KDA) state rows, one per chunk (see SeqChunk.state_slot).
    state_slots: torch.Tensor | None = None  # [N] long
    state_slots_list: list[int] = dataclasses.field(default_factory=list)
    _prefill_groups: tuple | None = dataclasses.field(default=None, repr=False)

    def prefill_groups(self) -> tuple[list[tuple], list[int], tuple[int, int]]:
        """(groups, others, span) of the prefill chunks, worked out once per step. Chunks that
        start at position 0 (a whole prompt in this step) are grouped by length, each group as
        (length, first token of each chunk, token index [n * length] or None when the chunks lie
        back to back, the same index relative to span[0]); `others` are the rest (a prompt's
        later chunks); span covers every grouped token."""
        if self._prefill_groups is None:
            by_len: dict[int, list[int]] = {}
            others = []
            for i in self.prefill_chunks:
                if self.start_positions[i] == 0:
                    by_len.setdefault(self.query_lens[i], []).append(self.query_starts[i])
                else:
                    others.append(i)
            firsts = [f for fs in by_len.values() for f in fs]
            lo = min(firsts, default=0)
            hi = max((f + n for n, fs in by_len.items() for f in fs), default=0)
            groups = []
            for length, fs in by_len.items():
                idx = rel = None
                if fs != list(range(fs[0], fs[0] + len(fs) * length, length)):
                    tok = (np.array(fs, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)).reshape(-1)
                    idx = torch.from_numpy(tok).to(self.positions.device)
                    rel = torch.from_numpy(tok - lo).to(self.positions.device)
                groups.append((length, fs, idx, rel))
            self._prefill_groups = (groups, others, (lo, hi))
        return self._prefill_groups

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def has_kv_slots(self) -> bool:
        return self.slot_mapping is not None

    @classmethod
    def build(cls, chunks: list[SeqChunk], block_size: int, device: torch.device | str) -> AttnMetadata:
        # Built in numpy and handed to torch without a copy: a decode step of 16 sequences took
        # ~170 us in ~60 small torch ops, now ~60 us.
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        query_lens = [len(c.token_ids) for c in chunks]
        if 0 in query_lens:
            raise ValueError(f"sequence {chunks[query_lens.index(0)].seq_id}: empty chunk")
        starts = [c.start_pos for c in chunks]
        ctx_lens = [s + n for s, n in zip(starts, query_lens)]
        paged = all(len(c.block_table) * block_size >= e for c, e in zip(chunks, ctx_lens))
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        logits_idx = [qsl[i + 1] - 1 for i, c in enumerate(chunks) if c.needs_logits]
        lens = np.array(query_lens, dtype=np.int64)
        chunk_of_token = np.repeat(np.arange(len(chunks)), lens)
        positions = np.arange(qsl[-1], dtype=np.int64) + np.repeat(np.array(starts, dtype=np.int64)
                                                                   - np.array(qsl[:-1], dtype=np.int64), lens)
        # Block tables padded with block 0; without paging (cache-less chunks) zero columns.
        nblocks = [-(-e // block_size) if paged else 0 for e in ctx_lens]
        block_tables = np.zeros((len(chunks), max(nblocks)), dtype=np.int64)
        for i, c in enumerate(chunks):
            block_tables[i, :nblocks[i]] = c.block_table[:nblocks[i]]
        slot_mapping = None
        if paged:
            slot_mapping = (block_tables[chunk_of_token, positions // block_size] * block_size
                            + positions % block_size)

        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        decode_tables = block_tables[decodes, :max((nblocks[i] for i in decodes), default=0)]
        decode_ctx = np.array([ctx_lens[i] for i in decodes], dtype=np.int64)
        decode_slots = decode_bias = None
        if paged and decodes:
            ctx_pos = np.arange(int(decode_ctx.max()), dtype=np.int64)
            inside = ctx_pos[None, :] < decode_ctx[:, None]
            ctx_pos = np.where(inside, ctx_pos[None, :], 0)
            decode_slots = (np.take_along_axis(decode_tables, ctx_pos // block_size, 1) * block_size
                            + ctx_pos % block_size)
            decode_bias = np.where(inside, np.float32(0), np.float32("-inf"))[:, None, :]

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

        def ints(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        return cls(
            positions=dev(positions),
            slot_mapping=dev(slot_mapping) if slot_mapping is not None else None,
            query_start_loc=dev(ints(qsl)),
            context_lens=dev(ints(ctx_lens)),
            block_tables=dev(block_tables),
            logits_indices=dev(ints(logits_idx)),
            block_size=block_size,
            query_lens=query_lens,
            query_starts=qsl,
            start_positions=starts,
            context_lens_list=ctx_lens,
            max_position=max(ctx_lens) - 1,
            decode_token_idx=dev(ints([qsl[i] for i in decodes])),
            decode_block_tables=dev(decode_tables),
            decode_slots=dev(decode_slots) if decode_slots is not None else None,
            decode_bias=dev(decode_bias) if decode_bias is not None else None,
            prefill_chunks=[i for i, n in enumerate(query_lens) if n > 1],
            decode_context_lens=dev(decode_ctx),
            state_slots=dev(ints([c.state_slot for c in chunks])),
            state_slots_list=[c.state_slot for c in chunks],
        )
