"""The infer window on the real stack: a slow page holds back nothing behind it, and the committed
offset of its partition stays below it until it is done (docs/delivery.md, "The window").

Infer runs its ``openai`` engine against a small OpenAI-compatible server on loopback (a thread
of this process) that holds one image (red) until the test lets it go: a page the model takes
long to read. Everything else (Kafka, Redis, MariaDB, S3, the four stages) is the real stack.
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.events import InferEvent
from services.common.settings import CommonSettings
from tests.conftest import solid_image
from tests.waits import event_set
from tests.stack import LoopbackOcrServer, is_red_image, namespaced_pipeline
from tests.topics import committed, partition_of, topic_records

pytestmark = pytest.mark.stack

ANSWER = "READ BESIDE THE SLOW PAGE 77"


@pytest.fixture(scope="module")
def holding():
    """Answers every image with ``ANSWER`` at once, but holds a red one until ``let_go``."""
    srv = LoopbackOcrServer(ANSWER, holds_on=is_red_image)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def window_pipeline(holding, tmp_path_factory):
    extra = {"OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_OPENAI_BASE_URL": holding.url,
             "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60"}
    with namespaced_pipeline(tmp_path_factory.mktemp("window-logs"), extra) as p:
        yield p


async def test_a_slow_page_holds_back_nothing_and_its_partition_commits_below_it(window_pipeline, holding):
    p = window_pipeline
    s = CommonSettings()
    group = p.env["OCRSTREAM_INFER_GROUP_ID"]
    slow = solid_image((230, 20, 20))
    part = partition_of(slow)
    slow_run = asyncio.create_task(p.run([(slow, "slow.png")], timeout=300))
    await event_set(holding.holding, "infer to send the slow page to the engine")
    # after it on ocr.infer-interactive: six on its own partition, four on others
    whites = [solid_image((255, 255, 255), size=(240 + i, 120)) for i in range(300)]
    same = [w for w in whites if partition_of(w) == part][:6]
    other = [w for w in whites if partition_of(w) != part][:4]
    behind = await p.run([(img, f"behind-{i}.png") for i, img in enumerate(same + other)], timeout=300)
    assert all(d.status == "ok" and d.text == ANSWER for d in behind), [(d.status, d.error) for d in behind]
    assert not slow_run.done()  # every page behind it is done while it is still on the engine
    records = {InferEvent.model_validate_json(r.value).request.request_id: r.offset
               for r in await topic_records(s.topics.infer_interactive, part)}
    [slow_offset] = [off for rid, off in records.items() if rid not in {d.request_id for d in behind}]
    later = [records[d.request_id] for d in behind if d.request_id in records]
    assert len(later) == 6 and min(later) > slow_offset
    # the partition's commit stays at the slow page however many after it are done
    assert (await committed(group, s.topics.infer_interactive))[part] == slow_offset
    holding.let_go()
    [doc] = await slow_run
    assert doc.status == "ok" and doc.text == ANSWER
    for _ in range(120):
        if (await committed(group, s.topics.infer_interactive))[part] == max(later) + 1:
            break
        await asyncio.sleep(0.5)
    assert (await committed(group, s.topics.infer_interactive))[part] == max(later) + 1
