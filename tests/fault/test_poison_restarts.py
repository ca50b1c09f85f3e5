"""Kill infer twice while it holds a poison record: the record goes to the DLQ and its request
ends with an error, and the records behind it on its partition complete.

Infer runs its ``openai`` engine against a small OpenAI-compatible server on loopback (a thread
of this process) that never answers for one image (red): a stand-in for a record that wedges
its stage so that only killing the process ends it. The test SIGKILLs infer each time the server
holds that image, and starts it again. Everything else (Kafka, Redis, MariaDB, S3, the four
stage processes) is the real stack; the deaths are counted only in infer's consumer group's
commit metadata.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from schemas.errors import ErrorCode
from schemas.events import InferEvent
from services.common.settings import CommonSettings
from tests.conftest import solid_image
from tests.waits import event_set
from tests.stack import LoopbackOcrServer, db_rows, is_red_image, namespaced_pipeline
from tests.topics import dlq_events, lag, partition_of, topic_records

pytestmark = pytest.mark.stack

ANSWER = "BEHIND THE POISON 4242"


@pytest.fixture(scope="module")
def wedging():
    """Answers every image with ``ANSWER``, except a red one: that request is held unanswered."""
    srv = LoopbackOcrServer(ANSWER, hangs_on=is_red_image)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def poison_pipeline(wedging, tmp_path_factory):
    extra = {
        "OCRSTREAM_ENGINE_KIND": "openai",
        "OCRSTREAM_OPENAI_BASE_URL": wedging.url,
        "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60",
        "OCRSTREAM_RETRY_MAX_BACKOFF_S": "2",
        # a killed member leaves the group after its session timeout (the broker's minimum: 6 s)
        "OCRSTREAM_KAFKA__SESSION_TIMEOUT_MS": "6000",
        "OCRSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS": "1000",
    }
    with namespaced_pipeline(tmp_path_factory.mktemp("poison-restart-logs"), extra) as p:
        yield p


async def _infer_records(s: CommonSettings, partition: int) -> list[tuple[int, InferEvent]]:
    """``(offset, event)`` of every record on one partition of ``ocr.infer-interactive`` (single images' lane)."""
    return [(r.offset, InferEvent.model_validate_json(r.value))
            for r in await topic_records(s.topics.infer_interactive, partition)]


async def test_kill_infer_twice_while_it_holds_a_poison_record(poison_pipeline, wedging):
    p = poison_pipeline
    s = CommonSettings()
    started = time.monotonic()
    poison = solid_image((230, 20, 20))
    poison_run = asyncio.create_task(p.run([(poison, "poison.png")], timeout=600))
    await event_set(wedging.holding, "infer to hold the poison image")
    # submitted while infer holds the poison: behind it on ocr.infer, three on its own partition
    whites = (solid_image((255, 255, 255), size=(240 + i, 120)) for i in range(400))
    same = [w for w in whites if partition_of(w) == partition_of(poison)][:3]
    behind = [(img, f"behind-{i}.png") for i, img in enumerate(same + [solid_image((250, 250, 250), size=(300 + i, 99))
                                                                        for i in range(3)])]
    behind_run = asyncio.create_task(p.run(behind, timeout=600))
    for death in (1, 2):
        [infer] = [st for st in p.stages["infer"] if st.proc.poll() is None]
        assert p.stop(infer, sig=signal.SIGKILL) == -signal.SIGKILL
        wedging.holding.clear()
        await asyncio.to_thread(p.start, "infer")
        if death == 1:  # after one death it is handled again, alone, and wedges infer again
            await event_set(wedging.holding, "infer to hold the poison image again")
    [bad] = await poison_run
    assert bad.status == "error" and bad.error.code is ErrorCode.STAGE_CRASH, (bad.status, bad.error)
    assert bad.error.message == "infer: stage_crash: in progress when the infer stage died 2 times"
    for doc in await behind_run:
        assert doc.status == "ok" and doc.text == ANSWER, (doc.status, doc.error, doc.text)
    assert wedging.held == 2  # the third infer never sent it to the engine
    [dlq] = await dlq_events()
    assert (dlq.stage, dlq.topic, dlq.request_id) == ("infer", s.topics.infer_interactive, bad.request_id)
    assert dlq.partition == partition_of(poison)
    later = {ev.request.request_id for off, ev in await _infer_records(s, dlq.partition) if off > dlq.offset}
    assert len(later) == 3 and later <= {d.request_id for d in await behind_run}
    assert dlq.error_code is ErrorCode.STAGE_CRASH and dlq.attempts == 2
    assert "in progress when the infer stage died 2 times" in dlq.reason
    [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", bad.request_id)
    assert row == {"status": "error", "error_code": "stage_crash"}
    assert await lag(p.env["OCRSTREAM_INFER_GROUP_ID"], s.topics.infer_interactive) == dict.fromkeys(range(4), 0)
    assert time.monotonic() - started < 300
