"""LLMEngine end to end with a real scheduler, block manager, sampler and tokenizer.

The model is a small deterministic stand-in (`PagedToyModel`) that behaves like the real one
where the engine is concerned: it writes each chunk's per-token KV into a paged store at the
slots given by the plan's block table, and computes logits only from the KV it reads back
through that table. A wrong block table, a stale or overwritten block, or a recompute that does
not rebuild the cache raises (the engine then fails the request) or changes the tokens.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from service.engine.llm_engine import LLMEngine
from service.engine.plan import StepPlan
from service.outputs import OutputBatch
from service.sampling_params import InvalidRequest, SamplingParams
from service.server.route import Route
from service.tokenizer import build_tiny_tokenizer

VOCAB = 1024
TOK = build_tiny_tokenizer(VOCAB)


class PagedToyModel:
    def __init__(self, *, num_blocks: int, block_size: int, vocab: int = VOCAB, dim: int = 32,
                 max_len: int = 512, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.vocab = vocab
        self.embed = torch.randn(vocab, dim, generator=g)
        self.pos = torch.randn(max_len, dim, generator=g)
        self.w_in = torch.randn(dim, 64, generator=g) / dim**0.5
        self.w_out = torch.randn(64, vocab, generator=g) * 3.0
        # NaN, so reading a slot nobody wrote poisons the logits instead of reading zeros.
        self.kv = torch.full((num_blocks * block_size, dim), float("nan"))
        self.history: dict[int, list[int]] = {}  # the truth per seq_id, to check the paged KV
        self.plans: list[StepPlan] = []

    def _kv(self, tokens: list[int], start: int) -> torch.Tensor:
        return self.embed[tokens] + self.pos[start:start + len(tokens)]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def __call__(self, plan: StepPlan) -> torch.Tensor | None:
        self.plans.append(plan)
        rows = []
        for c in plan.chunks:
            seen = self.history.get(c.seq_id, [])
            assert c.start_pos <= len(seen), f"seq {c.seq_id} skips positions {len(seen)}..{c.start_pos}"
            history = seen[:c.start_pos] + c.token_ids  # start_pos 0 again after a preemption
            self.history[c.seq_id] = history
            end = c.start_pos + len(c.token_ids)
            self.kv[self._slots(c.block_table, c.start_pos, end)] = self._kv(c.token_ids, c.start_pos)
            if not c.needs_logits:
                continue
            context = self.kv[self._slots(c.block_table, 0, end)]
            if not torch.equal(context, self._kv(history, 0)):
                raise AssertionError(f"seq {c.seq_id}: KV read through block table {c.block_table} is not its history")
            rows.append(self.logits(context))
        return torch.stack(rows) if rows else None  # as the worker does when no chunk needs logits

    def logits(self, context: torch.Tensor) -> torch.Tensor:
        # Recent tokens weigh most, but every token in the context counts.
        weights = 0.85 ** torch.arange(len(context) - 1, -1, -1, dtype=torch.float32)
        h = (weights.unsqueeze(1) * context).sum(0) / weights.sum()
        return torch.tanh(h @ self.w_in) @ self.w_out


# Every test runs twice: steps in order, and with each step's outputs processed after the next
# step is launched (`overlap`, the CUDA default), which must give the same tokens, text and errors.
OVERLAP = [False]


@pytest.fixture(autouse=True, params=[False, True], ids=["in_order", "overlap"])
def _overlap(request):
    OVERLAP[0] = request.param
    yield
    OVERLAP[0] = False


def make_engine(*, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                tokenizer=TOK, eos_token_id=None, model=None, **kw):
    model = model or PagedToyModel(num_blocks=num_blocks, block_size=block_size)
    kw.setdefault("overlap", OVERLAP[0])
    engine = LLMEngine(model, tokenizer, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                       eos_token_id=eos_token_id, vocab_size=VOCAB, **kw)
    return engine, model


PROMPTS = [
    "The model reads a sequence of tokens",
    "Good morning! How are you",
    "Weights are loaded from disk",
    "In winter the road over the mountain",
    "こんにちは 🙂 naïve café",
    "A good test fails when the code is wrong",
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=1, max_tokens=18, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=5, seed=2, max_tokens=22, ignore_eos=True),
    SamplingParams(temperature=1.2, top_p=0.7, seed=3, max_tokens=16, ignore_eos=True),
    SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=14, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
]


def solo(prompt, params, **kw):
    engine, _ = make_engine(**kw)
    (out,) = engine.generate([(prompt, params)])
    return out


def tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def solo_outputs():
    return [solo(p, sp) for p, sp in zip(PROMPTS, PARAMS)]


def test_continuous_batching_matches_solo_runs(solo_outputs):
    engine, model = make_engine()
    arrivals = {0: [0, 1], 3: [2], 4: [3, 4], 9: [5]}  # step -> request indices
    final, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], None, PARAMS[i])
        for out in engine.step():
            assert out.error is None, out.error
            if out.finished:
                final[out.request_id] = out
        step += 1
    assert len(final) == len(PROMPTS)
    # Requests really overlapped: some plan mixes a prefill with decodes.
    assert any(len(p.chunks) > 1 and any(len(c.token_ids) > 1 for c in p.chunks) for p in model.plans)
    for i, ref in enumerate(solo_outputs):
        got = final[f"r{i}"]
        assert tokens(got) == tokens(ref), f"request {i}"
        assert [c.text for c in got.outputs] == [c.text for c in ref.outputs]
        assert all(c.finish_reason == "length" for c in got.outputs)
    # n=2 with one seed: the two samples use seed and seed + 1, so they differ.
    assert final["r4"].outputs[0].token_ids != final["r4"].outputs[1].token_ids
    stats = engine.stats()
    assert stats["free_blocks"] == 64
    # Execute time by step kind: every kind that ran has a total no smaller than its longest step.
    by_kind = stats["execute_seconds_by_kind"]
    for kind, n in stats["step_kinds"].items():
        assert (by_kind[kind]["total"] >= by_kind[kind]["max"] > 0) if n else by_kind[kind]["total"] == 0, kind
    assert stats["step_kinds"]["mixed"] > 0
    # Overlapped, most decode steps are scheduled while the step before them runs.
    assert stats["steps_scheduled_ahead"] > stats["step_kinds"]["decode"] // 2 if OVERLAP[0] else \
        stats["steps_scheduled_ahead"] == 0


def test_preemption_by_recompute_completes_identically(solo_outputs):
    # 12 blocks of 4 = 48 slots for six requests that each grow past 20 tokens.
    engine, model = make_engine(num_blocks=12, block_size=4, max_model_len=48)
    outs = engine.generate(list(zip(PROMPTS, PARAMS)))
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == 12 and stats["running"] == stats["waiting"] == 0
    # A preempted sequence was prefilled again from position 0 over prompt + output.
    restarted = [c for p in model.plans[1:] for c in p.chunks if c.start_pos == 0 and len(c.token_ids) > 1]
    assert len(restarted) > len(PROMPTS) + 1
    for out, ref in zip(outs, solo_outputs):
        assert out.error is None
        assert tokens(out) == tokens(ref)


def test_chunked_prefill_equals_unchunked():
    prompt = " ".join(PROMPTS) * 2
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)
    whole, whole_model = make_engine(max_num_batched_tokens=512, max_model_len=300, num_blocks=80)
    chunked, chunked_model = make_engine(max_num_batched_tokens=16, max_model_len=300, num_blocks=80)
    (a,) = whole.generate([(prompt, params)])
    (b,) = chunked.generate([(prompt, params)])
    n_prompt = len(a.prompt_token_ids)
    assert n_prompt > 100
    assert len(whole_model.plans[0].chunks[0].token_ids) == n_prompt
    partial = [c for p in chunked_model.plans for c in p.chunks if not c.needs_logits]
    assert len(partial) == (n_prompt - 1) // 16 and all(len(c.token_ids) == 16 for c in partial)
    assert tokens(a) == tokens(b) and a.outputs[0].text == b.outputs[0].text


def test_max_tokens_and_max_model_len_give_length():
    (out,) = make_engine()[0].generate([(PROMPTS[0], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))])
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    engine, _ = make_engine(max_model_len=20)
    (out,) = engine.generate([([5] * 15, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))])
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def _reference(prompt=PROMPTS[1], **params):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **params)
    (out,) = make_engine()[0].generate([(prompt, params)])
    return out.outputs[0]


def test_stop_token_ids_and_eos():
    ref = _reference()
    k = next(i for i in range(3, 30) if ref.token_ids[i] not in ref.token_ids[:i])
    stop_id = ref.token_ids[k]
    (out,) = make_engine()[0].generate([(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))])
    c = out.outputs[0]
    assert c.token_ids == ref.token_ids[:k + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    # The same token as EOS: a stop with stop_reason None, unless ignore_eos.
    (out,) = make_engine(eos_token_id=stop_id)[0].generate([(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30))])
    c = out.outputs[0]
    assert c.token_ids == ref.token_ids[:k + 1] and c.finish_reason == "stop" and c.stop_reason is None
    (out,) = make_engine(eos_token_id=stop_id)[0].generate(
        [(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])
    assert out.outputs[0].token_ids == ref.token_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_truncate_text(include):
    ref = _reference()
    text = ref.text
    assert len(text) > 20
    stop = text[8:11]
    cut = text.find(stop)
    engine, _ = make_engine()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["never-seen", stop],
                            include_stop_str_in_output=include)
    engine.add_request("s", PROMPTS[1], None, params)
    streamed = []
    while engine.has_unfinished():
        streamed += [o.outputs[0].text for o in engine.step()]
    # Streamed text only grows, and never shows a stop string that gets cut later.
    assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:]))
    final = streamed[-1]
    assert final == text[:cut + (len(stop) if include else 0)]


def test_stop_string_result_details():
    ref = _reference()
    stop = ref.text[8:11]
    (out,) = make_engine()[0].generate([(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, stop=stop))])
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == ref.token_ids[:len(c.token_ids)] and len(c.token_ids) < 30
    assert TOK.decode(c.token_ids).find(stop) >= 0  # tokens are kept; only the text is cut


def test_logprobs_in_outputs():
    engine, model = make_engine()
    (out,) = engine.generate([(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))])
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    ids = out.prompt_token_ids + c.token_ids
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        n = len(out.prompt_token_ids) + i
        expected = torch.log_softmax(model.logits(model._kv(ids[:n], 0)), -1)
        assert tok in lp and len(lp) == 3  # greedy: the chosen token is the top one
        for t, v in lp.items():
            assert v == pytest.approx(expected[t].item(), abs=1e-5)


def test_invalid_requests_are_refused_with_reasons():
    engine, _ = make_engine(max_model_len=32, max_num_seqs=4)
    sp = SamplingParams()
    cases = [
        (("a", "", None, sp), "empty"),
        (("a", None, [], sp), "empty"),
        (("a", None, None, sp), "either prompt or prompt_token_ids"),
        (("a", None, [1, VOCAB], sp), "outside the vocabulary"),
        (("a", None, [1, -2], sp), "outside the vocabulary"),
        (("a", None, [1, 2.5], sp), "list of integers"),
        (("a", None, [3] * 32, sp), "max_model_len"),
        (("a", "hello", None, SamplingParams(n=5)), "max_num_seqs"),
        (("", "hello", None, sp), "request_id"),
    ]
    for args, reason in cases:
        with pytest.raises(InvalidRequest, match=reason):
            engine.add_request(*args)
    engine.add_request("dup", "hello", None, sp)
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("dup", "hello", None, sp)
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        make_engine(tokenizer=None)[0].add_request("t", "hello", None, sp)
    with pytest.raises(InvalidRequest, match="stop strings need a tokenizer"):
        make_engine(tokenizer=None)[0].add_request("t", None, [1, 2], SamplingParams(stop="x"))
    # A failed generate() leaves nothing behind.
    with pytest.raises(InvalidRequest):
        engine.generate(["fine", ""])
    assert engine.stats()["requests"] == 1


def test_without_tokenizer_token_ids_only():
    engine, _ = make_engine(tokenizer=None)
    assert engine.stats()["note"] and "text is None" in engine.stats()["note"]
    (out,) = engine.generate([([0, 5, 9, 700], SamplingParams(temperature=0, max_tokens=5))])
    with_tok, _ = make_engine()
    (ref,) = with_tok.generate([([0, 5, 9, 700], SamplingParams(temperature=0, max_tokens=5))])
    assert out.outputs[0].text is None and out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_abort_reports_and_frees_blocks():
    engine, _ = make_engine()
    engine.add_request("keep", PROMPTS[0], None, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.add_request("drop", PROMPTS[1], None, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort_request("drop") and not engine.abort_request("drop")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["drop"].finished and outs["drop"].outputs[0].finish_reason == "abort"
    # Overlapped, the second step's token was still in flight: an abort drops it, as in vLLM.
    assert len(outs["drop"].outputs[0].token_ids) == 2 - OVERLAP[0]
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["keep"].outputs[0].finish_reason == "length"
    assert engine.stats()["free_blocks"] == 64


def test_executor_error_fails_running_requests_and_engine_recovers(solo_outputs):
    model = PagedToyModel(num_blocks=64, block_size=4)
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("rank 3: fused tail timed out")
        return model(plan)

    engine, _ = make_engine(model=flaky, max_num_seqs=2)
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], None, PARAMS[i])
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert {r for r, o in final.items() if o.outputs[0].finish_reason == "error"} == {"r0", "r1"}
    assert "fused tail timed out" in final["r0"].error and final["r0"].finished
    # Requests that were waiting, and new ones, run normally afterwards.
    assert tokens(final["r2"]) == tokens(solo_outputs[2]) and tokens(final["r3"]) == tokens(solo_outputs[3])
    (again,) = engine.generate([(PROMPTS[0], PARAMS[0])])
    assert tokens(again) == tokens(solo_outputs[0])
    assert engine.stats()["failed_steps"] == 1 and engine.stats()["free_blocks"] == 64


def test_a_wrong_block_table_is_caught():
    """The stand-in must be able to fail: swap two sequences' tables and the engine reports it."""
    model = PagedToyModel(num_blocks=64, block_size=4)

    def swapping(plan):
        if len(plan.chunks) == 2 and all(len(c.token_ids) == 1 for c in plan.chunks):
            a, b = plan.chunks
            a.block_table, b.block_table = b.block_table, a.block_table
        return model(plan)

    engine, _ = make_engine(model=swapping)
    outs = engine.generate([(PROMPTS[0], PARAMS[0]), (PROMPTS[5], PARAMS[5])])
    assert all(o.outputs[0].finish_reason == "error" and o.error for o in outs)


