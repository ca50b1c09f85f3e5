"""Dedup's near-duplicate path with in-memory store, cache and index (no Kafka, no Redis, no S3)."""

from __future__ import annotations

import asyncio
import hashlib
import io

import orjson
from aiokafka import ConsumerRecord
from PIL import Image

from schemas.errors import ErrorCode
from schemas.events import InferEvent, OcrOutput, RequestEvent, ResultEvent, SettledEvent
from schemas.keys import cache_key, image_object_key
from schemas.reading import Line, Page
from services.common.cache.entries import CacheEntry, CacheUnavailable
from services.common.errors import OcrError
from services.common.codec import dumps
from services.common.records import RecordParser
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from services.dedup.handler import DedupHandler
from services.common.images.decoding import DecoderPool
from services.dedup.near import NearDupLookup
from services.dedup.settings import DedupSettings
from tests.conftest import text_image

S = DedupSettings(near_dup={"enabled": True})
GEN = S.generation("ocr")
BUCKET = "bkt"


class MemoryStore:
    """The ObjectStore reads the lookup makes, over a dict keyed by object key."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    async def get(self, key: str, bucket: str | None = None, max_bytes: int | None = None) -> bytes:
        if key not in self.objects:
            raise OcrError(ErrorCode.MISSING_OBJECT, key)
        return self.objects[key]

    async def get_uri(self, uri: str, max_bytes: int | None = None) -> bytes:
        return await self.get(uri.removeprefix(f"s3://{BUCKET}/"))


class MemoryCache:
    """Entries from a dict (an exact GET misses unless the test stored one); ``down`` makes every call fail."""

    def __init__(self):
        self.entries: dict[str, CacheEntry] = {}
        self.down = False

    async def register_generation(self, gen) -> None:
        if self.down:
            raise CacheUnavailable("down")

    async def get_with_ttl(self, key):
        if self.down:
            raise CacheUnavailable("down")
        return self.entries.get(key), None

    async def get(self, key: str) -> CacheEntry | None:
        if self.down:
            raise CacheUnavailable("down")
        return self.entries.get(key)


class MemoryIndex:
    """pHash index over a list (every entry is a candidate; the lookup filters by distance)."""

    def __init__(self):
        self.items: list[tuple[str, int]] = []

        self.spaces: list[str] = []  # the index namespace of each item (gen_id, or gen_id:scope)
        self.down = False

    async def add(self, gen_id: str, sha: str, h: int) -> None:
        self.items.append((sha, h))
        self.spaces.append(gen_id)

    async def candidates(self, gen_id, h, max_hamming, exclude=None):
        if self.down:
            raise CacheUnavailable("down")
        return sorted(((h ^ x).bit_count(), s) for (s, x), space in zip(self.items, self.spaces)
                      if space == gen_id and s != exclude and (h ^ x).bit_count() <= max_hamming)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def setup(settings: DedupSettings = S):
    store, cache, index = MemoryStore(), MemoryCache(), MemoryIndex()
    near = NearDupLookup(settings.near_dup, DecoderPool(settings.decode, settings.limits), store, cache, index=index)
    handler = DedupHandler(settings, cache, Telemetry("dedup", TelemetrySettings()), near=near)
    return handler, store, cache, index


def put_image(store: MemoryStore, data: bytes) -> RequestEvent:
    h = sha(data)
    store.objects[image_object_key(h)] = data
    img = Image.open(io.BytesIO(data))
    return RequestEvent(request_id=f"req-{h[:8]}", content_sha256=h, image_uri=f"s3://{BUCKET}/{image_object_key(h)}",
                        size_bytes=len(data), width=img.width, height=img.height)


def handle(handler: DedupHandler, req: RequestEvent):
    rec = RecordParser(handler.consumes())(ConsumerRecord(handler.s.topics.requests, 0, 0, 0, 0, None, dumps(req), None, 0, 0, []))
    [out] = asyncio.run(handler.handle([rec]))
    return out.topic, orjson.loads(out.value)


def done(handler: DedupHandler, store: MemoryStore, cache: MemoryCache, req: RequestEvent, text: str,
         settings: DedupSettings = S) -> None:
    """Store a result for ``req`` as the sink would (under its key in its cache scope: one line
    across the top half), and hand dedup the sink's settlement of it (which indexes the image)."""
    key = settings.cache_key_of(req.content_sha256, GEN, req.api_key_id)
    w, h = req.width, req.height
    out = OcrOutput(cache_key=key, content_sha256=req.content_sha256, engine=GEN.engine, model=GEN.model,
                    model_revision=GEN.model_revision, task="ocr", pages=[Page(index=1, width=w, height=h)],
                    lines=[Line(text=text, box=[[0, 0], [w, 0], [w, h / 2], [0, h / 2]], confidence=0.9)], text=text)
    store.objects[f"results/{req.content_sha256}.json"] = dumps(out)
    cache.entries[key] = CacheEntry(f"s3://{BUCKET}/results/{req.content_sha256}.json", 1, len(text), 0)
    settled = SettledEvent(cache_key=key, content_sha256=req.content_sha256, request_id=req.request_id, status="ok",
                           result_uri=f"s3://{BUCKET}/results/{req.content_sha256}.json")
    rec = RecordParser(handler.consumes())(ConsumerRecord(settings.topics.requests, 0, 0, 0, 0, None, dumps(settled), None,
                                                     0, 0, []))
    assert asyncio.run(handler.handle([rec])) == []  # nobody waited


