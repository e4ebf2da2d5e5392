"""--stream-interval: a stream's chunk carries this many new tokens, but its first and its last,
and the chunks together carry every token and the whole text once (vLLM's option of that name)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.cli import build_parser
from service.outputs import CompletionOutput, RequestOutput
from service.server.completions import _sse, _View


def upto(n: int, finished: bool = False) -> RequestOutput:
    ids = list(range(10, 10 + n))
    text = "".join(f"t{i} " for i in ids)
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, ids, finish_reason="length" if finished else None)],
                         finished=finished)


@pytest.mark.parametrize("interval,expected", [(1, [[i] for i in range(10, 18)]),
                                                (3, [[10], [11, 12, 13], [14, 15, 16], [17]])])
def test_chunks_wait_for_the_interval_but_the_first_and_the_last(interval, expected):
    view = _View(SimpleNamespace(stream_interval=interval, model_name="m", token_text=str), "completions", "c", 0)
    chunks = [c for n in range(1, 9) for c in view.chunks(0, upto(n, finished=n == 8))]
    assert [c["choices"][0]["token_ids"] for c in chunks] == expected
    assert "".join(c["choices"][0]["text"] for c in chunks) == upto(8).outputs[0].text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_events_are_the_chunks_encoded(endpoint):
    """The streamed events (head encoded once a stream) are byte for byte the chunks as SSE, logprobs,
    a weight version and text that needs escaping included."""
    ctl = SimpleNamespace(stream_interval=1, model_name='m"\u00e9', token_text=str)
    views = [_View(ctl, endpoint, "c\n", 1) for _ in range(2)]
    views[1].created = views[0].created
    for n in range(1, 5):
        out = upto(n, finished=n == 4)
        c = out.outputs[0]
        c.text = c.text.replace("t1", 'é"\\')
        c.logprobs = [{t: -0.5, t + 1: -1.5} for t in c.token_ids]
        out.weight_version = 7 if n < 3 else 8  # an update between two chunks
        assert views[0].events(0, out) == [_sse(chunk) for chunk in views[1].chunks(0, out)]


def test_the_cli_takes_one_or_more():
    assert build_parser().parse_args(["serve", "--stream-interval", "4"]).stream_interval == 4
    assert build_parser().parse_args(["serve"]).stream_interval == 1
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--stream-interval", "0"])
    assert e.value.code == 2
