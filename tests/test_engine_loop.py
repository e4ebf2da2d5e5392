"""The engine loop's hand-over of outputs from inside a step (async output, before a prefill)."""

from __future__ import annotations

import threading
import time

from service.cluster import engine_loop
from service.cluster.engine_loop import EngineLoop
from service.engine.llm_engine import LLMEngine
from service.sampling_params import SamplingParams
from tests.test_llm_engine import PROMPTS, TOK, VOCAB, PagedToyModel, solo, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_loop() -> tuple[EngineLoop, LLMEngine, PagedToyModel]:
    model = PagedToyModel(num_blocks=64, block_size=4)
    engine = LLMEngine(model, TOK, block_size=4, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=128, vocab_size=VOCAB, overlap=True)
    return EngineLoop(engine, lambda: 7), engine, model


def test_a_first_token_reaches_poll_before_the_next_prefill_executes():
    """Three requests, each arriving while the step before runs: when a prompt's prefill
    executes, poll() already has the previous request's first token (as a progress delta)."""
    loop, engine, model = make_loop()
    arrivals = iter([("r1", PROMPTS[1]), ("r2", PROMPTS[2])])
    seen_at_prefill, polled = [], []

    def traced(plan):
        if any(len(c.token_ids) > 1 for c in plan.chunks):
            outs = loop.poll(timeout=0)
            polled.extend(outs)
            seen_at_prefill.append({o.request_id for o in outs if o.outputs[0].token_ids})
        return model(plan)

    def collect():
        rid, prompt = next(arrivals, (None, None))
        if rid is not None:
            loop.add(rid, prompt, None, GREEDY)

    engine.execute, engine.collect = traced, collect
    try:
        loop.add("r0", PROMPTS[0], None, GREEDY)
        final = {}
        while len(final) < 3:
            for out in polled + loop.poll(timeout=5):
                assert out.weight_version == 7
                if out.finished:
                    final[out.request_id] = out
            polled.clear()
    finally:
        loop.stop()
    assert len(seen_at_prefill) == 3 and "r0" in seen_at_prefill[1] and "r1" in seen_at_prefill[2]
    for i in range(3):
        assert tokens(final[f"r{i}"]) == tokens(solo(PROMPTS[i], GREEDY)), f"r{i}"  # in order


def test_a_step_waits_for_the_loop_lock_only_briefly(monkeypatch):
    """pause() holds the loop's lock while it calls into the engine, whose lock a running step
    holds: the hand-over from inside a step waits for that lock only HANDOVER_WAIT_S, then
    refuses and the step keeps its outputs. A reader that lets go within the wait is waited for."""
    loop, engine, _ = make_loop()
    try:
        outcome = []
        with loop._cv:
            t = threading.Thread(target=lambda: outcome.append(engine.publish([])))
            t.start()
            t.join(5)
        assert outcome == [False] and loop.stats()["handovers"] == {"taken": 0, "refused": 1}
        monkeypatch.setattr(engine_loop, "HANDOVER_WAIT_S", 30.0)
        with loop._cv:  # a reader holding the lock when the hand-over comes, then letting go
            t = threading.Thread(target=lambda: outcome.append(engine.publish([])))
            t.start()
            time.sleep(0.05)
        t.join(5)
        assert outcome == [False, True] and loop.stats()["handovers"] == {"taken": 1, "refused": 1}
    finally:
        loop.stop()


def test_first_token_phases_add_up_to_less_than_the_wait():
    """Every request's first token is counted once, in three gaps (queued, launched to landed,
    landed to handed out) whose sum is within the time from its add to its first poll."""
    loop, engine, _ = make_loop()
    t0, firsts = time.monotonic(), {}
    try:
        for i in range(3):
            loop.add(f"r{i}", PROMPTS[i], None, GREEDY)
        done = set()
        while len(done) < 3:
            for out in loop.poll(timeout=5):
                if out.outputs[0].token_ids:
                    firsts.setdefault(out.request_id, time.monotonic())
                if out.finished:
                    done.add(out.request_id)
    finally:
        loop.stop()
    ft = loop.stats()["first_token"]
    assert ft["first_tokens"] == 3
    assert min(ft["queue_s"], ft["device_s"], ft["report_s"]) >= 0
    assert ft["queue_s"] + ft["device_s"] + ft["report_s"] <= sum(t - t0 for t in firsts.values())
