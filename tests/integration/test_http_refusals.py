"""What the real door refuses at once, and the words it says it with (issue 35, "the first hour"): a task
its engine cannot do (422 ``unsupported_task``), a query parameter a route does not take, a number out
of its range (400 ``invalid_request``), a file it does not read (415 ``unsupported_format`` listing the
formats it reads). The session's door runs the CPU engine, ``rapidocr``."""

from __future__ import annotations

import uuid

import httpx
import pytest

from schemas.tasks import TASKS, unsupported_task_message
from tests.conftest import text_image

pytestmark = pytest.mark.stack

PNG = {"Content-Type": "image/png"}
FORMATS = "PNG, JPEG, GIF, TIFF, BMP, WebP, PBM/PGM/PPM, JPEG 2000, AVIF or PDF"
SUBMIT_TAKES = "request_id, task, fields, to, target_lang, source, filename, callback_url, metadata, job_id, priority"


def _client(api) -> httpx.Client:
    return httpx.Client(base_url=api.url, timeout=60)


def _error(r: httpx.Response) -> tuple[int, str, str]:
    return r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]


def test_a_task_the_engine_cannot_do_is_refused_at_once_and_nothing_is_sent(api):
    png = text_image(["NOT ON THIS ENGINE"])
    with _client(api) as c:
        for task, params in [("extract", {"fields": "total"}), ("translate", {"to": "en"}), ("formula", {}),
                             ("chart", {}), ("extract", {})]:  # refused before its parameters are checked
            rid = f"unsupported-{uuid.uuid4().hex[:12]}"
            r = c.post("/v1/ocr", content=png, headers=PNG, params={"task": task, "request_id": rid, **params})
            assert _error(r) == (422, "unsupported_task", unsupported_task_message(task, "rapidocr")), task
            assert c.get(f"/v1/ocr/{rid}").status_code == 404  # never claimed nor sent: unknown
        message = unsupported_task_message("extract", "rapidocr")
        assert message == ("engine 'rapidocr' cannot do task 'extract'; engines that can: vllm, openai (to run one, "
                           "set OCRSTREAM_ENGINE__ENGINE and its model on every stage: docs/engines.md#choosing-an-engine)")
        r = c.post("/v1/ocr", files=[("file", ("a.png", png, "image/png"))], data={"task": "extract", "fields": "total"})
        assert _error(r) == (422, "unsupported_task", message)
        r = c.post("/v1/ocr/batch", files=[("files", ("a.png", png, "image/png"))] * 2,
                   params={"task": "extract", "fields": "total"})
        assert _error(r) == (422, "unsupported_task", message)
        r = c.post("/v1/jobs", json={"task": "extract", "fields": ["total"]})
        assert _error(r) == (422, "unsupported_task", message)
        # a task it can do still goes through
        r = c.post("/v1/ocr", content=png, headers=PNG, params={"task": "table"})
        assert r.status_code in (200, 202) and r.json()["status"] in ("pending", "ok"), r.text


