"""The pipeline end to end on the real stack: samples, repeats, bad inputs (issue: pipeline)."""

from __future__ import annotations

import asyncio
import json

import orjson

from schemas.errors import ErrorCode
from schemas.events import OcrOutput
from schemas.tasks import ENGINE_TASKS
from services.common.s3 import ObjectStore
from services.common.settings import CommonSettings
from services.infer.textlines import cer
from tests.conftest import CASES, REPO, SAMPLES, text_image
from tests.stack import db_rows

CER_BOUNDS = json.loads((REPO / "tests" / "data" / "cer_bounds.json").read_text())
BOUNDS = CER_BOUNDS["images"]

# the default OCRSTREAM_TASKS is every task of the registry; a refusal lists those the session's CPU engine runs
RUNNABLE_TASKS = ", ".join(ENGINE_TASKS["rapidocr"])


async def test_samples_complete_with_bounded_cer_and_agree_everywhere(pipeline, manifest):
    """Every sample at most the raw engine's CER + 0.01 (``bench/engine_cer.py`` measured the raw
    engine: RapidOCR called directly, the better of its own line order and ocrstream's), and the
    mean over the samples at most the raw engine's mean."""
    assert CER_BOUNDS["margin"] == 0.01 and set(BOUNDS) == {m["file"] for m in manifest}
    items = [((SAMPLES / m["file"]).read_bytes(), m["file"]) for m in manifest]
    docs = await pipeline.run(items, timeout=600)
    store = ObjectStore(CommonSettings().s3)
    cers = []
    for m, doc in zip(manifest, docs):
        assert doc.status == "ok", (m["file"], doc.error)
        assert (doc.width, doc.height) == (m["width"], m["height"]), m["file"]
        got = cer("\n".join(m["lines"]), doc.text)
        cers.append(got)
        assert got <= BOUNDS[m["file"]]["bound"], f"{m['file']}: CER {got:.4f} > bound {BOUNDS[m['file']]}"
        for line in doc.lines:
            for x, y in line.box:
                assert 0 <= x <= doc.width and 0 <= y <= doc.height, (m["file"], line)
            assert 0 <= line.confidence <= 1
        # S3 document, MariaDB row and completion event agree
        output = OcrOutput.model_validate_json(await store.get_uri(doc.result_uri))
        assert [l.text for l in output.lines] == [l.text for l in doc.lines]
        [row] = db_rows("SELECT * FROM requests WHERE request_id = %s", doc.request_id)
        assert row["status"] == "ok" and row["line_count"] == len(doc.lines)
        assert row["content_sha256"] == doc.content_sha256 and row["result_uri"] == doc.result_uri
        assert orjson.loads(row["document_json"])["lines"] == orjson.loads(doc.model_dump_json())["lines"]
        [res] = db_rows("SELECT * FROM results WHERE cache_key = %s", doc.cache_key)
        assert res["text"] == doc.text
        for step in ("queue_ingest", "ingest", "dedup", "fetch", "decode", "inference", "write", "total"):
            assert step in doc.timings_ms, (step, doc.timings_ms)
    mean = sum(cers) / len(cers)
    assert mean <= CER_BOUNDS["raw_mean"], f"mean CER {mean:.4f} > the raw engine's {CER_BOUNDS['raw_mean']}"


async def test_repeat_is_a_cache_hit_without_engine_call(pipeline):
    data = text_image(["REPEAT ME 4242", "SECOND LINE 77"])
    [first] = await pipeline.run([(data, "repeat.png")])
    assert first.status == "ok" and not first.cache_hit
    assert [l.text for l in first.lines] == ["REPEAT ME 4242", "SECOND LINE 77"]
    calls = pipeline.engine_calls()
    [again] = await pipeline.run([(data, "repeat-again.png")])
    assert again.cache_hit and again.status == "ok"
    assert again.request_id != first.request_id
    assert [l.model_dump() for l in again.lines] == [l.model_dump() for l in first.lines]
    assert pipeline.engine_calls() == calls


