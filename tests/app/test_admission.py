"""The API's fair queue (app.admission): at most `most` requests at work, the others served in
arrival order per key and round robin over keys; a waiter that gives up leaves no trace."""

from __future__ import annotations

import asyncio

from app.admission import FairAdmission


def test_round_robin_over_keys_in_arrival_order_within_one() -> None:
    async def scenario() -> list[str]:
        gate = FairAdmission(1)
        served: list[str] = []
        await gate.acquire("first")

        async def one(who: str, name: str) -> None:
            await gate.acquire(who)
            served.append(name)
            gate.release()

        tasks = [
            asyncio.create_task(one(w, n))
            for w, n in [("crowd", "c1"), ("crowd", "c2"), ("crowd", "c3"), ("quiet", "q1")]
        ]
        await asyncio.sleep(0)
        assert gate.waiting == 4 and gate.active == 1
        gate.release()
        await asyncio.gather(*tasks)
        assert gate.active == 0 and gate.waiting == 0
        return served

    # The quiet key's one request waits for one of the crowd's, not for all three.
    assert asyncio.run(scenario()) == ["c1", "q1", "c2", "c3"]


def test_a_cancelled_waiter_frees_nothing_and_blocks_nobody() -> None:
    async def scenario() -> None:
        gate = FairAdmission(1)
        await gate.acquire("a")
        gone = asyncio.create_task(gate.acquire("b"))
        later = asyncio.create_task(gate.acquire("c"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert gate.waiting == 1
        gate.release()
        await later
        assert gate.active == 1
        gate.release()
        assert gate.active == 0

    asyncio.run(scenario())
