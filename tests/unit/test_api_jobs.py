"""The job routes' input checks, answered before anything is published or read (the ASGI app
without its lifespan: nothing connects, so a check that passed would fail on the next step)."""

from __future__ import annotations

import httpx
import pytest

from services.api.router import create_app
from services.api.settings import ApiSettings


async def _post(path: str, body: dict, **settings) -> httpx.Response:
    app = create_app(ApiSettings(webhook_enabled=False, **settings))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://door") as c:
        return await c.post(path, json=body)


@pytest.mark.parametrize("expected", [2**31, 10**20])
async def test_a_close_beyond_2_31_minus_1_is_400_invalid_request(expected):
    r = await _post("/v1/jobs/j1/close", {"expected": expected})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"code": "invalid_request",
                                  "message": "body.expected: Input should be less than or equal to 2147483647"}}


@pytest.mark.parametrize("body, message", [
    ({"fields": ["total"]}, "fields: a job's fields need its task (task=extract)"),
    ({"fields": []}, "fields: a job's fields need its task (task=extract)"),
    ({"task": "ocr", "fields": ["total"]}, "task 'ocr' takes no fields"),
    ({"task": "extract", "fields": []}, "fields: name at least one field"),
    ({"to": "en"}, "to: a job's target language needs its task (task=translate)"),
    ({"task": "translate"}, "task 'translate' needs target_lang"),
    ({"task": "ocr", "to": "en"}, "task 'ocr' takes no target_lang"),
])
async def test_fields_without_a_task_that_reads_them_are_400_not_dropped(body, message):
    r = await _post("/v1/jobs", body, engine_kind="openai")  # an engine that does extract and translate
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"code": "invalid_request", "message": message}}


def test_a_translate_job_takes_its_language_from_to():
    from schemas.tasks import TaskParams
    from services.api.protocol import JobCreate
    from services.api.serving_jobs import job_task_params

    s = ApiSettings(webhook_enabled=False, engine_kind="openai")  # an engine that does extract and translate
    assert job_task_params(s, JobCreate(task="translate", to="en")) == TaskParams(target_lang="en")
    assert job_task_params(s, JobCreate(task="extract", fields=["total", " total"])) == TaskParams(fields=["total"])
    assert job_task_params(s, JobCreate(name="no task")) is None


@pytest.mark.parametrize("body", [{"task": "extract", "fields": ["total"]}, {"task": "translate", "to": "en"},
                                  {"task": "chart"}])
async def test_a_job_of_a_task_the_engine_cannot_do_is_422_unsupported_task(body):
    from schemas.tasks import unsupported_task_message

    r = await _post("/v1/jobs", body)  # the default engine, rapidocr (CPU)
    assert r.status_code == 422, r.text
    assert r.json() == {"error": {"code": "unsupported_task",
                                  "message": unsupported_task_message(body["task"], "rapidocr")}}