def test_preempt_all_then_lost_kv_recomputes_identically(solo_outputs):
    """What a pause(keep) + KV-cache sleep does: the cache contents vanish mid-generation."""
    engine, model = make_engine()
    for i in range(4):
        engine.add_request(f"r{i}", PROMPTS[i], None, PARAMS[i])
    final = {}
    for _ in range(6):
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.preempt_all() == 4 and engine.stats()["free_blocks"] == 64
    model.kv.fill_(float("nan"))  # released and re-mapped memory
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    for i in range(4):
        assert final[f"r{i}"].error is None and tokens(final[f"r{i}"]) == tokens(solo_outputs[i])


def test_abort_all_with_reason_and_drain_outputs():
    engine, _ = make_engine()
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], None, PARAMS[i])
    engine.step()
    assert engine.num_unfinished() == 3
    assert sorted(engine.abort_all("aborted: the engine is going to sleep")) == ["r0", "r1", "r2"]
    outs = engine.drain_outputs()
    assert len(outs) == 3 and all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert "sleep" in outs[0].error
    if OVERLAP[0]:  # the batch launched before the abort is still to be collected: its rows are dropped
        assert engine.in_flight and engine.has_unfinished() and engine.step() == []
    assert not engine.has_unfinished() and engine.step() == [] and engine.stats()["free_blocks"] == 64