def reencoded(data: bytes, scale: float = 1.0, quality: int = 70) -> bytes:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def test_rescaled_copy_is_a_near_hit_with_boxes_in_its_own_pixels():
    handler, store, cache, index = setup()
    original = text_image(["INVOICE 40213", "TOTAL 237.60"], size=30, width=700)
    first = put_image(store, original)
    topic, _ = handle(handler, first)
    assert topic == S.topics.infer and index.items == []  # not indexed before its result is settled
    done(handler, store, cache, first, "INVOICE 40213 TOTAL 237.60")
    assert [s for s, _ in index.items] == [first.content_sha256]
    copy = put_image(store, reencoded(original, scale=1.2))
    topic, value = handle(handler, copy)
    assert topic == S.topics.results
    ev = ResultEvent.model_validate(value)
    assert ev.cache_hit and ev.status == "ok" and ev.near_duplicate_of == first.content_sha256
    assert ev.cache_key == cache_key(copy.content_sha256, GEN)
    assert ev.pages == [Page(index=1, width=copy.width, height=copy.height)]
    [line] = ev.lines
    assert line.text == "INVOICE 40213 TOTAL 237.60"
    assert line.box[2] == [copy.width, round(copy.height / 2, 2)]
    assert len(index.items) == 1  # near hits are not indexed


def test_same_template_other_number_goes_to_inference():
    handler, store, cache, index = setup()
    first = put_image(store, text_image(["INVOICE 40213", "TOTAL 237.60"], size=30, width=700))
    handle(handler, first)
    done(handler, store, cache, first, "INVOICE 40213 TOTAL 237.60")
    other = put_image(store, text_image(["INVOICE 40218", "TOTAL 237.60"], size=30, width=700))
    topic, value = handle(handler, other)
    assert topic == S.topics.infer and InferEvent.model_validate(value).request.request_id == other.request_id
    done(handler, store, cache, other, "INVOICE 40218 TOTAL 237.60")
    assert len(index.items) == 2


def test_candidate_without_result_and_lookup_trouble_are_plain_misses():
    handler, store, cache, index = setup()
    original = text_image(["RECEIPT 77"], size=30)
    first = put_image(store, original)
    handle(handler, first)  # never completed: neither indexed nor cached
    copy = put_image(store, reencoded(original))
    assert handle(handler, copy)[0] == S.topics.infer
    gone = put_image(store, reencoded(original, quality=50))
    del store.objects[image_object_key(gone.content_sha256)]  # S3 trouble: a miss, inference reports it
    assert handle(handler, gone)[0] == S.topics.infer
    cache.down = index.down = True  # Redis down: the lookup finds no candidate
    assert handle(handler, put_image(store, reencoded(original, quality=60)))[0] == S.topics.infer


def test_disabled_by_default():
    assert DedupSettings().near_dup.enabled is False


def test_with_cache_scope_key_a_look_alike_is_answered_from_its_own_tenants_results_only():
    scoped = S.model_copy(update={"cache_scope": "key"})  # not from the environment: a session's pipeline may have set it
    handler, store, cache, index = setup(scoped)
    original = text_image(["LEDGER 7731", "NET 88.10"], size=30, width=700)
    first = put_image(store, original).model_copy(update={"api_key_id": "aaaaaaaaaaaa"})
    topic, value = handle(handler, first)
    assert topic == S.topics.infer and value["cache_key"] == f"{GEN.gen_id}:kaaaaaaaaaaaa:{first.content_sha256}"
    done(handler, store, cache, first, "LEDGER 7731 NET 88.10", scoped)
    assert index.spaces == [f"{GEN.gen_id}:kaaaaaaaaaaaa"]  # indexed in tenant A's scope
    copy = put_image(store, reencoded(original, scale=1.2))
    other = copy.model_copy(update={"api_key_id": "bbbbbbbbbbbb", "request_id": "req-other"})
    topic, value = handle(handler, other)  # tenant B: A's look-alike is no candidate
    assert topic == S.topics.infer and value["cache_key"] == f"{GEN.gen_id}:kbbbbbbbbbbbb:{copy.content_sha256}"
    mine = copy.model_copy(update={"api_key_id": "aaaaaaaaaaaa", "request_id": "req-mine"})
    topic, value = handle(handler, mine)  # tenant A: a near hit from its own result
    ev = ResultEvent.model_validate(value)
    assert topic == S.topics.results and ev.near_duplicate_of == first.content_sha256
    assert ev.cache_key == f"{GEN.gen_id}:kaaaaaaaaaaaa:{copy.content_sha256}"
