"""Scheduler and block manager on their own: budgets, limits, chunking, preemption, block accounting.

End-to-end equivalences (batching, preemption, chunking give the same tokens) are in
test_llm_engine.py, against a paged stand-in model.
"""

from __future__ import annotations

import pytest

from service.engine.block_manager import BlockManager
from service.engine.scheduler import Scheduler
from service.engine.sequence import Sequence, SequenceStatus
from service.sampling_params import SamplingParams

_ids = iter(range(10**6))


def seq(n_prompt: int, n_out: int = 0) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_token_ids=list(range(1, n_prompt + 1)),
                    params=SamplingParams(), output_token_ids=[7] * n_out)


def sched(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)


def run_step(s: Scheduler, token: int = 9):
    batch = s.schedule()
    s.postprocess(batch, [token] * len(batch.sampled_seqs))
    return batch


def test_block_manager_accounting():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq(5), seq(3)
    assert bm.can_allocate(a, 5) and bm.blocks_for(5) == 2
    bm.allocate(a, 5)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 2
    a.num_computed_tokens = 5
    assert not bm.try_append(a, 12) and len(a.block_table) == 2  # 17 tokens need 5 blocks: nothing taken
    assert bm.try_append(a, 3) and len(a.block_table) == 2  # positions 5..7 still fit block 2
    bm.allocate(b, 3)
    a.num_computed_tokens = 8
    assert bm.try_append(a, 1) and len(a.block_table) == 3
    assert bm.num_free_blocks == 0 and bm.try_append(a, 4) and not bm.try_append(a, 5)
    assert not bm.can_allocate(seq(1), 1) and len(a.block_table) == 3
    assert len(set(a.block_table) | set(b.block_table)) == 4
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(a, 1)
    bm.free(b)
    assert b.block_table == [] and bm.num_free_blocks == 1
    stolen = seq(1)
    stolen.block_table = [a.block_table[0]]
    with pytest.raises(RuntimeError, match="does not own"):
        bm.free(stolen)
    bm.free(a)
    assert bm.num_free_blocks == 4


def test_prefill_then_decode_plans_and_block_tables():
    s = sched()
    a = seq(6)
    s.add(a)
    b1 = run_step(s)
    (c,) = b1.plan.chunks
    assert c.token_ids == a.prompt_token_ids and c.start_pos == 0 and c.needs_logits
    assert len(c.block_table) == 2 and a.output_token_ids == [9] and a.num_computed_tokens == 6
    b2 = run_step(s)
    (c,) = b2.plan.chunks
    assert c.token_ids == [9] and c.start_pos == 6 and c.block_table == a.block_table
    for _ in range(2):  # position 8 starts a third block
        run_step(s)
    assert len(a.block_table) == 3 and a.num_computed_tokens == 9


def test_decodes_first_then_prefills_within_the_budget():
    s = sched(max_num_batched_tokens=10, num_blocks=32)
    d1, d2 = seq(3), seq(3)
    s.add(d1)
    s.add(d2)
    run_step(s)  # both prefilled (6 tokens)
    big = seq(20)
    s.add(big)
    b = s.schedule()
    assert [c.seq_id for c in b.plan.chunks] == [d1.seq_id, d2.seq_id, big.seq_id]
    assert [len(c.token_ids) for c in b.plan.chunks] == [1, 1, 8]
    assert b.plan.num_tokens == 10 and b.plan.chunks[2].needs_logits is False
    assert b.sampled_seqs == [d1, d2]
    s.postprocess(b, [9, 9])
    # Next step: the decodes still go first, then the rest of the prefill continues.
    b = s.schedule()
    assert [c.seq_id for c in b.plan.chunks] == [d1.seq_id, d2.seq_id, big.seq_id]
    assert b.plan.chunks[2].start_pos == 8 and len(b.plan.chunks[2].token_ids) == 8
    s.postprocess(b, [9, 9])
    b = s.schedule()
    last = b.plan.chunks[2]
    assert last.start_pos == 16 and len(last.token_ids) == 4 and last.needs_logits


def test_max_num_seqs_and_fcfs_admission():
    s = sched(max_num_seqs=2, num_blocks=32)
    seqs = [seq(2) for _ in range(4)]
    for q in seqs:
        s.add(q)
    b = run_step(s)
    assert [c.seq_id for c in b.plan.chunks] == [seqs[0].seq_id, seqs[1].seq_id]
    assert list(s.waiting) == seqs[2:]
    s.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    b = run_step(s)
    assert [c.seq_id for c in b.plan.chunks] == [seqs[1].seq_id, seqs[2].seq_id]


def test_admission_waits_for_free_blocks_in_order():
    s = sched(num_blocks=4, block_size=4, max_model_len=16)
    a, big, small = seq(12), seq(8), seq(1)
    for q in (a, big, small):
        s.add(q)
    b = run_step(s)
    # `big` does not fit in the one free block; `small` would, but does not jump the queue.
    assert [c.seq_id for c in b.plan.chunks] == [a.seq_id]
    assert list(s.waiting) == [big, small]