def test_nan_logits_fail_only_their_request(solo_outputs):
    model = PagedToyModel(num_blocks=64, block_size=4)
    seen = {"n": 0}

    def poisoning(plan):
        logits = model(plan)
        rows = [c.seq_id for c in plan.chunks if c.needs_logits]
        if 0 in rows:
            seen["n"] += 1
            if seen["n"] == 4:  # seq 0's fourth token: as if it read released, NaN-poisoned memory
                logits[rows.index(0)] = float("nan")
        return logits

    engine, _ = make_engine(model=poisoning)
    a, b = engine.generate([(PROMPTS[0], PARAMS[0]), (PROMPTS[1], PARAMS[1])])
    assert a.outputs[0].finish_reason == "error" and "NaN" in a.error
    assert a.outputs[0].token_ids == solo_outputs[0].outputs[0].token_ids[:3]
    assert b.error is None and tokens(b) == tokens(solo_outputs[1])
    assert engine.stats()["free_blocks"] == 64


def test_requests_are_taken_while_a_step_runs():
    """add_request never waits for a running step: the step holds the engine's lock through the
    model's forward and the wait for its logits (whole seconds for an eager prefill on a GPU),
    and on the H200 HTTP clients' adds queued behind it. A step blocked in the model must still
    take new requests, refuse a duplicate id, and admit them all at the next step."""
    release, entered = threading.Event(), threading.Event()
    model = PagedToyModel(num_blocks=64, block_size=4)

    def blocking(plan):
        entered.set()
        assert release.wait(60), "the test never released the step"
        return model(plan)

    engine, _ = make_engine(model=blocking)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("first", PROMPTS[0], None, greedy)
    stepper = threading.Thread(target=engine.step)
    stepper.start()
    assert entered.wait(30)
    added = []

    def add_more():
        engine.add_request("second", PROMPTS[1], None, greedy)
        with pytest.raises(InvalidRequest, match="already in use"):
            engine.add_request("first", PROMPTS[2], None, greedy)
        with pytest.raises(InvalidRequest, match="already in use"):
            engine.add_request("second", PROMPTS[2], None, greedy)
        added.append(True)

    adder = threading.Thread(target=add_more)
    adder.start()
    adder.join(30)
    blocked = adder.is_alive()
    release.set()
    stepper.join(30)
    adder.join(30)
    assert not blocked, "add_request waited for the running step"
    assert added == [True]
    assert engine.num_unfinished() == 2 and engine.stats()["waiting"] == 1
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(outs) == {"first", "second"}
    assert tokens(outs["second"]) == tokens(solo(PROMPTS[1], greedy))


