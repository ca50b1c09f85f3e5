"""Every /v1 route refuses a query parameter it does not take (400 ``invalid_request`` naming it), before
anything else is read: the ASGI app without its lifespan, so nothing connects and a request that got
past the check would fail on its next step instead."""

from __future__ import annotations

import httpx
import pytest

from services.api.router import create_app
from services.api.settings import ApiSettings

SUBMIT_TAKES = "request_id, task, fields, to, target_lang, source, filename, callback_url, metadata, job_id, priority"
ROUTES = [
    ("POST", "/v1/ocr", f"POST /v1/ocr takes {SUBMIT_TAKES}"),
    ("POST", "/v1/ocr/batch", f"POST /v1/ocr/batch takes {SUBMIT_TAKES.replace('request_id, ', '')}"),
    ("GET", "/v1/events", "GET /v1/events takes id, timeout"),
    ("GET", "/v1/tasks", "GET /v1/tasks takes none"),
    ("GET", "/v1/ocr/r1", "GET /v1/ocr/{request_id} takes wait"),
    ("POST", "/v1/jobs", "POST /v1/jobs takes none"),
    ("POST", "/v1/jobs/j1/close", "POST /v1/jobs/{job_id}/close takes none"),
    ("GET", "/v1/jobs/j1", "GET /v1/jobs/{job_id} takes none"),
    ("GET", "/v1/jobs/j1/events", "GET /v1/jobs/{job_id}/events takes timeout"),
    ("GET", "/v1/jobs/j1/report", "GET /v1/jobs/{job_id}/report takes format"),
]


async def _call(method: str, url: str, **settings) -> httpx.Response:
    app = create_app(ApiSettings(**settings))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://door") as c:
        return await c.request(method, url, content=b"\x89PNG\r\n\x1a\n", headers={"Content-Type": "image/png"})


@pytest.mark.parametrize("method, path, takes", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
async def test_an_unknown_query_parameter_is_400_naming_it_and_what_the_route_takes(method, path, takes):
    r = await _call(method, f"{path}?tsak=table")
    assert (r.status_code, r.json()) == (400, {"error": {"code": "invalid_request",
                                                         "message": f"unknown query parameter 'tsak': {takes}"}})


@pytest.mark.parametrize("fast_path", [True, False])
async def test_submit_refuses_them_on_the_fast_path_and_the_routed_one_alike(fast_path):
    r = await _call("POST", "/v1/ocr?task=table&tsak=table&tsak=x&Task=ocr&" + "z" * 100 + "=1",
                    http_fast_path=fast_path)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (f"unknown query parameters 'tsak', 'Task', '{'z' * 64}': "
                                            f"POST /v1/ocr takes {SUBMIT_TAKES}")
    many = "&".join(f"p{i}=1" for i in range(12))
    r = await _call("POST", f"/v1/ocr?{many}", http_fast_path=fast_path)
    assert r.json()["error"]["message"].startswith(
        "unknown query parameters 'p0', 'p1', 'p2', 'p3', 'p4', 'p5', 'p6', 'p7', 'p8', 'p9' and 2 more: POST /v1/ocr")


async def test_known_parameters_and_routes_outside_v1_are_not_refused():
    r = await _call("GET", "/v1/tasks")
    assert r.status_code == 200 and r.json()["engine"] == "rapidocr"
    r = await _call("GET", "/healthz?probe=1")  # probes, the spec and the page take what they are given
    assert (r.status_code, r.json()) == (200, {"ok": True, "not_ready": []})
    r = await _call("GET", "/openapi.json?v=2")
    assert r.status_code == 200
    # a known parameter passes the check and is read as before: this one is then out of its range
    r = await _call("GET", "/v1/ocr/r1?wait=-1")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "query.wait: Input should be greater than or equal to 0 (wait: 0 to 60)"


LESS = "Input should be less than or equal to"
FINITE = "Input should be a finite number"


@pytest.mark.parametrize("path, value, message", [
    ("/v1/ocr/r1", "99999999999999999999", f"query.wait: {LESS} 60 (wait: 0 to 60)"),
    ("/v1/ocr/r1", "60.001", f"query.wait: {LESS} 60 (wait: 0 to 60)"),
    ("/v1/ocr/r1", "1e400", f"query.wait: {FINITE} (wait: 0 to 60)"),
    ("/v1/ocr/r1", "nan", f"query.wait: {FINITE} (wait: 0 to 60)"),
    ("/v1/events?id=a", "1e400", f"query.timeout: {FINITE} (timeout: 0 to 300)"),
    ("/v1/events?id=a", "1e9", f"query.timeout: {LESS} 300 (timeout: 0 to 300)"),
    ("/v1/jobs/j1/events", "-inf", f"query.timeout: {FINITE} (timeout: 0 to 300)"),
    ("/v1/jobs/j1/events", "301", f"query.timeout: {LESS} 300 (timeout: 0 to 300)"),
])
async def test_a_number_out_of_its_range_is_400_naming_the_range(path, value, message):
    name = "wait" if path.startswith("/v1/ocr") else "timeout"
    r = await _call("GET", f"{path}{'&' if '?' in path else '?'}{name}={value}")
    assert (r.status_code, r.json()) == (400, {"error": {"code": "invalid_request", "message": message}})


async def test_the_bounds_are_the_settings_and_the_spec_says_them():
    r = await _call("GET", "/v1/ocr/r1?wait=30", http_wait_max_s=20, http_events_max_s=45.5)
    assert r.json()["error"]["message"] == f"query.wait: {LESS} 20 (wait: 0 to 20)"
    r = await _call("GET", "/v1/events?id=a&timeout=46", http_events_max_s=45.5)
    assert r.json()["error"]["message"] == f"query.timeout: {LESS} 45.5 (timeout: 0 to 45.5)"
    spec = create_app(ApiSettings()).openapi()
    [wait] = [p for p in spec["paths"]["/v1/ocr/{request_id}"]["get"]["parameters"] if p["name"] == "wait"]
    assert (wait["schema"]["minimum"], wait["schema"]["maximum"]) == (0, 60)
    assert wait["description"] == ("seconds to wait for completion (long-poll): 0 to 60 (`OCRSTREAM_HTTP_WAIT_MAX_S`); "
                                   "more, or not a finite number, is 400 `invalid_request`")
    for path in ("/v1/events", "/v1/jobs/{job_id}/events"):
        [timeout] = [p for p in spec["paths"][path]["get"]["parameters"] if p["name"] == "timeout"]
        assert (timeout["schema"]["maximum"], timeout["schema"]["default"]) == (300, 300)
        assert "0 to 300 (`OCRSTREAM_HTTP_EVENTS_MAX_S`)" in timeout["description"]
