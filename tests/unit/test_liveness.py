"""``/healthz`` of a stage's telemetry server over a real loopback socket: 200 until a liveness
check says the process cannot recover (a dead vLLM engine core), then 503 naming it."""

from __future__ import annotations

import asyncio

from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry


async def _get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_healthz_fails_once_a_live_check_does_and_readyz_is_separate():
    async def go():
        t = Telemetry("infer", TelemetrySettings())
        engine_alive = True
        t.live_checks["engine"] = lambda: engine_alive
        server = await t.serve(0, "127.0.0.1")
        port = server.sockets[0].getsockname()[1]
        try:
            assert await _get(port, "/healthz") == (200, b"ok\n")
            engine_alive = False
            assert await _get(port, "/healthz") == (503, b"not live: engine\n")
            assert (await _get(port, "/readyz"))[0] == 200  # readiness has its own checks
        finally:
            server.close()
            t.close()

    asyncio.run(go())