def test_abort_of_a_request_not_yet_admitted():
    engine, _ = make_engine()
    engine.add_request("queued", PROMPTS[0], None, SamplingParams(temperature=0, max_tokens=4))
    assert engine.stats()["waiting"] == 1 and engine.has_unfinished()
    assert engine.abort_request("queued", "client went away")
    (out,) = engine.step() or engine.drain_outputs()
    assert out.request_id == "queued" and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.stats()["free_blocks"] == 64


def test_progress_deltas_rebuild_the_whole_outputs():
    """With progress_deltas (the engine loop feeding the HTTP controller) each stream's progress
    output carries only what is new; extending the first one with the rest gives, at every step,
    the whole output the engine reports without deltas: tokens, text held back for a stop string,
    logprobs, n > 1, and the prompt's ids; each delta pickled and unpickled on the way."""
    reqs = [("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=1)),
            ("b", PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, ignore_eos=True)),
            ("c", PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["zz top"]))]
    runs = []
    for deltas in (False, True):
        engine, _ = make_engine()
        engine.progress_deltas = deltas
        for rid, prompt, params in reqs:
            engine.add_request(rid, prompt, None, params)
        steps = []
        while engine.has_unfinished():
            steps.append(engine.step())
        runs.append(steps)
    whole: dict = {}
    sent_delta = False
    for plain, delta in zip(*runs, strict=True):
        for p, sent in zip(plain, delta, strict=True):
            d = pickle.loads(pickle.dumps(sent))  # as the rank-0 pipe carries it (RequestOutput.__reduce__)
            assert d == sent and d.outputs[0].finished == sent.outputs[0].finished
            assert d.request_id == p.request_id and d.delta == (not p.finished)
            sent_delta |= d.delta and all(len(c.token_ids) <= 1 for c in d.outputs)
            if d.request_id in whole and d.delta:
                whole[d.request_id].extend(d)
            else:
                whole[d.request_id] = d
            assert whole[d.request_id].outputs == p.outputs
            assert whole[d.request_id].prompt_token_ids == p.prompt_token_ids
    assert sent_delta, "no progress output was a delta"
    # The same steps as rank 0's poll sends them (an OutputBatch a step, pickled), rebuilt by the
    # HTTP controller's Route: one-sample deltas as rows of parts, the rest as objects.
    route, rows = Route(queue=None, loop=None), 0
    for plain, sent in zip(*runs, strict=True):
        batch = pickle.loads(pickle.dumps(OutputBatch(sent)))
        assert [b.request_id for b in batch.outputs()] == [s.request_id for s in sent]
        for (rid, out, ids, text, lps, version), p in zip(batch, plain, strict=True):
            rows += out is None
            assert out is not None or (rid in ("a", "c") and not p.finished)
            whole = route.accumulate(out) if out is not None else route.advance(rid, ids, text, lps, version)
            assert whole.outputs == p.outputs and whole.prompt_token_ids == p.prompt_token_ids
            assert whole.finished == p.finished
    assert rows, "no output travelled as a row"


