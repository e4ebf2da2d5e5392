"""Multi-node placement on a simulated two-node local Ray cluster (2 nodes x 2 ranks), through HTTP.

Ranks are ordered by node; the CPU fused tail needs one node's shared memory, so across nodes
every MoE layer takes the unfused path and /v1/status says why. Tokens match TP 1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service import LLM, SamplingParams
from service.client import Client
from tests.conftest import start_server

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


CLUSTER = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
cluster.add_node(num_cpus=2)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes our stdin
cluster.shutdown()
"""
# Ray reads its auth mode when imported: the simulated cluster and the server joining it both use
# token auth (the default for local clusters), so both run as processes with it set.
ENV = {**os.environ, "RAY_AUTH_MODE": "token"}


@pytest.fixture(scope="module")
def two_nodes():
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    address = proc.stdout.readline().strip()
    assert address, "the simulated cluster did not start: " + proc.stderr.read()[-3000:]
    yield address
    proc.stdin.close()
    proc.wait(timeout=120)


def test_tp4_across_two_nodes(two_nodes):
    with LLM("tiny", dtype="float32", distributed_executor_backend="uni") as llm:
        expected = [o.outputs[0].token_ids for o in
                    llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    server = start_server("--ray-address", two_nodes, tp=4, env=ENV)
    try:
        with Client(server.url, server.admin_key, timeout=300) as c:
            status = c.status()
            nodes = status["nodes"]
            assert len(set(nodes)) == 2 and not status["same_node"]
            assert nodes[0] == nodes[1] and nodes[2] == nodes[3], "ranks are not ordered by node"
            assert [r["node"] for r in status["ranks"]] == nodes
            for rank in status["ranks"]:
                assert rank["tail"]["fused"] == 0
                assert "span several nodes" in rank["tail"]["reason"]
            r = c.completions(PROMPTS, max_tokens=8, temperature=0, ignore_eos=True)
            got = [ch["token_ids"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]
            assert got == expected
            layers = c.collective_rpc("tail_state")
            assert all(layer["unfused_calls"] > 0 and layer["fused_calls"] == 0 for rank in layers for layer in rank)
    finally:
        server.stop()
