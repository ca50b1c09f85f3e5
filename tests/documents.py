"""Helpers of the document tests (tests/integration/test_documents.py, tests/fault/test_document_crashes.py,
tests/unit/test_documents.py): generated PDFs and TIFFs of printed pages, one TIFF page made
undecodable, submitting a document and awaiting its completions, reading S3."""

from __future__ import annotations

import asyncio
import io
import time

import boto3
from aiokafka import TopicPartition
from botocore.config import Config
from PIL import Image

from schemas.events import CompletedEvent
from schemas.ids import page_request_id
from services.cli.client import Submitter
from services.common.results.completions import CompletionWatcher
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings
from tests.conftest import text_image


def make_pdf(pages: list[Image.Image]) -> bytes:
    """A PDF of one raster page per image, at 200 dpi (ingest renders at 200 dpi: the same pixels)."""
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", save_all=True, append_images=pages[1:], resolution=200.0)
    return buf.getvalue()


def page_image(text: str, size: tuple[int, int] | None = None) -> Image.Image:
    """``text`` printed on a white page: square by default (RapidOCR's detector scales a page's
    short side up to 736 px, so a square page is about a third of the work of a 400 x 112 strip)."""
    img = Image.open(io.BytesIO(text_image([text]))).convert("L")
    page = Image.new("L", size or (img.width, img.width), 255)
    page.paste(img, (0, 0))
    return page


def tiff_with_broken_page(pages: list[Image.Image], broken: int) -> bytes:
    """A multi-page TIFF (Deflate-compressed strips) of ``pages`` whose page ``broken`` (1-based)
    cannot be decoded: every byte of its strip data is XORed with 0x5A, so zlib refuses its header
    (Pillow: ``decoder error -2``). Its frame header is intact (the page count and sizes read as
    before) and every other page decodes."""
    buf = io.BytesIO()
    pages[0].save(buf, "TIFF", save_all=True, append_images=pages[1:], compression="tiff_adobe_deflate")
    data = bytearray(buf.getvalue())
    with Image.open(io.BytesIO(bytes(data))) as img:
        img.seek(broken - 1)
        spans = list(zip(img.tag_v2[273], img.tag_v2[279]))  # StripOffsets, StripByteCounts
    for offset, length in spans:
        data[offset:offset + length] = bytes(b ^ 0x5A for b in data[offset:offset + length])
    return bytes(data)


async def submit_and_watch(data: bytes, name: str, timeout: float = 300, pages: int = 0,
                           request_id: str | None = None) -> tuple[str, list[CompletedEvent]]:
    """Submit one file; every completion on ``ocr.completed`` until its own and those of its first
    ``pages`` pages have come (pages are keyed by their own ids: other partitions, read in any
    order relative to the document's), in arrival order, the document's last."""
    s = CommonSettings()
    watcher, submitter = CompletionWatcher(s), Submitter(s)
    await watcher.start()
    await submitter.start()
    try:
        rid = await submitter.submit_bytes(data, filename=name, source="test", request_id=request_id)
    finally:
        await submitter.stop()
    seen: list[CompletedEvent] = []
    waiting = {rid, *(page_request_id(rid, n) for n in range(1, pages + 1))}

    async def collect():
        async for ev in watcher.completions_forever():
            seen.append(ev)
            waiting.discard(ev.request_id)
            if not waiting or (ev.request_id == rid and ev.result.page_count is None):
                return  # all in, or it ended as no document (refused): no page will come

    try:
        await asyncio.wait_for(collect(), timeout)
    finally:
        await watcher.stop()
    [own] = [ev for ev in seen if ev.request_id == rid]
    return rid, [ev for ev in seen if ev.request_id != rid] + [own]


def s3_client():
    """A boto3 S3 client for the settings' store (the namespace's bucket: ``CommonSettings().s3.bucket``)."""
    cfg = CommonSettings().s3
    return boto3.client("s3", endpoint_url=cfg.endpoint_url, aws_access_key_id=cfg.access_key,
                        aws_secret_access_key=cfg.secret_key.get_secret_value(), region_name=cfg.region,
                        config=Config(s3={"addressing_style": "path"}))


def s3_get(key: str) -> bytes:
    """The bytes of object ``key`` in the settings' bucket."""
    return s3_client().get_object(Bucket=CommonSettings().s3.bucket, Key=key)["Body"].read()


def s3_count(prefix: str) -> int:
    """How many objects of the settings' bucket start with ``prefix``."""
    return sum(len(page.get("Contents", [])) for page in s3_client().get_paginator("list_objects_v2").paginate(
        Bucket=CommonSettings().s3.bucket, Prefix=prefix))


async def completions_of(document_id: str, page_count: int) -> dict[str, list[bytes]]:
    """Every ``ocr.completed`` record value (replays included) of the document and its pages, per
    request id, read from the topic's start up to its current end."""
    s = CommonSettings()
    ids = {document_id, *(page_request_id(document_id, n) for n in range(1, page_count + 1))}
    consumer = make_consumer(s.kafka, [], None, client_id="test-documents-reader")
    await consumer.start()
    out: dict[str, list[bytes]] = {}
    try:
        tps = [TopicPartition(s.topics.completed, n) for n in consumer.partitions_for_topic(s.topics.completed) or set()]
        assert tps, f"no partitions known for {s.topics.completed}"
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for r in recs:
                    rid = CompletedEvent.model_validate_json(r.value).request_id
                    if rid in ids:
                        out.setdefault(rid, []).append(r.value)
    finally:
        await consumer.stop()
    return out


async def drained(group: str, topic: str, bound_s: float = 120) -> None:
    """Wait until consumer group ``group`` has committed the end of every partition of ``topic``
    (every record there handled and its output produced: no replay is left to come).

    Raises:
        AssertionError: not within ``bound_s`` seconds.
    """
    consumer = make_consumer(CommonSettings().kafka, [], group, "test-documents-offsets")  # never joins
    await consumer.start()
    try:
        tps = [TopicPartition(topic, n) for n in consumer.partitions_for_topic(topic) or set()]
        assert tps, f"no partitions known for {topic}"
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            end = await consumer.end_offsets(tps)
            committed = {tp: (await consumer.committed(tp)) or 0 for tp in tps}
            if all(committed[tp] >= end[tp] for tp in tps):
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"{group} did not commit the end of {topic} in {bound_s}s")
    finally:
        await consumer.stop()
