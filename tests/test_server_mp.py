"""`latentserve serve --distributed-executor-backend mp`: the HTTP server without Ray (the H200
box has none). With `ray` made unimportable, a TP-1 server on the mp backend starts, streams the
offline engine's greedy tokens, names its backend in /status, offers no Ray weight transport
and still restarts its ranks."""

import os

from service import LLM, SamplingParams
from service.client import Client
from tests.conftest import start_server

ENGINE = {"dtype": "float32", "hf_overrides": {"num_hidden_layers": 2}, "dummy_weights": "device"}
PROMPT = [5, 17, 99, 3, 250, 41]


def test_serve_mp_backend_without_ray(tmp_path):
    blocked = tmp_path / "noray" / "ray"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('ray is blocked in this test')\n")
    path = os.pathsep.join(p for p in (str(blocked.parent), os.environ.get("PYTHONPATH")) if p)
    with LLM("tiny", distributed_executor_backend="uni", **ENGINE) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        ref = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    server = start_server("--distributed-executor-backend", "mp", "--dtype", "float32", "--hf-overrides",
                          '{"num_hidden_layers": 2}', "--dummy-weights", "device", tp=1, env={"PYTHONPATH": path})
    try:
        with Client(server.url, server.admin_key) as c:
            streamed = []
            for chunk in c.stream_completions([PROMPT], max_tokens=8, temperature=0.0, ignore_eos=True):
                for choice in chunk.get("choices", []):
                    streamed += choice.get("token_ids", [])
            assert streamed == ref
            status = c.status()
            assert status["backend"] == "mp" and "ray" not in status
            assert c.restart()["restarted"] is True
            again = c.completions([PROMPT], max_tokens=8, temperature=0.0, ignore_eos=True)
            assert again["choices"][0]["token_ids"] == ref
    finally:
        server.stop()
    assert "ray is blocked" not in server.log()
