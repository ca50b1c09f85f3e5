"""The sink's field index entry of an ``extract`` result (services/sink/handler.py ``_index_fields``,
pure logic over an object store in memory): written for a whole answer; for an answer cut short,
never written, and an entry an earlier whole answer of the same key left is removed, since the
document it points at is now the cut one (dedup only HEADs it)."""

from __future__ import annotations

import asyncio

from schemas.events import OcrOutput, RequestEvent, ResultEvent
from schemas.keys import field_family_id, field_index_key
from schemas.reading import WARNING_TRUNCATED_MAX_TOKENS
from schemas.tasks import TaskParams
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.sink.handler import SinkHandler
from services.sink.settings import SinkSettings

S = SinkSettings()
SHA = "ab" * 32
PARAMS = TaskParams(fields=("total", "date", "seller"))


class MemoryStore:
    """The two object calls the field index makes, on a dict."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    async def put(self, key: str, data: bytes, content_type: str = "") -> None:
        self.objects[key] = data

    async def delete(self, key: str) -> None:
        self.objects.pop(key, None)


def test_a_cut_answer_stored_over_a_whole_one_takes_its_index_entry_away():
    store = MemoryStore()
    sink = SinkHandler(S, store=store, db=None, cache=None, telemetry=Telemetry("sink", TelemetrySettings()))
    gen = S.generation("extract", PARAMS)
    key = S.cache_key_of(SHA, gen, None)
    entry = field_index_key(key, field_family_id(gen), 3)
    req = RequestEvent(request_id="r1", content_sha256=SHA, image_uri=f"s3://b/images/{SHA}", size_bytes=10,
                       task="extract", task_params=PARAMS)
    ev = ResultEvent(request=req, cache_key=key, status="ok")
    whole = OcrOutput(cache_key=key, content_sha256=SHA, engine="e", model="m", model_revision="r", task="extract",
                      task_params=PARAMS, fields={"total": "9", "date": "1 May", "seller": "ACME"}, text="", pages=[],
                      lines=[])
    asyncio.run(sink._index_fields(ev, whole))
    assert store.objects == {entry: b'{"cache_key":"%s","fields":["date","seller","total"]}' % key.encode()}
    # the key computed again (its S3 tier missed, or after a purge), this time cut at max_tokens
    cut = whole.model_copy(update={"fields": {"total": "9", "date": None, "seller": None},
                                   "warnings": [WARNING_TRUNCATED_MAX_TOKENS]})
    asyncio.run(sink._index_fields(ev, cut))
    assert store.objects == {}
