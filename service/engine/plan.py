"""Step plans: what rank 0 broadcasts to every rank each engine step.

A plan is plain data (lists of ints) so it pickles small over the CPU process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