def test_preemption_by_recompute():
    s = sched(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    old, new = seq(7), seq(8)
    s.add(old)
    s.add(new)
    run_step(s)  # old: 8 tokens in 2 blocks; new: 9 tokens, 8 computed, 2 blocks: cache full
    assert s.block_manager.num_free_blocks == 0
    b = s.schedule()  # old decodes at position 7 (fits), new needs a third block -> preempted
    assert [c.seq_id for c in b.plan.chunks] == [old.seq_id]
    assert b.preempted == [new] and s.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert s.waiting[0] is new and new.output_token_ids == [9]  # its output is kept, KV is not
    s.postprocess(b, [9])
    b = s.schedule()  # old grows to a third block; new (9 tokens = 3 blocks) cannot come back yet
    assert [c.seq_id for c in b.plan.chunks] == [old.seq_id] and not b.preempted
    s.postprocess(b, [9])
    s.finish(old, SequenceStatus.FINISHED_LENGTH)
    b = s.schedule()
    (c,) = b.plan.chunks
    assert c.seq_id == new.seq_id and c.start_pos == 0 and c.token_ids == new.token_ids and c.needs_logits


def test_the_oldest_sequence_takes_blocks_from_the_newest():
    s = sched(num_blocks=2, block_size=4, max_num_batched_tokens=64, max_model_len=9)
    a, b_ = seq(4), seq(4)
    s.add(a)
    s.add(b_)
    s.postprocess(s.schedule(), [9, 9])  # one block each, none free; both now need a second one
    b = s.schedule()
    assert [c.seq_id for c in b.plan.chunks] == [a.seq_id] and b.preempted == [b_]
    assert len(a.block_table) == 2 and list(s.waiting) == [b_] and s.running == [a]


def test_preempt_all_keeps_admission_order():
    s = sched(num_blocks=16)
    seqs = [seq(3) for _ in range(3)]
    for q in seqs:
        s.add(q)
    run_step(s)
    assert s.preempt_all() == 3
    assert list(s.waiting) == seqs and s.block_manager.num_free_blocks == 16 and not s.running
    b = s.schedule()
    assert [c.seq_id for c in b.plan.chunks] == [q.seq_id for q in seqs]
    assert all(c.start_pos == 0 and len(c.token_ids) == 4 for c in b.plan.chunks)


def test_kv_cache_smaller_than_max_model_len_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        sched(num_blocks=2, block_size=4, max_model_len=64)


def test_postprocess_checks_row_count():
    s = sched()
    s.add(seq(3))
    b = s.schedule()
    with pytest.raises(ValueError, match="logits rows"):
        s.postprocess(b, [])


def test_schedule_ahead_is_the_next_schedule_with_placeholders():
    """While a decode step runs, the next one: the same chunks schedule() gives once the step's
    tokens land (placeholders filled), without the sequence whose length ends, and blocks in place."""
    s = sched(max_model_len=10)
    a, b, c = seq(3), seq(4), seq(8)  # c reaches max_model_len with the running step's token
    for x in (a, b, c):
        s.add(x)
    run_step(s)  # the prefills: one token each
    flight = s.schedule()  # decodes at positions 3, 4, 8
    ahead = s.schedule_ahead(flight)
    assert [x.seq_id for x in ahead.seqs] == [a.seq_id, b.seq_id]
    assert [(ch.token_ids, ch.start_pos) for ch in ahead.plan.chunks] == [([-1], 4), ([-1], 5)]
    assert all(len(x.block_table) * 4 >= ch.start_pos + 1 for x, ch in zip(ahead.seqs, ahead.plan.chunks))
    s.postprocess(flight, [11, 12, 13])
    s.finish(c, SequenceStatus.FINISHED_LENGTH)
    filled = s.fill_ahead(ahead)
    assert [ch.token_ids for ch in filled.plan.chunks] == [[11], [12]]
    again = s.schedule()  # what it stands in for: the same chunks, no block moved
    assert [(ch.seq_id, ch.token_ids, ch.start_pos, ch.block_table) for ch in again.plan.chunks] == \
        [(ch.seq_id, ch.token_ids, ch.start_pos, ch.block_table) for ch in filled.plan.chunks]


def test_schedule_ahead_gives_way_to_admission_and_prefills():
    s = sched(max_num_seqs=4)
    a = seq(3)
    s.add(a)
    flight = s.schedule()
    assert s.schedule_ahead(flight) is None  # a prefill in flight
    s.postprocess(flight, [9])
    flight = s.schedule()
    assert s.schedule_ahead(flight) is not None
    s.add(seq(2))
    assert s.schedule_ahead(flight) is None  # a waiting request could be admitted
    tight = sched(num_blocks=3, block_size=4, max_num_seqs=2, max_model_len=12)
    x, y = seq(4), seq(3)
    tight.add(x)
    tight.add(y)
    run_step(tight)  # one block each
    flight = tight.schedule()  # x at position 4 takes the last free block; y stays in its first
    assert tight.block_manager.num_free_blocks == 0
    assert tight.schedule_ahead(flight) is None  # y at 4 would need one more: schedule() preempts
