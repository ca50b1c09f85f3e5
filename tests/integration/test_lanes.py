"""Two lanes on the real stack: a single image posted to the HTTP door while a job of 500 pages is
queued is read next, not after the job (docs/delivery.md, "Two lanes").

The job's requests are bulk (they carry a job id), the door's single image is interactive: dedup
sends it to ``ocr.infer-interactive``, and infer takes it into the window's reserved slot and the
engine's next free slot before any waiting bulk page. Infer runs its ``openai`` engine against a
small OpenAI-compatible server on loopback that answers each page after ``DELAY_S``, 4 at once
(a GPU that is the bottleneck, as in production: the job stays queued in ``ocr.infer`` while the
other stages keep up). The test asserts the order of completions, not a time.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from schemas.events import ResultDocument
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.stack import API, LoopbackOcrServer, namespaced_pipeline
from tests.topics import topic_records

pytestmark = pytest.mark.stack

BULK = 500
DELAY_S = 0.4  # 10 pages/s with 4 at once: slower than ingest and dedup feed it, on any machine
ANSWER = "READ IN ITS LANE 31"


@pytest.fixture(scope="module")
def lanes(tmp_path_factory):
    srv = LoopbackOcrServer(ANSWER, delay_s=DELAY_S)
    srv.start()
    extra = {"OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_OPENAI_BASE_URL": srv.url,
             "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60", "OCRSTREAM_OPENAI_MAX_CONCURRENCY": "4"}
    try:
        with namespaced_pipeline(tmp_path_factory.mktemp("lanes-logs"), extra) as p:
            door = p.start(API, extra_env=API_ENV)  # the engine settings are the namespace's: the door keys the cache as dedup does
            door.url = f"http://127.0.0.1:{door.port}"
            yield p, door
    finally:
        srv.stop()


async def test_an_interactive_image_is_read_before_the_bulk_job_queued_ahead_of_it(lanes):
    p, door = lanes
    s = CommonSettings()
    tag = uuid.uuid4().hex[:6]
    items = [(text_image([f"BULK {tag} {i:03d}"], size=28), f"bulk{i:03d}.png") for i in range(BULK)]
    bulk = asyncio.create_task(p.run(items, timeout=900, job_id=f"lanes-{tag}"))
    # until dedup has sent most of the job to ocr.infer: the bulk lane is queued up
    for _ in range(600):
        if len(await topic_records(s.topics.infer)) >= BULK * 0.8:
            break
        await asyncio.sleep(0.5)
    queued = len(await topic_records(s.topics.infer))
    assert queued >= BULK * 0.8
    async with httpx.AsyncClient(base_url=door.url, timeout=120) as client:
        r = await client.post("/v1/ocr", content=text_image([f"URGENT {tag}"], size=28),
                              headers={"Content-Type": "image/png"})
        assert r.status_code == 202, r.text
        rid = r.json()["request_id"]
        r = await client.get(f"/v1/ocr/{rid}", params={"wait": 60})
        while r.json()["status"] == "pending":
            r = await client.get(f"/v1/ocr/{rid}", params={"wait": 60})
    urgent = ResultDocument.model_validate(r.json()["result"])
    assert urgent.status == "ok" and urgent.text == ANSWER
    docs = await bulk
    assert all(d.status == "ok" for d in docs)
    pending = sum(d.completed_at_ms > urgent.submitted_at_ms for d in docs)  # bulk pages not done when it came
    after = sum(d.completed_at_ms > urgent.completed_at_ms for d in docs)
    assert pending >= BULK // 2, f"only {pending} bulk pages left when the image was posted: no backlog to test"
    # read next: most of the job's pages still waiting were read after it (in one queue it came
    # behind a quarter of them on its partition, and the others drain alongside: read near the end)
    assert after >= pending // 2, (after, pending)
