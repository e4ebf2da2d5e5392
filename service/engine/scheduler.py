"""Continuous batching over the paged KV cache, in the style of vLLM V1.

Each step gets a token budget (`max_num_batched_tokens`). Running sequences are served first,
decodes (1 token each) before unfinished prefills, then waiting sequences are admitted in
arrival order while the sequence limit, the budget and the free blocks allow. A prompt larger
than what is left of the budget is prefilled in chunks over several steps; only the chunk that
reaches the end of the known tokens asks for logits.

When a running sequence cannot get a block, the most recently admitted sequence not yet in
this step's plan is preempted by RECOMPUTE: its blocks are freed and it goes back to the front
of the waiting queue, to be prefilled again later over prompt + output so far.

Each running sequence also owns one of `max_num_seqs` state slots: its row of every KDA
layer's recurrent and conv state (a hybrid model's linear attention has one fixed-size state per
sequence, not per token). The slot follows the blocks: taken on admission, given up on
preemption and when the sequence finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .plan import SeqChunk, StepPlan
from .sequence import Sequence, SequenceStatus
from .stop import length_reached

# An Enum member read through its class costs ~0.2 us (this CPU); the loop reads it twice a sequence.
_RUNNING = SequenceStatus.RUNNING


@dataclass
class ScheduledBatch:
    plan: StepPlan
    seqs: list[Sequence]  # aligned with plan.chunks
    preempted: list[Sequence] = field(default_factory=list)
    first_tokens: tuple[float, list[str]] | None = None  # FirstTokenClock's launch mark

    @property
    def is_empty(self) -> bool:
        return not self.plan.chunks

    @property
    def sampled_seqs(self) -> list[Sequence]:
        """Sequences that get a logits row, in row order."""
        return [s for s, c in zip(self.seqs, self.plan.chunks) if c.needs_logits]


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 2:
            raise ValueError("need max_num_seqs >= 1, max_num_batched_tokens >= 1, max_model_len >= 2")
        # The last token of a sequence is never fed back, so max_model_len - 1 KV slots suffice. Less
        # than that and a lone sequence could preempt itself forever.
        capacity = block_manager.num_blocks * block_manager.block_size
        if capacity < max_model_len - 1:
            raise ValueError(f"the KV cache holds {capacity} tokens ({block_manager.num_blocks} blocks of "
                             f"{block_manager.block_size}), less than max_model_len - 1 = {max_model_len - 1}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._free_slots: deque[int] = deque(range(max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is the first victim
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire `seq` (stopped, length, aborted, failed) wherever it is and free its blocks."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt_all(self) -> int:
        """Send every running sequence back to the waiting queue (e.g. the KV cache is about to be
        released by sleep); they are recomputed, in their admission order, once it is back."""
        victims = list(reversed(self.running))
        for seq in victims:
            self._preempt(seq)
        return len(victims)

    # ---- one step -----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chunks: list[SeqChunk] = []
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []

        # Today an unfinished prefill is always the newest running sequence (a chunk is cut only when
        # it empties the budget, which stops admission), so this is admission order; the explicit
        # split keeps decodes first should admission change.
        decodes, prefills = [], []
        for seq in self.running:
            (decodes if seq.num_uncomputed_tokens == 1 else prefills).append(seq)
        block_manager = self.block_manager
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not _RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not block_manager.try_append(seq, num_new):
                victim = self._pick_victim(exclude=scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not _RUNNING:
                continue
            chunks.append(self._chunk(seq, num_new))
            scheduled.append(seq)
            budget -= num_new

        # Admitting right after a preemption would only thrash the cache.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                break  # strict arrival order: a later, smaller request does not jump the queue
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new)
            seq.state_slot = self._free_slots.popleft()  # running < max_num_seqs: one is free
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, num_new))
            scheduled.append(seq)
            budget -= num_new

        return ScheduledBatch(StepPlan(chunks), scheduled, preempted)

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence | None]:
        """Record the step's computed KV and append one sampled token per logits row.

        Returns, in row order, the sequences that got a new token; None for one no longer running
        (retired while an overlapped step ran: its row is dropped). Stopping is the engine's call
        (it needs the detokenized text); it retires sequences through `finish`.
        """
        sampled = batch.sampled_seqs
        if len(sampled) != len(sampled_token_ids):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(sampled)} logits rows")
        for seq, chunk in zip(batch.seqs, batch.plan.chunks):
            if seq.status is _RUNNING:
                seq.num_computed_tokens += len(chunk.token_ids)
        rows: list[Sequence | None] = []
        for seq, token in zip(sampled, sampled_token_ids):
            if seq.status is _RUNNING:
                seq.output_token_ids.append(token)
                rows.append(seq)
            else:
                rows.append(None)
        return rows

    def schedule_ahead(self, flight: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step of every running sequence while `flight` (a step of theirs, one
        token each) still runs: what schedule() will give once its tokens land, if nothing is
        admitted and nothing preempted; else None. Each chunk's token is a placeholder (-1) that
        the engine fills from the landed step; it leaves out the sequences that step's length
        stop retires (None if that is all of them). Appends the blocks now, so the next
        schedule() finds them in place."""
        running = self.running
        if ((self.waiting and len(running) < self.max_num_seqs) or len(running) > self.max_num_batched_tokens
                or len(flight.seqs) != len(running)):
            return None
        blocks = self.block_manager
        picked, need = [], 0
        for seq, c in zip(flight.seqs, flight.plan.chunks):
            pos = c.start_pos + 1  # the flight's token goes here
            if seq.status is not _RUNNING or len(c.token_ids) != 1 or not c.needs_logits or pos != seq.num_tokens:
                return None
            if length_reached(seq, len(seq.output_token_ids) + 1, self.max_model_len):
                continue  # the flight's token ends it
            need += blocks.blocks_missing(seq, pos + 1)
            picked.append(seq)
        if not picked or need > blocks.num_free_blocks:
            return None
        chunks = []
        for seq in picked:
            blocks.try_append(seq, 2)  # the flight's position and this step's
            chunks.append(SeqChunk(seq.seq_id, [-1], seq.num_tokens, seq.block_table.copy(), True, seq.state_slot))
        return ScheduledBatch(StepPlan(chunks), picked)

    @staticmethod
    def fill_ahead(ahead: ScheduledBatch) -> ScheduledBatch | None:
        """`schedule_ahead`'s batch once the step before it landed: each placeholder set to the
        token its sequence got, less the sequences that step retired; None if none is left."""
        seqs, chunks = [], []
        for seq, chunk in zip(ahead.seqs, ahead.plan.chunks):
            if seq.status is _RUNNING and seq.num_computed_tokens == chunk.start_pos:
                chunk.token_ids[0] = seq.output_token_ids[-1]
                seqs.append(seq)
                chunks.append(chunk)
        if len(chunks) == len(ahead.plan.chunks):
            return ahead  # the same chunk list: graph inputs packed ahead for it stay valid
        return ScheduledBatch(StepPlan(chunks), seqs) if chunks else None

    # ---- helpers ------------------------------------------------------------------
    def _chunk(self, seq: Sequence, num_new: int) -> SeqChunk:
        start = seq.num_computed_tokens
        end = start + num_new
        if end > self.max_model_len:
            raise RuntimeError(f"seq {seq.seq_id} would pass max_model_len={self.max_model_len}")
        # Positional: keyword construction of the dataclass was a tenth of a 256-stream schedule.
        return SeqChunk(seq.seq_id, seq.tokens_slice(start, end), start, seq.block_table.copy(),
                        end == seq.num_tokens, seq.state_slot)

    def _pick_victim(self, exclude: list[Sequence]) -> Sequence:
        taken = {id(s) for s in exclude}
        for seq in reversed(self.running):
            if id(seq) not in taken:
                return seq
        raise RuntimeError("no preemptible sequence")  # unreachable: the caller itself is a candidate

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
