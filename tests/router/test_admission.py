"""router/admission.py: the per-request completion cap, deadline range, and the FairGate's
round-robin turns (in-process asyncio; the real-server checks are in test_e2e_failover.py)."""
from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.router.admission import (
    MAX_COMPLETIONS,
    MAX_TIMEOUT_S,
    FairGate,
    completions_problem,
    timeout_problem,
)


def test_completion_cap_names_the_field() -> None:
    assert completions_problem(1, MAX_COMPLETIONS) is None
    assert completions_problem(MAX_COMPLETIONS, 1) is None
    assert completions_problem(1, 1000)[0] == "n"
    field, message = completions_problem(200, 2)
    assert field == "prompt" and "400 completions" in message


@pytest.mark.parametrize("t", [0, -1, 1e10, math.inf, math.nan, MAX_TIMEOUT_S * 2])
def test_deadline_out_of_range(t: float) -> None:
    assert timeout_problem(t).startswith("timeout_s:")


@pytest.mark.parametrize("t", [None, 0.001, 30, MAX_TIMEOUT_S])
def test_deadline_in_range(t: float | None) -> None:
    assert timeout_problem(t) is None


async def _order_of_grants(jobs: dict[str, int], slots: int,
                           priorities: dict[str, int] | None = None) -> list[str]:
    """Each job's completions wait at a gate of `slots`; the order in which they get in."""
    gate, order = FairGate(lambda: slots), []
    release = asyncio.Event()

    async def completion(key: str) -> None:
        async with gate.slot(key, (priorities or {}).get(key, 0)):
            order.append(key)
            await release.wait()
            await asyncio.sleep(0)

    blockers = [asyncio.create_task(completion("busy")) for _ in range(slots)]
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(completion(k)) for k, n in jobs.items() for _ in range(n)]
    await asyncio.sleep(0)
    assert gate.num_waiting == sum(jobs.values())
    release.set()
    await asyncio.gather(*blockers, *tasks)
    return order[slots:]


def test_requests_take_turns_whatever_their_size() -> None:
    """Two requests of 200 completions arrive before a request of 1: with 2 slots, the small
    one is in within the first round (3 grants), not after 400."""
    order = asyncio.run(_order_of_grants({"big-a": 200, "big-b": 200, "small": 1}, slots=2))
    assert order.index("small") < 3
    assert order[:6] == ["big-a", "big-b", "small", "big-a", "big-b", "big-a"]
    assert order.count("big-a") == order.count("big-b") == 200


def test_lower_priority_values_go_first_and_take_turns_among_themselves() -> None:
    """--scheduling-policy priority: every completion of a lower value is in before any of
    a higher one, arrival order notwithstanding; requests of one value take turns."""
    order = asyncio.run(_order_of_grants({"batch": 3, "chat-a": 2, "chat-b": 2, "vip": 1},
                                         slots=1, priorities={"batch": 7, "vip": -1}))
    assert order == ["vip", "chat-a", "chat-b", "chat-a", "chat-b", "batch", "batch", "batch"]


def test_slots_bound_concurrency_and_follow_the_pool() -> None:
    async def main() -> tuple[int, int]:
        slots = [3]
        gate, running, peak = FairGate(lambda: slots[0]), [0], [0]

        async def completion(key: str) -> None:
            async with gate.slot(key):
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                await asyncio.sleep(0.001)
                running[0] -= 1

        first = [asyncio.create_task(completion(f"r{i % 4}")) for i in range(20)]
        await asyncio.gather(*first)
        peak3, peak[0] = peak[0], 0
        slots[0] = 1  # a worker went away
        await asyncio.gather(*(completion(f"r{i}") for i in range(10)))
        return peak3, peak[0]

    assert asyncio.run(main()) == (3, 1)


def test_a_cancelled_waiter_gives_its_turn_away() -> None:
    async def main() -> list[str]:
        gate, order = FairGate(lambda: 1), []
        hold = asyncio.Event()

        async def completion(key: str) -> None:
            async with gate.slot(key):
                order.append(key)
                await hold.wait()

        busy = asyncio.create_task(completion("busy"))
        await asyncio.sleep(0)
        doomed = asyncio.create_task(completion("doomed"))
        after = asyncio.create_task(completion("after"))
        await asyncio.sleep(0)
        doomed.cancel()  # the client went away while waiting
        hold.set()
        await asyncio.wait_for(asyncio.gather(busy, after), 5)
        assert doomed.cancelled() and gate.num_waiting == 0
        return order

    assert asyncio.run(main()) == ["busy", "after"]
