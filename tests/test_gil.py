"""The serving processes' GIL switch interval (service/gil.py): set from the environment, and an
in-process engine gives its host process the interval back when it stops."""

from __future__ import annotations

import sys

import pytest

from service import LLM, SamplingParams, gil


def test_hand_over_often_sets_the_interval_and_returns_the_one_before(monkeypatch):
    before = sys.getswitchinterval()
    try:
        monkeypatch.setenv("LATENTSERVE_GIL_SWITCH_MS", "2")
        assert gil.hand_over_often() == before
        assert sys.getswitchinterval() == pytest.approx(0.002)
        monkeypatch.setenv("LATENTSERVE_GIL_SWITCH_MS", "0")
        with pytest.raises(ValueError, match="must be positive"):
            gil.hand_over_often()
    finally:
        sys.setswitchinterval(before)


def test_an_in_process_engine_restores_its_host_process_interval(monkeypatch):
    before = sys.getswitchinterval()
    monkeypatch.setenv("LATENTSERVE_GIL_SWITCH_MS", "1")
    llm = LLM(model="tiny", distributed_executor_backend="uni", seed=0)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.001)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    assert sys.getswitchinterval() == before
