"""The Redis circuit breaker against a server that accepts connections and never answers (a hung
or frozen Redis), on loopback: slow calls open it, calls then fail at once, and one call after
``breaker_open_ms`` tries again."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.cache.entries import CacheUnavailable, ResultCache
from services.common.settings import RedisSettings, TelemetrySettings
from services.common.telemetry import Telemetry


async def _silent_server() -> tuple[asyncio.AbstractServer, int]:
    held = []

    async def accept(reader, writer):  # reads nothing, answers nothing, keeps the socket
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_hung_redis_opens_the_breaker_then_calls_fail_at_once_until_a_retry():
    async def go():
        server, port = await _silent_server()
        telemetry = Telemetry("dedup", TelemetrySettings())
        cache = ResultCache(RedisSettings(url=f"redis://127.0.0.1:{port}/0", timeout_ms=200, breaker_failures=3,
                                          breaker_open_ms=1500), telemetry, "dedup")
        try:
            for _ in range(3):  # each waits out its 200 ms budget
                t0 = time.monotonic()
                with pytest.raises(CacheUnavailable):
                    await cache.get("k")
                assert time.monotonic() - t0 >= 0.19
            t0 = time.monotonic()
            for _ in range(50):  # open: no call reaches the server
                with pytest.raises(CacheUnavailable, match="circuit breaker open"):
                    await cache.get("k")
            fast = time.monotonic() - t0
            skipped = telemetry.cache.labels("dedup", "skipped", "breaker")._value.get()
            errors = telemetry.cache.labels("dedup", "error", "redis")._value.get()
            assert skipped == 50 and errors == 3, (skipped, errors)
            assert fast < 0.19 * 3, fast  # 50 refused calls took less than the 3 slow ones would
            await asyncio.sleep(1.6)  # open period over: one call (the first) tries Redis again
            results = await asyncio.gather(*(cache.get("k") for _ in range(5)), return_exceptions=True)
            messages = [str(r) for r in results]
            assert all(isinstance(r, CacheUnavailable) for r in results), results
            assert "circuit breaker" not in messages[0] and all("circuit breaker open" in m for m in messages[1:]), messages
            assert telemetry.cache.labels("dedup", "error", "redis")._value.get() == 4  # the trial timed out too
        finally:
            await cache.close()
            server.close()

    asyncio.run(go())