async def test_bad_inputs_get_specific_errors_and_the_next_image_goes_through(pipeline):
    truncated = (CASES / "img17_truncated.jpg").read_bytes()
    items = [
        (b"", "empty.jpg"),
        (truncated, "truncated.jpg"),
        (b"just some text, not an image\n" * 20, "notes.png"),
        (text_image(["AFTER THE BAD ONES 123"]), "good.png"),
    ]
    docs = await pipeline.run(items)
    assert [d.status for d in docs] == ["error", "error", "error", "ok"]
    assert [d.error.code for d in docs[:3]] == [ErrorCode.EMPTY_INPUT, ErrorCode.CORRUPT_IMAGE,
                                                ErrorCode.UNSUPPORTED_FORMAT]
    assert docs[3].text == "AFTER THE BAD ONES 123"
    for d in docs[:3]:
        [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", d.request_id)
        assert row == {"status": "error", "error_code": d.error.code.value}


async def test_a_task_the_deployment_does_not_list_is_refused_and_the_next_goes_through(pipeline):
    """A made-up task would be a cache generation of its own (and a Redis record of it) for an
    engine that does the same thing anyway: ingest refuses it before reading the image."""
    calls = pipeline.engine_calls()
    [refused] = await pipeline.run([(text_image(["MADE UP TASK 41"]), "layout.png")], task="layout")
    assert refused.status == "error" and refused.error.code is ErrorCode.INVALID_REQUEST
    assert refused.error.message == f"task 'layout' is not one of this deployment's tasks: {RUNNABLE_TASKS}"
    assert refused.task == "layout" and refused.content_sha256 is None and pipeline.engine_calls() == calls
    [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", refused.request_id)
    assert row == {"status": "error", "error_code": "invalid_request"}
    [ok] = await pipeline.run([(text_image(["LISTED TASK 42"]), "ocr.png")], task="ocr")
    assert ok.status == "ok" and ok.text == "LISTED TASK 42" and pipeline.engine_calls() == calls + 1
    assert "layout" not in _generation_tasks()


async def test_bad_task_parameters_end_invalid_request_with_the_reason_and_the_next_goes_through(pipeline):
    """An ``extract`` naming no fields, or 51, or a ``translate`` to a language not on the list:
    ingest ends each ``invalid_request`` saying why, before its image is read (no engine call,
    no generation of its own); the next image still completes."""
    from schemas.tasks import TaskParams

    calls = pipeline.engine_calls()
    cases = [("extract", None, "task 'extract' needs fields"),
             ("extract", TaskParams(fields=tuple(f"f{i}" for i in range(51))), "fields: at most 50 fields (51 given)"),
             ("translate", TaskParams(target_lang="xx"), "target_lang 'xx' is not one of: en, zh"),
             ("ocr", TaskParams(fields=("total",)), "task 'ocr' takes no fields")]
    for i, (task, params, why) in enumerate(cases):
        [refused] = await pipeline.run([(text_image([f"BAD PARAMS {i}"]), "bad.png")], task=task, task_params=params)
        assert refused.status == "error" and refused.error.code is ErrorCode.INVALID_REQUEST, (task, refused.error)
        assert why in refused.error.message and refused.content_sha256 is None and refused.task == task
        [row] = db_rows("SELECT status, error_code FROM requests WHERE request_id = %s", refused.request_id)
        assert row == {"status": "error", "error_code": "invalid_request"}
    [ok] = await pipeline.run([(text_image(["AFTER BAD PARAMS 44"]), "ok.png")])
    assert ok.status == "ok" and ok.text == "AFTER BAD PARAMS 44" and pipeline.engine_calls() == calls + 1


def _generation_tasks() -> set[str]:
    """Tasks of the cache generations dedup has registered in this namespace's Redis."""
    import redis

    s = CommonSettings()
    gens = redis.Redis.from_url(s.redis.url).hgetall(f"{s.redis.key_prefix}:gens")
    return {orjson.loads(raw)["task"] for raw in gens.values()}


async def test_dedup_refuses_an_unlisted_task_that_got_past_an_ingest_with_other_settings(pipeline):
    """In a rolling upgrade an ingest or door with other settings can still publish a request
    naming a task this deployment does not list: dedup refuses it too, before any Redis call, and
    the request still gets its row (a task longer than the column included)."""
    import hashlib
    import uuid

    from schemas.events import RequestEvent
    from schemas.keys import image_object_key
    from services.common.results.completions import CompletionWatcher
    from services.common.codec import dumps
    from services.common.kafka import make_producer

    s = CommonSettings()
    data = text_image(["PAST INGEST 43"])
    sha = hashlib.sha256(data).hexdigest()
    uri = ObjectStore(s.s3).uri(image_object_key(sha))  # never read: refused before anything looks at it
    tasks = {f"past-ingest-{uuid.uuid4().hex[:8]}": task for task in ("layout", "x" * 200)}
    calls = pipeline.engine_calls()
    watcher = CompletionWatcher(s)
    await watcher.start()
    producer = make_producer(s.kafka, "test-past-ingest")
    await producer.start()
    docs = {}
    try:
        for rid, task in tasks.items():
            req = RequestEvent(request_id=rid, content_sha256=sha, image_uri=uri, size_bytes=len(data),
                               format="png", task=task)
            await producer.send_and_wait(s.topics.requests, dumps(req), key=sha.encode())

        async def collect():
            async for ev in watcher.completions(set(tasks)):
                docs[ev.request_id] = ev.result

        await asyncio.wait_for(collect(), 120)
    finally:
        await producer.stop()
        await watcher.stop()
    for rid, task in tasks.items():
        doc = docs[rid]
        assert doc.status == "error" and doc.error.code is ErrorCode.INVALID_REQUEST
        assert doc.error.message == f"task {task[:64]!r} is not one of this deployment's tasks: {RUNNABLE_TASKS}"
        assert "dedup" in doc.timings_ms and doc.task == task
        [row] = db_rows("SELECT status, error_code, task FROM requests WHERE request_id = %s", rid)
        assert row == {"status": "error", "error_code": "invalid_request", "task": task[:64]}
    assert pipeline.engine_calls() == calls
    assert not {"layout", "x" * 200} & _generation_tasks()