def test_the_door_lists_its_tasks_and_why_the_others_do_not_run(api):
    r = httpx.get(f"{api.url}/v1/tasks", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert (body["engine"], body["default"]) == ("rapidocr", "ocr")
    assert [(t["name"], t["runs"], t["reason"]) for t in body["tasks"]] == [
        (name, name in ("ocr", "doc_parse", "table"),
         None if name in ("ocr", "doc_parse", "table") else unsupported_task_message(name, "rapidocr"))
        for name in TASKS]
    assert body["tasks"][-1] == {"name": "translate", "summary": TASKS["translate"].summary,
                                 "parameters": ["target_lang"], "engines": ["vllm", "openai"], "runs": False,
                                 "reason": unsupported_task_message("translate", "rapidocr")}
    # a task not in the registry: the list of the refusal is what runs here
    r = httpx.post(f"{api.url}/v1/ocr", content=text_image(["X"]), headers=PNG, params={"task": "receipt"}, timeout=30)
    assert _error(r) == (400, "invalid_request", "task 'receipt' is not one of this deployment's tasks: "
                                                 "ocr, doc_parse, table")


def test_an_unknown_query_parameter_is_refused_naming_it(api):
    png = text_image(["TYPO IN THE QUERY"])
    with _client(api) as c:
        r = c.post("/v1/ocr", content=png, headers=PNG, params={"tsak": "table"})  # the door's fast path
        assert _error(r) == (400, "invalid_request", f"unknown query parameter 'tsak': POST /v1/ocr takes {SUBMIT_TAKES}")
        r = c.post("/v1/ocr/batch", files=[("files", ("a.png", png, "image/png"))], params={"request_id": "r"})
        assert _error(r)[:2] == (400, "invalid_request")
        assert r.json()["error"]["message"].startswith("unknown query parameter 'request_id': POST /v1/ocr/batch takes task,")
        r = c.get("/v1/ocr/nope", params={"wiat": "5"})
        assert _error(r) == (400, "invalid_request", "unknown query parameter 'wiat': GET /v1/ocr/{request_id} takes wait")
        r = c.get("/v1/events", params={"id": "nope", "timeout": "1", "tiemout": "2", "ids": "x"})
        assert _error(r) == (400, "invalid_request",
                             "unknown query parameters 'tiemout', 'ids': GET /v1/events takes id, timeout")
        r = c.get("/v1/jobs/nope/report", params={"fromat": "jsonl"})
        assert _error(r) == (400, "invalid_request",
                             "unknown query parameter 'fromat': GET /v1/jobs/{job_id}/report takes format")
        r = c.post("/v1/jobs", json={}, params={"name": "x"})
        assert _error(r) == (400, "invalid_request", "unknown query parameter 'name': POST /v1/jobs takes none")
        assert c.get("/healthz", params={"probe": "1"}).status_code == 200  # outside /v1: not checked


def test_a_number_out_of_its_range_is_refused_naming_the_range(api):
    with _client(api) as c:
        for wait, why in [("99999999999999999999", "Input should be less than or equal to 60"),
                          ("1e400", "Input should be a finite number"), ("61", "Input should be less than or equal to 60")]:
            r = c.get("/v1/ocr/nope", params={"wait": wait})
            assert _error(r) == (400, "invalid_request", f"query.wait: {why} (wait: 0 to 60)"), wait
        r = c.get("/v1/events", params={"id": "nope", "timeout": "1e400"})
        assert _error(r) == (400, "invalid_request", "query.timeout: Input should be a finite number (timeout: 0 to 300)")
        r = c.get("/v1/jobs/nope/events", params={"timeout": "301"})
        assert _error(r) == (400, "invalid_request",
                             "query.timeout: Input should be less than or equal to 300 (timeout: 0 to 300)")
        assert c.get("/v1/ocr/nope", params={"wait": "0.5"}).status_code == 404  # in range: read as before


def test_a_file_it_does_not_read_is_refused_listing_the_formats_it_reads(api):
    with _client(api) as c:
        r = c.post("/v1/ocr", content=b"%!PS-Adobe-3.0 not an image", headers={"Content-Type": "application/octet-stream"})
        assert _error(r) == (415, "unsupported_format", f"not an image format ocrstream reads; it reads {FORMATS} "
                                                        "(recognised from the bytes, not the name)")
        r = c.post("/v1/ocr", files=[("file", ("notes.png", b"just words", "image/png"))])
        assert _error(r)[:2] == (415, "unsupported_format") and FORMATS in r.json()["error"]["message"]
        r = c.post("/v1/ocr", content=b"x", headers={"Content-Type": "text/plain"})
        assert _error(r) == (415, "unsupported_format", "Content-Type 'text/plain': send the file's bytes (as image/*, "
                                                        "application/pdf or application/octet-stream) or "
                                                        f"multipart/form-data; ocrstream reads {FORMATS}")
        r = c.post("/v1/ocr/batch", content=text_image(["X"]), headers=PNG)
        assert _error(r) == (415, "unsupported_format", "send multipart/form-data with one file part per image; "
                                                        f"ocrstream reads {FORMATS}")
