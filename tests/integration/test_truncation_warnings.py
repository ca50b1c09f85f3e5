"""A page the engine flags as truncated stays flagged end to end, on the real stack.

The VLM engines put ``truncated_max_tokens`` / ``truncated_repetition`` on a page whose
generation was cut. Here the pipeline's own infer process is stopped and the test plays the
infer stage: it consumes the real ``ocr.infer-interactive`` record, runs the real ``InferHandler`` (real
S3 fetch and decode) with an engine that flags every page, and produces its result to
``ocr.results``. The sink, S3, MariaDB and the dedup cache are the real ones: the warning must
reach the completion, the stored output, and the next request's cache hit.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from schemas.events import OcrOutput
from services.common.kafka import make_consumer, make_producer
from services.common.records import RecordParser
from services.common.s3 import ObjectStore
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.infer.textlines import Segment
from services.infer.engines.base import EngineOutput, OcrEngine
from services.infer.handler import InferHandler
from services.infer.settings import InferSettings
from tests.conftest import text_image
from tests.stack import namespaced_pipeline

pytestmark = pytest.mark.stack


class CutEngine(OcrEngine):
    """One line per image, flagged as cut at the token cap."""

    name = "cut"
    max_side = 4000

    async def start(self) -> None:
        self.ready = True

    async def page(self, image, task, timeout_s, lane="bulk"):
        return EngineOutput([Segment([[10, 10], [200, 10], [200, 40], [10, 40]], "CUT HERE", 1.0)], 1.0,
                            ("truncated_max_tokens",))


@pytest.fixture(scope="module")
def no_infer(stack_env, tmp_path_factory):
    """A pipeline of its own with its infer process stopped (the test plays infer)."""
    with namespaced_pipeline(tmp_path_factory.mktemp("warn-logs"), partitions=1) as p:
        for st in p.stages["infer"]:
            p.stop(st)
        yield p


async def play_infer(n: int) -> None:
    """Consume ``n`` records from infer's topics (a single image: ``ocr.infer-interactive``), run
    InferHandler with CutEngine, produce the results."""
    s = InferSettings()
    consumer = make_consumer(s.kafka, [s.topics.infer_interactive, s.topics.infer], f"warn-test-{uuid.uuid4().hex[:6]}",
                             "warn-test")
    producer = make_producer(s.kafka, "warn-test")
    await consumer.start()
    await producer.start()
    store = ObjectStore(s.s3)
    try:
        records = []
        while len(records) < n:
            for recs in (await consumer.getmany(timeout_ms=1000)).values():
                records.extend(recs)
        handler = InferHandler(s, store, CutEngine(), Telemetry("infer", TelemetrySettings()))
        decode = RecordParser(handler.consumes())  # as the runner does
        for o in await handler.handle([decode(r) for r in records]):
            await producer.send_and_wait(o.topic, o.value, key=o.key.encode() if o.key else None, headers=o.headers)
    finally:
        await consumer.stop()
        await producer.stop()


async def test_truncation_warning_reaches_the_completion_the_stored_output_and_cache_hits(no_infer):
    img = text_image([f"TRUNCATED {uuid.uuid4().hex[:6].upper()}"])
    docs, _ = await asyncio.gather(no_infer.run([(img, "cut.png")], timeout=120), play_infer(1))
    (doc,) = docs
    assert doc.status == "ok" and not doc.cache_hit
    assert [ln.text for ln in doc.lines] == ["CUT HERE"]
    assert doc.warnings == ["truncated_max_tokens"]

    stored = OcrOutput.model_validate_json(await ObjectStore(InferSettings().s3).get_uri(doc.result_uri))
    assert stored.warnings == ["truncated_max_tokens"] and [ln.text for ln in stored.lines] == ["CUT HERE"]

    # the same bytes again: a cache hit (no infer involved) carries the stored output's warning
    (again,) = await no_infer.run([(img, "cut-again.png")], timeout=120)
    assert again.cache_hit and again.status == "ok"
    assert again.warnings == ["truncated_max_tokens"] and [ln.text for ln in again.lines] == ["CUT HERE"]
