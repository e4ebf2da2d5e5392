"""The decode CUDA graphs' host side, on CPU: the packed input buffer (token, position, KV slot,
context, KDA state row, block tables), padding rows in the scratch KV block and state row, and
the engine never handing that scratch out (the GPU replays are in tests/gpu/test_k3_graphs_cuda.py).
Also the KDA decode step under dynamo (CPU, no Inductor): one graph for every batch size, its
state writes as the opaque mutating op, equal to the eager step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service import LLM, SamplingParams
from service.config import PRESETS
from service.engine.plan import SeqChunk
from service.model import cuda_graph, decode_inputs
from service.model.decode_inputs import CONTEXT, FIELDS, IDS, POSITIONS, SLOTS, STATE

BS, WIDTH, MAX = 4, 5, 4
SCRATCH = (40, 7)  # (KV block, KDA state row)


def unpack(buf: np.ndarray):
    return buf[: FIELDS * MAX].reshape(FIELDS, MAX), buf[FIELDS * MAX:].reshape(MAX, WIDTH)


def test_pack_decode_writes_state_rows_and_pads_on_the_scratch():
    chunks = [SeqChunk(0, [11], 5, [3, 9], state_slot=2), SeqChunk(1, [12], 0, [4], state_slot=0),
              SeqChunk(2, [13], 12, [1, 2, 6, 8], state_slot=5)]
    buf = np.full(decode_inputs.buffer_len(MAX, WIDTH), -1, dtype=np.int64)
    decode_inputs.pack_decode(chunks, 4, MAX, WIDTH, BS, buf, SCRATCH)
    fields, tables = unpack(buf)
    assert fields[IDS].tolist() == [11, 12, 13, 0]
    assert fields[POSITIONS].tolist() == [5, 0, 12, 0]
    assert fields[SLOTS].tolist() == [9 * BS + 1, 4 * BS, 8 * BS, SCRATCH[0] * BS]
    assert fields[CONTEXT].tolist() == [6, 1, 13, 1]
    assert fields[STATE].tolist() == [2, 0, 5, SCRATCH[1]]
    assert tables[0, :2].tolist() == [3, 9] and tables[1, 0] == 4 and tables[2, :4].tolist() == [1, 2, 6, 8]
    assert tables[3, 0] == SCRATCH[0]
    # No padding: the scratch is not touched, and a smaller step leaves rows past it alone.
    buf2 = buf.copy()
    decode_inputs.pack_decode(chunks[:2], 2, MAX, WIDTH, BS, buf2, SCRATCH)
    f2, _ = unpack(buf2)
    assert f2[STATE].tolist() == [2, 0, 5, SCRATCH[1]] and f2[IDS, :2].tolist() == [11, 12]


def test_inputs_prepared_ahead_equal_a_fresh_pack_once_their_ids_are_in():
    """A step packed ahead with placeholder ids, then its ids filled in place: `pack` writes only
    the ids and the buffer equals a fresh pack; any other chunk list (a row dropped, a probe in
    between) is packed whole."""
    waits = []
    buf = np.full(decode_inputs.buffer_len(MAX, WIDTH), -1, dtype=np.int64)
    host = decode_inputs.DecodeInputs(buf, [1, 2, 4], WIDTH, BS, SCRATCH, before_write=lambda: waits.append(1))
    ahead = [SeqChunk(0, [-1], 5, [3, 9], state_slot=2), SeqChunk(1, [-1], 0, [4], state_slot=0),
             SeqChunk(2, [-1], 12, [1, 2, 6, 8], state_slot=5)]
    assert host.prepare(ahead) and len(waits) == 1
    for c, t in zip(ahead, (11, 12, 13)):
        c.token_ids[0] = t
    assert host.pack(ahead) == 4 and host.prepared_packs == 1 and len(waits) == 1
    want = np.full_like(buf, -1)
    decode_inputs.pack_decode(ahead, 4, MAX, WIDTH, BS, want, SCRATCH)
    assert np.array_equal(buf, want)
    # Prepared once only: the same list again is packed whole (nothing says only ids changed).
    assert host.prepare(ahead)
    kept = ahead[:2]  # a row retired while the step before ran
    assert host.pack(kept) == 2 and host.prepared_packs == 1
    decode_inputs.pack_decode(kept, 2, MAX, WIDTH, BS, want, SCRATCH)
    assert np.array_equal(buf, want)
    assert host.pack(ahead) == 4 and host.prepared_packs == 1
    # Not graphable (a prefill chunk): nothing prepared, and pack says so.
    prefill = [SeqChunk(3, [1, 2], 0, [5])]
    assert not host.prepare(prefill) and host.pack(prefill) is None


def covered(buf: np.ndarray, chunks: list[SeqChunk], batch: int) -> tuple:
    """What a graph replay of `batch` rows reads: every field of those rows, each row's table up to
    its context's last block (the padding rows' first entry)."""
    fields, tables = unpack(buf)
    blocks = [c.start_pos // BS + 1 for c in chunks] + [1] * (batch - len(chunks))
    return fields[:, :batch].tolist(), [tables[i, :k].tolist() for i, k in enumerate(blocks)]


def test_rows_rewrite_only_what_changed_and_equal_a_fresh_pack():
    """Random decode steps through DecodeInputs (row tables kept between steps, steps prepared
    ahead) against a fresh pack of each: sequences join, retire, grow into new blocks, are
    preempted into new blocks behind an eager step, or have a table replaced outright."""
    import random

    rng = random.Random(0)
    free = list(range(1, 200))
    rng.shuffle(free)
    seqs: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (position, table)
    next_id = iter(range(10_000))

    def join():
        pos = rng.randrange(0, 3 * BS)
        seqs[next(next_id)] = (pos, [free.pop() for _ in range(pos // BS + 1)])

    buf = np.full(decode_inputs.buffer_len(MAX, WIDTH), -1, dtype=np.int64)
    host = decode_inputs.DecodeInputs(buf, [1, 2, 4], WIDTH, BS, SCRATCH)
    join()
    incremental = 0
    for step in range(400):
        r = rng.random()
        if r < 0.08 and len(seqs) < MAX:
            join()
        elif r < 0.14 and len(seqs) > 1:
            sid = rng.choice(list(seqs))
            free.extend(seqs.pop(sid)[1])
        elif r < 0.18:  # preempted: recomputed by an eager (prefill) step in new blocks, but
            # for its last, which the allocator happened to give back (no table check can tell)
            sid = rng.choice(list(seqs))
            pos, table = seqs[sid]
            seqs[sid] = (pos, [free.pop() for _ in table[:-1]] + table[-1:])
            free.extend(table[:-1])
            assert host.pack([SeqChunk(sid, [1, 2], 0, seqs[sid][1])]) is None
        elif r < 0.2:  # a table replaced with no eager step between: its last block gives it away
            sid = rng.choice(list(seqs))
            pos, table = seqs[sid]
            seqs[sid] = (pos, [free.pop() for _ in table])
            free.extend(table)
        for sid, (pos, table) in list(seqs.items()):  # the next position; a new block when it needs one
            if pos + 1 >= WIDTH * BS:
                free.extend(seqs.pop(sid)[1])
                continue
            if (pos + 1) // BS + 1 > len(table):
                table = table + [free.pop()]
            seqs[sid] = (pos + 1, table)
        if not seqs:
            join()
        chunks = [SeqChunk(sid, [rng.randrange(1000)], pos, list(table), True, sid % 7)
                  for sid, (pos, table) in seqs.items()]
        if rng.random() < 0.5:
            ids = [c.token_ids[0] for c in chunks]
            for c in chunks:
                c.token_ids[0] = -1
            assert host.prepare(chunks)
            for c, t in zip(chunks, ids):
                c.token_ids[0] = t
        before = host.rows.written[:]
        b = host.pack(chunks)
        incremental += host.rows.written == before
        want = np.full_like(buf, -1)
        decode_inputs.pack_decode(chunks, b, MAX, WIDTH, BS, want, SCRATCH)
        assert covered(buf, chunks, b) == covered(want, chunks, b), f"step {step}"
    assert incremental > 100  # most steps wrote no block at all


def test_capture_inputs_are_all_scratch():
    buf = np.zeros(decode_inputs.buffer_len(MAX, WIDTH), dtype=np.int64)
    decode_inputs.fill_scratch(buf, 0, MAX, MAX, WIDTH, BS, SCRATCH)
    fields, tables = unpack(buf)
    assert set(fields[SLOTS].tolist()) == {SCRATCH[0] * BS} and set(fields[STATE].tolist()) == {SCRATCH[1]}
    assert set(fields[POSITIONS].tolist()) == {0} and set(fields[CONTEXT].tolist()) == {1}
    assert set(tables[:, 0].tolist()) == {SCRATCH[0]}


def test_engine_never_hands_out_the_scratch_block_or_row():
    """k3-tiny on CPU with few blocks and sequences (slots reused, preemption): every chunk's
    blocks and state row stay below the scratch ones, which the caches hold."""
    with LLM("k3-tiny", dtype="float32", distributed_executor_backend="uni", max_num_seqs=2, num_kv_blocks=14,
             block_size=4, max_model_len=56) as llm:
        worker = llm.executor.rank0
        block, row = cuda_graph.scratch_indices(worker.config)
        assert cuda_graph.scratch_reason(worker.kv_caches, (block, row)) is None
        assert cuda_graph.scratch_reason(worker.kv_caches, (block + 1, row)) is not None
        seen_blocks, seen_rows = set(), set()
        execute = worker.execute

        def spy(plan, **kw):
            for c in plan.chunks:
                seen_blocks.update(c.block_table)
                seen_rows.add(c.state_slot)
            return execute(plan, **kw)

        worker.execute = spy
        prompts = [[(7 * i + j) % 1000 + 4 for j in range(3 + 5 * i)] for i in range(6)]
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        stats = worker.engine_stats()
    assert seen_rows == {0, 1} and row == 2
    assert max(seen_blocks) < block == 14 and len(seen_blocks) > 8
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("fresh", [False, True])
def test_kda_decode_traces_once_for_every_batch_and_matches_eager(fresh):
    """The decode step of a KDA layer under dynamo with dynamic shapes (aot_eager: functionalized
    like Inductor's input, no compiler needed): no recompile across batch sizes 2..5, state rows
    written through the custom op, results equal to the eager layer's."""
    import dataclasses

    import torch._dynamo

    from service.model.attn_metadata import AttnMetadata
    from service.model.kda import KDAState, KimiDeltaAttention, kda_state_shapes
    from service.parallel import TPGroup

    cfg = PRESETS["k3-tiny"]
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, TPGroup.single(), 0, torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    rows = 8
    base = KDAState(**{k: torch.randn((rows, *shape), dtype=dt or torch.float32)
                       for k, (shape, dt) in kda_state_shapes(cfg, 1).items()})
    torch._dynamo.reset()
    counts = {"frames": 0}
    first = 0

    def backend(gm, inputs):
        counts["frames"] += 1
        assert any("kda_write_rows" in str(n.target) for n in gm.graph.nodes), "state writes not through the op"
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    compiled = torch.compile(lambda x, meta, state: layer(x, meta, state), backend=backend, dynamic=True)
    for b in (2, 3, 4, 5):
        slots = list(range(b))[::-1]
        positions = [0 if fresh and i == 0 else 3 + i for i in range(b)]
        meta = AttnMetadata.build([SeqChunk(i, [1], p, [], state_slot=s) for i, (p, s) in enumerate(zip(positions, slots))],
                                  16, "cpu")
        meta = dataclasses.replace(meta, query_lens=[1] * b)
        x = torch.randn(b, cfg.hidden_size)
        ours = KDAState(base.conv.clone(), base.recurrent.clone())
        ref = KDAState(base.conv.clone(), base.recurrent.clone())
        with torch.inference_mode():
            out = compiled(x, meta, ours)
            want = layer(x, meta, ref)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.recurrent, ref.recurrent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.conv, ref.conv, rtol=1e-5, atol=1e-5)
        assert not torch.equal(ours.recurrent[slots], base.recurrent[slots]), "the state rows were not written"
        if b == 2:
            first = counts["frames"]
    # (dynamo may restart its analysis once within the first call; no batch size adds a graph)
    assert counts["frames"] == first, f"{counts['frames'] - first} more graphs for batch sizes 3..5: a guard pins the batch"


def test_kda_write_rows_op_passes_opcheck():
    dst = torch.randn(6, 3, 2)
    torch.library.opcheck(torch.ops.latentserve.kda_write_rows, (dst, torch.tensor([4, 1]), torch.randn(2, 3, 2)))
