"""PrioritySlots (services/infer/engines/slots.py): interactive waiters first, each lane in arrival
order, a slot passed on to the next waiter, cancellation leaving nothing taken."""

from __future__ import annotations

import asyncio

import pytest

from services.infer.engines.slots import PrioritySlots


async def test_a_waiting_interactive_page_gets_the_next_slot_before_every_bulk_one():
    slots = PrioritySlots(2)
    order: list[str] = []
    held = [asyncio.Event() for _ in range(2)]

    async def page(name: str, lane: str, hold: asyncio.Event | None = None) -> None:
        async with slots.hold(lane):
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = [asyncio.create_task(page(f"b{i}", "bulk", held[i])) for i in range(2)]
    await asyncio.sleep(0)
    assert slots.busy == 2
    waiting = [asyncio.create_task(page("b2", "bulk")), asyncio.create_task(page("b3", "bulk"))]
    await asyncio.sleep(0)
    waiting.append(asyncio.create_task(page("i0", "interactive")))
    await asyncio.sleep(0)
    assert (slots.waiting("bulk"), slots.waiting("interactive")) == (2, 1)
    held[0].set()
    await asyncio.gather(first[0])
    held[1].set()
    await asyncio.gather(*first, *waiting)
    assert order == ["b0", "b1", "i0", "b2", "b3"]
    assert slots.busy == 0 and slots.waiting() == 0


async def test_a_cancelled_waiter_takes_nothing_and_the_slot_goes_on():
    slots = PrioritySlots(1)
    await slots.acquire("bulk")
    gone = asyncio.create_task(slots.acquire("interactive"))
    nxt = asyncio.create_task(slots.acquire("bulk"))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    slots.release()
    await asyncio.wait_for(nxt, 5)
    assert slots.busy == 1 and slots.waiting() == 0
    slots.release()
    assert slots.busy == 0


def test_at_least_one_slot():
    with pytest.raises(ValueError):
        PrioritySlots(0)
