"""A stage's shutdown closes every client even when one of them hangs or fails."""

from __future__ import annotations

import asyncio
import logging

from services.common.app import close_in_turn


def test_a_client_that_times_out_or_fails_does_not_keep_the_next_open(caplog):
    closed = []

    async def hangs():
        await asyncio.wait_for(asyncio.sleep(10), 0.01)  # a consumer whose stop never returns

    async def fails():
        raise RuntimeError("broker gone")

    async def ok(name):
        closed.append(name)

    caplog.set_level(logging.WARNING)
    asyncio.run(close_in_turn("sink", [("consumer", hangs), ("producer", lambda: ok("producer")),
                                       ("admin client", fails), ("handler", lambda: ok("handler"))]))
    assert closed == ["producer", "handler"]
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("sink: closing the consumer failed: TimeoutError") for m in warned), warned
    assert any(m.startswith("sink: closing the admin client failed: RuntimeError") for m in warned), warned
