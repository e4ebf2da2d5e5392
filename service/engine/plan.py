"""Step plans: what rank 0 broadcasts to every rank each engine step.

A plan is plain data (lists of ints). It travels as one int64 array (`encode_message`), not a
pickle: a few microseconds to build and read, and the same bytes over shared memory or gloo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SeqChunk:
    seq_id: int
    token_ids: list[int]  # tokens whose KV is computed this step (a prefill chunk, or 1 decode token)
    start_pos: int  # position of token_ids[0]; the context after this step is start_pos + len(token_ids)
    block_table: list[int]  # KV blocks of the whole sequence, in order
    needs_logits: bool = True  # False for a prefill chunk that does not reach the prompt's end
    # Row of the linear-attention (KDA) state cache this sequence owns while it runs; a chunk with
    # start_pos 0 starts from a zero state, a later one continues from what the row holds.
    state_slot: int = 0


@dataclass
class StepPlan:
    chunks: list[SeqChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


# Messages on the plan channel: [kind, ...]. A step is [STEP, n_chunks, then per chunk seq_id,
# start_pos, needs_logits, state_slot, n_tokens, n_blocks, tokens..., blocks...]; a probe is
# [PROBE, tokens...]; stop is [STOP].
STEP, PROBE, STOP = 0, 1, 2
_CHUNK_HEAD = 6


def encode_message(kind: str, payload=None) -> np.ndarray:
    if kind == "stop":
        return np.array([STOP], dtype=np.int64)
    if kind == "probe":
        return np.array([PROBE, *payload], dtype=np.int64)
    if kind != "step":
        raise ValueError(f"unknown plan message {kind!r}")
    out = [STEP, len(payload.chunks)]
    for c in payload.chunks:
        out += [c.seq_id, c.start_pos, int(c.needs_logits), c.state_slot, len(c.token_ids), len(c.block_table)]
        out += c.token_ids
        out += c.block_table
    return np.array(out, dtype=np.int64)


def decode_message(data: np.ndarray) -> tuple[str, object]:
    values = data.tolist()
    kind = values[0]
    if kind == STOP:
        return "stop", None
    if kind == PROBE:
        return "probe", values[1:]
    if kind != STEP:
        raise ValueError(f"unknown plan message kind {kind}")
    chunks, i = [], 2
    for _ in range(values[1]):
        seq_id, start, logits, slot, n_tok, n_blk = values[i:i + _CHUNK_HEAD]
        i += _CHUNK_HEAD
        tokens = values[i:i + n_tok]
        blocks = values[i + n_tok:i + n_tok + n_blk]
        i += n_tok + n_blk
        chunks.append(SeqChunk(seq_id, tokens, start, blocks, bool(logits), slot))
    return "step", StepPlan(chunks)