def test_preempt_all_collects_the_step_in_flight_and_reports_each_output_once(solo_outputs):
    engine, _ = make_engine()
    engine.add_request("a", PROMPTS[0], None, PARAMS[0])
    engine.add_request("b", PROMPTS[1], None, PARAMS[1])
    engine.step()
    engine.step()
    engine.abort_request("b")  # its abort output waits in the pending list
    assert engine.preempt_all() == 1 and not engine.in_flight
    outs = engine.drain_outputs()
    ids = [o.request_id for o in outs]
    assert ids.count("b") == 1 and len(ids) == len(set(ids)), ids
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert tokens(final["a"]) == tokens(solo_outputs[0])


def test_steps_prepared_ahead_are_the_steps_executed(solo_outputs):
    """The `prepare` hook (the worker packs graph inputs ahead) gets each step scheduled ahead
    with placeholder ids; `execute` then gets that very plan, ids filled in, unless the step
    before it retired a sequence (a new plan then). In order, nothing is prepared."""
    prepared: list[tuple[StepPlan, list]] = []
    engine, model = make_engine(prepare=lambda plan: prepared.append((plan, [c.token_ids[0] for c in plan.chunks])))
    outs = engine.generate(list(zip(PROMPTS, PARAMS)))
    for i, ref in enumerate(solo_outputs):
        assert tokens(outs[i]) == tokens(ref), f"request {i}"
    if not OVERLAP[0]:
        assert prepared == []
        return
    assert len(prepared) == engine.stats()["steps_scheduled_ahead"] > 0
    assert all(set(ids) == {-1} for _, ids in prepared)
    # A failing prepare costs only its head start: the same tokens, nothing lost in flight.
    def broken(plan):
        raise RuntimeError("staging buffer gone")

    other, _ = make_engine(prepare=broken)
    assert [tokens(o) for o in other.generate(list(zip(PROMPTS, PARAMS)))] == [tokens(o) for o in outs]
    other, _ = make_engine()  # and a failing schedule_ahead only costs the step its head start
    other.scheduler.schedule_ahead = broken
    assert [tokens(o) for o in other.generate(list(zip(PROMPTS, PARAMS)))] == [tokens(o) for o in outs]
    # Length stops are left out when the step is scheduled ahead: every prepared plan ran as is.
    executed = {id(p) for p in model.plans}
    assert all(id(p) in executed and -1 not in [c.token_ids[0] for c in p.chunks] for p, _ in prepared)
    # A stop id ends a request only when its token lands: that step's plan is a new one.
    stop_id = solo_outputs[0].outputs[0].token_ids[6]
    prepared.clear()
    model.plans.clear()
    engine.generate([(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_id])),
                     (PROMPTS[5], PARAMS[5])])
    executed = {id(p) for p in model.plans}
    assert sum(id(p) not in executed for p, _ in prepared) == 1


