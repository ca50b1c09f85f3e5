"""Cache hits answered by the HTTP door just before it is stopped, on the real stack.

The door answers a cached image at once and publishes the hit on ``ocr.results`` in the
background (its hit producer); the sink then writes the request's MariaDB row and completion.
A SIGTERM right after a burst of such answers must lose none of them: every request answered
200 gets its row.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.stack import API, db_rows

pytestmark = pytest.mark.stack

#: Metadata just under the door's 16 KiB limit: each hit message is then larger than aiokafka's
#: 16 KiB producer batch, so every hit takes a produce request of its own and the sends queue
#: behind each other, as they do behind a slow broker.
BIG_METADATA = json.dumps({"note": "m" * 16_000})
BURST = 400


def _rows(ids: list[str]) -> set[str]:
    got: set[str] = set()
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        sql = "SELECT request_id FROM requests WHERE request_id IN (" + ",".join(["%s"] * len(chunk)) + ")"
        got |= {r["request_id"] for r in db_rows(sql, *chunk)}
    return got


async def _cached_burst(url: str, img: bytes, n: int, concurrency: int = 64) -> list[str]:
    """``n`` submissions of a cached image with big metadata; the ids of those answered 200."""
    ids: list[str] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one() -> None:
            async with sem:
                r = await c.post("/v1/ocr", content=img, params={"metadata": BIG_METADATA},
                                 headers={"Content-Type": "image/png"})
                assert r.status_code == 200 and r.json()["cache_hit"] is True, r.text
                ids.append(r.json()["request_id"])

        await asyncio.gather(*(one() for _ in range(n)))
    return ids


def test_sigterm_right_after_a_burst_of_cached_answers_loses_no_row(pipeline):
    # a generous Redis budget: on a busy machine a slow lookup would answer 202 (a miss) instead
    door = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_WEBHOOK_ENABLED": "false",
                                          "OCRSTREAM_REDIS__TIMEOUT_MS": "5000"})
    url = f"http://127.0.0.1:{door.port}"
    img = text_image([f"FLUSH {uuid.uuid4().hex[:6].upper()}"])
    with httpx.Client(base_url=url, timeout=150) as c:
        rid = c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"}).json()["request_id"]
        first = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        assert first["status"] == "ok", first

    answered = asyncio.run(_cached_burst(url, img, BURST))
    pipeline.stop(door)  # SIGTERM at once: graceful shutdown of uvicorn, then Clients.stop()

    assert len(answered) == BURST == len(set(answered))
    deadline = time.time() + 60
    while (have := _rows(answered)) != set(answered) and time.time() < deadline:
        time.sleep(1)
    assert len(set(answered) - have) == 0, f"{len(set(answered) - have)} answered requests have no row"
    rows = db_rows("SELECT status, cache_hit FROM requests WHERE request_id = %s", answered[-1])
    assert rows == [{"status": "ok", "cache_hit": 1}]
    assert "publishing a cache hit failed" not in door.log.read_text()
