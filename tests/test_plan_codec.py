"""Step plans on the plan channel as block-table deltas (`PlanCodec`): what a follower decodes is
the plan rank 0 encoded, step after step, while the messages carry only the blocks each table
gained; a sequence that was away or starts again at position 0 is sent whole; a follower that
missed a message refuses the next one rather than running on wrong tables."""

from __future__ import annotations

import pytest

from service.engine.plan import PlanCodec, SeqChunk, StepPlan, decode_message, encode_message


def plan(*chunks: tuple[int, int, list[int]]) -> StepPlan:
    return StepPlan([SeqChunk(sid, [100 + sid], pos, list(table), True, sid) for sid, pos, table in chunks])


def same(a: StepPlan, b: StepPlan) -> bool:
    key = [(c.seq_id, c.token_ids, c.start_pos, c.block_table, c.needs_logits, c.state_slot) for c in a.chunks]
    return key == [(c.seq_id, c.token_ids, c.start_pos, c.block_table, c.needs_logits, c.state_slot)
                   for c in b.chunks]


def roundtrip(enc: PlanCodec, dec: PlanCodec, p: StepPlan) -> int:
    msg = enc.encode(p)
    kind, got = dec.decode(msg)
    assert kind == "step" and same(got, p)
    return msg.size


def test_decode_steps_carry_only_new_blocks():
    enc, dec = PlanCodec(), PlanCodec()
    tables = {1: list(range(10, 40)), 2: list(range(50, 60))}
    first = roundtrip(enc, dec, plan((1, 470, tables[1]), (2, 150, tables[2])))
    assert first == encode_message("step", plan((1, 470, tables[1]), (2, 150, tables[2]))).size
    steady = roundtrip(enc, dec, plan((1, 471, tables[1]), (2, 151, tables[2])))
    assert steady == 2 + 2 * (7 + 1)  # no block gained: heads and tokens only
    tables[2].append(77)  # seq 2 crosses into a new block
    assert roundtrip(enc, dec, plan((1, 472, tables[1]), (2, 160, tables[2]))) == steady + 1


def test_tables_sent_whole_when_the_follower_cannot_hold_them():
    enc, dec = PlanCodec(), PlanCodec()
    roundtrip(enc, dec, plan((1, 40, [1, 2, 3]), (2, 40, [4, 5, 6])))
    roundtrip(enc, dec, plan((1, 41, [1, 2, 3])))  # seq 2 waits this step (a mixed step's budget)
    # Seq 2 again: whole. Seq 1 preempted and recomputed from 0 in other blocks: whole as well.
    full = roundtrip(enc, dec, plan((1, 0, [9, 8]), (2, 41, [4, 5, 6])))
    assert full == 2 + 2 * 7 + 2 + 2 + 3
    # A table whose kept part changed (not just grown) is sent whole too.
    assert roundtrip(enc, dec, plan((1, 5, [9, 7, 6]), (2, 42, [4, 5, 6]))) == 2 + 2 * 7 + 2 + 3


def test_a_follower_that_missed_a_step_refuses_the_next_until_both_reset():
    enc, dec, late = PlanCodec(), PlanCodec(), PlanCodec()
    roundtrip(enc, dec, plan((1, 40, [1, 2, 3])))
    msg = enc.encode(plan((1, 41, [1, 2, 3])))
    with pytest.raises(ValueError, match="seq 1 keeps 3 blocks"):
        late.decode(msg)  # it never saw the step before
    enc.reset()
    late.reset()
    roundtrip(enc, late, plan((1, 42, [1, 2, 3])))


def test_probe_and_stop_need_no_state():
    assert decode_message(encode_message("probe", [5, 6])) == ("probe", [5, 6])
    assert PlanCodec().decode(encode_message("stop")) == ("stop", None)
    with pytest.raises(ValueError):
        encode_message("nope")