def test_a_request_arriving_during_a_step_runs_in_the_next_launched_step():
    """A request added while the host waits for a step's logits (here: from the `collect` hook,
    which runs just before that wait) gets its prefill into the very next step launched, even
    when that step was already scheduled ahead (overlap): the scheduled step gives way."""
    state = {"plans_at_add": None}
    engine, model = make_engine(max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def collect():
        decodes = sum(all(len(c.token_ids) == 1 for c in p.chunks) for p in model.plans)
        if state["plans_at_add"] is None and decodes >= 4:
            engine.add_request("late", PROMPTS[1], None, greedy)
            state["plans_at_add"] = len(model.plans)

    engine.collect = collect
    outs = {o.request_id: o for o in engine.generate([(PROMPTS[0], greedy)])}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    late = next(o for o in outs.values() if o.request_id == "late")
    assert tokens(late) == tokens(solo(PROMPTS[1], greedy))
    first_after = model.plans[state["plans_at_add"]]
    assert any(len(c.token_ids) > 1 for c in first_after.chunks), "the late request's prefill waited a step"


@pytest.mark.parametrize("taken", [True, False], ids=["published", "refused"])
def test_landed_tokens_go_out_before_a_prefill_launches(taken):
    """With overlap a step's tokens are reported after the next launch, but a launch that prefills
    holds the host for its whole forward (34 ms a mixed step at 256 streams, H100 run 69). So the
    tokens that landed go to `publish` first. Here each request arrives while the step before
    runs, so every prefill is followed by another: each first token is out before the next
    prompt's prefill executes. Whether `publish` takes them or not (it cannot wait for its lock),
    every output is reported once and the tokens are the in-order ones."""
    engine, model = make_engine()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    events, reported = [], []
    arrivals = iter([("r1", PROMPTS[1]), ("r2", PROMPTS[2]), ("r3", PROMPTS[3])])

    def publish(outs):
        events.append(("publish", {o.request_id for o in outs if len(o.outputs[0].token_ids) == 1}))
        reported.extend(outs if taken else [])
        return taken

    def traced(plan):
        events.append(("execute", any(len(c.token_ids) > 1 for c in plan.chunks)))
        return model(plan)

    def collect():
        rid, prompt = next(arrivals, (None, None))
        if rid is not None:
            engine.add_request(rid, prompt, None, greedy)

    engine.publish, engine.execute, engine.collect = publish, traced, collect
    engine.add_request("r0", PROMPTS[0], None, greedy)
    while engine.has_unfinished():
        reported.extend(engine.step())
    final = {o.request_id: o for o in reported if o.finished}
    for i in range(4):
        assert tokens(final[f"r{i}"]) == tokens(solo(PROMPTS[i], greedy)), f"r{i}"
    assert len(final) == sum(o.finished for o in reported), "a final output was reported twice"
    if not OVERLAP[0]:
        assert not any(kind == "publish" for kind, _ in events)
        return
    prefills = [i for i, (kind, prefilling) in enumerate(events) if kind == "execute" and prefilling]
    assert len(prefills) == 4
    for k, i in enumerate(prefills[1:]):
        assert events[i - 1] == ("publish", {f"r{k}"}), events[:i]  # r{k}'s first token, just before
