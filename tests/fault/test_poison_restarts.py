"""Kill infer twice while it holds a poison record: the record goes to the DLQ and its request
ends with an error (issue 20, item 2), and the records behind it on its partition complete.

Infer runs its ``openai`` engine against a small OpenAI-compatible server on loopback (a thread
of this process) that never answers for one image (red): a stand-in for a record that wedges
its stage so that only killing the process ends it. The test SIGKILLs infer each time the server
holds that image, and starts it again. Everything else (Kafka, Redis, MariaDB, S3, the four
stage processes) is the real stack; the deaths are counted only in infer's consumer group's
commit metadata.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import signal
import threading
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.partitioner import murmur2
from PIL import Image

from schemas.errors import ErrorCode
from schemas.events import DlqEvent, InferEvent
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings
from tests.stack import LoopbackOcrServer, db_rows, is_red_image, namespaced_pipeline

pytestmark = pytest.mark.stack

ANSWER = "BEHIND THE POISON 4242"


def solid(rgb: tuple[int, int, int], size=(240, 120)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, "PNG")
    return buf.getvalue()


def partition_of(image: bytes, partitions: int = 4) -> int:
    """The ``ocr.infer`` partition of an image: its key is the content SHA-256 (hex), placed by
    the producer's default partitioner (murmur2, as Kafka's Java client)."""
    return (murmur2(hashlib.sha256(image).hexdigest().encode()) & 0x7FFFFFFF) % partitions


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


async def _wait(event: threading.Event, what: str, bound_s: float = 120) -> None:
    if not await asyncio.to_thread(event.wait, bound_s):
        raise AssertionError(f"timed out waiting for {what}")


async def _dlq(s: CommonSettings, bound_s: float = 60) -> list[DlqEvent]:
    consumer = make_consumer(s.kafka, [], None, "test-poison-restarts-dlq")
    await consumer.start()
    try:
        tps = [TopicPartition(s.topics.dlq, n) for n in consumer.partitions_for_topic(s.topics.dlq) or set()]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: list[DlqEvent] = []
        deadline = time.monotonic() + bound_s
        while not out and time.monotonic() < deadline:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                out += [DlqEvent.model_validate_json(r.value) for r in recs]
        return out
    finally:
        await consumer.stop()


async def _infer_records(s: CommonSettings, partition: int) -> list[tuple[int, InferEvent]]:
    """``(offset, event)`` of every record on one partition of ``ocr.infer``."""
    consumer = make_consumer(s.kafka, [], None, "test-poison-restarts-infer")
    await consumer.start()
    try:
        tp = TopicPartition(s.topics.infer_interactive, partition)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        out: list[tuple[int, InferEvent]] = []
        while await consumer.position(tp) < end:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                out += [(r.offset, InferEvent.model_validate_json(r.value)) for r in recs]
        return out
    finally:
        await consumer.stop()


async def _lag(s: CommonSettings, group: str, topic: str, bound_s: float = 120) -> dict[int, int]:
    """``group``'s lag per partition of ``topic`` once every one is 0 (or at ``bound_s``)."""
    consumer = make_consumer(s.kafka, [], group, "test-poison-restarts-lag")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, n) for n in consumer.partitions_for_topic(topic) or set()]
        lag: dict[int, int] = {}
        for _ in range(int(bound_s / 0.5)):
            end = await consumer.end_offsets(tps)
            lag = {tp.partition: end[tp] - ((await consumer.committed(tp)) or 0) for tp in tps}
            if not any(lag.values()):
                break
            await asyncio.sleep(0.5)
        return lag
    finally:
        await consumer.stop()


async def test_kill_infer_twice_while_it_holds_a_poison_record(poison_pipeline, wedging):
    p = poison_pipeline
    s = CommonSettings()
    started = time.monotonic()
    poison = solid((230, 20, 20))
    poison_run = asyncio.create_task(p.run([(poison, "poison.png")], timeout=600))
    await _wait(wedging.holding, "infer to hold the poison image")
    # submitted while infer holds the poison: behind it on ocr.infer, three on its own partition
    whites = (solid((255, 255, 255), size=(240 + i, 120)) for i in range(400))
    same = [w for w in whites if partition_of(w) == partition_of(poison)][:3]
    behind = [(img, f"behind-{i}.png") for i, img in enumerate(same + [solid((250, 250, 250), size=(300 + i, 99))
                                                                        for i in range(3)])]
    behind_run = asyncio.create_task(p.run(behind, timeout=600))
    for death in (1, 2):
        [infer] = [st for st in p.stages["infer"] if st.proc.poll() is None]
        assert p.stop(infer, sig=signal.SIGKILL) == -signal.SIGKILL
        wedging.holding.clear()
        await asyncio.to_thread(p.start, "infer")
        if death == 1:  # after one death it is handled again, alone, and wedges infer again
            await _wait(wedging.holding, "infer to hold the poison image again")
    [bad] = await poison_run
    assert bad.status == "error" and bad.error.code is ErrorCode.STAGE_CRASH, (bad.status, bad.error)
    assert bad.error.message == "infer: stage_crash: in progress when the infer stage died 2 times"
    for doc in await behind_run:
        assert doc.status == "ok" and doc.text == ANSWER, (doc.status, doc.error, doc.text)
    assert wedging.held == 2  # the third infer never sent it to the engine
    [dlq] = await _dlq(s)
    assert (dlq.stage, dlq.topic, dlq.request_id) == ("infer", s.topics.infer_interactive, bad.request_id)
    assert dlq.partition == partition_of(poison)
    later = {ev.request.request_id for off, ev in await _infer_records(s, dlq.partition) if off > dlq.offset}
    assert len(later) == 3 and later <= {d.request_id for d in await behind_run}
    assert dlq.error_code is ErrorCode.STAGE_CRASH and dlq.attempts == 2
    assert "in progress when the infer stage died 2 times" in dlq.reason
    [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", bad.request_id)
    assert row == {"status": "error", "error_code": "stage_crash"}
    assert await _lag(s, p.env["OCRSTREAM_INFER_GROUP_ID"], s.topics.infer_interactive) == dict.fromkeys(range(4), 0)
    assert time.monotonic() - started < 300
