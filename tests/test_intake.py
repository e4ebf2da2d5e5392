"""The controller's intake: arrivals behind an add_requests RPC in flight go together in the next,
each request gets its own outcome, and a request that gives up does not disturb the others."""

from __future__ import annotations

import asyncio

import pytest

from service.sampling_params import InvalidRequest
from service.server.controller import engine_refusal
from service.server.intake import Intake
from service.server.protocol import APIError


def item(rid: str) -> tuple:
    return (rid, None, [5, 6], None)


class Rank0:
    """add_requests that waits at a gate; 'bad' ids are refused, `down` fails the whole call."""

    def __init__(self):
        self.calls, self.gate, self.down = [], asyncio.Event(), False

    async def __call__(self, method, items):
        assert method == "add_requests"
        self.calls.append([i[0] for i in items])
        await self.gate.wait()
        if self.down:
            raise APIError(503, "rank 0 is gone")
        return [InvalidRequest(f"{i[0]}: no") if i[0].startswith("bad") else None for i in items]


def test_arrivals_during_an_rpc_go_in_one_next_rpc_each_with_its_outcome():
    async def run():
        rank0 = Rank0()
        intake = Intake(rank0, engine_refusal)
        first = asyncio.create_task(intake.add([item("a")]))
        await asyncio.sleep(0.01)  # the first RPC is in flight, held at the gate
        rest = [asyncio.create_task(intake.add(items)) for items in ([item("b"), item("c")], [item("bad")])]
        gone = asyncio.create_task(intake.add([item("d")]))
        await asyncio.sleep(0.01)
        gone.cancel()  # its client left before rank 0 answered
        rank0.gate.set()
        await first
        await rest[0]
        with pytest.raises(APIError) as e:
            await rest[1]
        assert (e.value.status, e.value.code) == (400, "invalid_request") and "bad: no" in e.value.message
        assert rank0.calls == [["a"], ["b", "c", "bad", "d"]]
        assert intake.stats == {"requests": 5, "rpcs": 2}
        await asyncio.sleep(0)
        assert intake._sender is None  # idle again: the next arrival starts a sender
        await intake.add([item("e")])
        assert rank0.calls[-1] == ["e"]

    asyncio.run(run())


def test_a_failed_rpc_fails_every_request_in_it():
    async def run():
        rank0 = Rank0()
        rank0.down = True
        rank0.gate.set()
        intake = Intake(rank0, engine_refusal)
        outcomes = await asyncio.gather(intake.add([item("a")]), intake.add([item("b")]), return_exceptions=True)
        assert [o.status for o in outcomes] == [503, 503]

    asyncio.run(run())


def test_a_broken_answer_fails_the_requests_instead_of_leaving_them_waiting():
    async def run():
        async def short(method, items):
            return [None]  # one outcome for two requests

        async def crash(method, items):
            raise KeyError("bug")

        for call in (short, crash):
            intake = Intake(call, engine_refusal)
            outcomes = await asyncio.wait_for(asyncio.gather(intake.add([item("a"), item("b")]),
                                                             return_exceptions=True), 5)
            assert isinstance(outcomes[0], APIError) and outcomes[0].status == 500

    asyncio.run(run())
