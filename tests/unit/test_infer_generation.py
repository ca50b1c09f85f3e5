"""Infer's generation check: a result is never stored under a key of another generation (rolling upgrade)."""

from __future__ import annotations

import asyncio

import orjson
from aiokafka import ConsumerRecord

from schemas.events import InferEvent, RequestEvent, ResultEvent
from schemas.keys import cache_key
from services.common.codec import dumps
from services.common.records import RecordParser
from services.common.cache.keys import EngineIdentity
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.infer.handler import InferHandler, generation_matches
from services.infer.settings import InferSettings
from tests.unit.test_infer_batch import MemoryStore, ScriptedEngine, png

SHA = "cd" + "1" * 62


def test_decision_matches_only_the_own_generation():
    own = InferSettings().generation("ocr")
    assert generation_matches(cache_key(SHA, own), own)
    for other in (InferSettings(engine=EngineIdentity(model_revision="rev-2")).generation("ocr"),
                  InferSettings(vllm_prompt="x", engine_kind="vllm").generation("ocr"),
                  InferSettings().generation("table")):
        assert not generation_matches(cache_key(SHA, other), own)
    assert not generation_matches("not-a-key", own)
    assert generation_matches(None, own)  # no key: nothing would be stored


def _results(settings: InferSettings, key_settings: InferSettings) -> tuple[list[ResultEvent], Telemetry]:
    telemetry = Telemetry("infer", TelemetrySettings())
    handler = InferHandler(settings, MemoryStore({"s3://b/i": png(300, 100)}), ScriptedEngine(), telemetry)
    ev = InferEvent(request=RequestEvent(request_id="r1", content_sha256=SHA, image_uri="s3://b/i"),
                    cache_key=cache_key(SHA, key_settings.generation("ocr")))
    rec = RecordParser(handler.consumes())(ConsumerRecord(settings.topics.infer, 0, 0, 0, 0, None, dumps(ev), None, 0, 0, []))
    out = asyncio.run(handler.handle([rec]))
    return [ResultEvent.model_validate(orjson.loads(o.value)) for o in out], telemetry


def _mismatches(telemetry: Telemetry) -> float:
    return telemetry.cache.labels("infer", "generation_mismatch", "")._value.get()


def test_a_key_of_another_generation_is_computed_but_marked_not_cacheable():
    new = InferSettings(engine=EngineIdentity(model_revision="rev-2"))
    [res], tel = _results(InferSettings(), key_settings=new)  # an old infer gets a new dedup's key
    assert res.status == "ok" and res.lines[0].text == "TEXT 100x300"  # the request is still answered
    assert res.cacheable is False and res.cache_key == cache_key(SHA, new.generation("ocr"))
    assert res.model_revision == "rapidocr-3.10.0"  # labelled with what really computed it
    assert _mismatches(tel) == 1


def test_a_key_of_the_own_generation_is_cacheable():
    [res], tel = _results(InferSettings(), key_settings=InferSettings())
    assert res.status == "ok" and res.cacheable is True and _mismatches(tel) == 0
