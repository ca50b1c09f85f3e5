"""The HTTP door's OpenAPI spec: the committed copy matches the app, and every route is documented."""

from __future__ import annotations

import json

from services.api import openapi


def test_committed_spec_matches_the_app():
    """Fails when a route or model changed without `python -m services.api.openapi`."""
    assert openapi.OUT.exists(), f"missing {openapi.OUT}: run python -m services.api.openapi"
    assert openapi.OUT.read_text() == openapi.render(), (
        f"{openapi.OUT} is stale: run python -m services.api.openapi")


def test_every_operation_has_summary_description_and_documented_errors():
    spec = json.loads(openapi.OUT.read_text())
    ops = {(m.upper(), p): op for p, item in spec["paths"].items() for m, op in item.items()}
    assert set(ops) >= {("POST", "/v1/ocr"), ("POST", "/v1/ocr/batch"), ("GET", "/v1/ocr/{request_id}"),
                        ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}
    for key, op in ops.items():
        assert op.get("summary") and op.get("description"), key
        for status, resp in op["responses"].items():
            assert resp.get("description"), (key, status)
    error_ref = {"$ref": "#/components/schemas/ApiErrorBody"}
    for key in (("POST", "/v1/ocr"), ("POST", "/v1/ocr/batch"), ("GET", "/v1/ocr/{request_id}")):
        for status in ("400", "503"):
            assert ops[key]["responses"][status]["content"]["application/json"]["schema"] == error_ref, (key, status)
    assert "404" in ops[("GET", "/v1/ocr/{request_id}")]["responses"]
    for status in ("200", "202", "413", "415"):
        assert status in ops[("POST", "/v1/ocr")]["responses"], status
    # raw image bytes and multipart are both documented request bodies
    content = ops[("POST", "/v1/ocr")]["requestBody"]["content"]
    assert {"image/*", "application/octet-stream", "multipart/form-data"} <= set(content)
    assert content["multipart/form-data"]["schema"]["required"] == ["file"]
    # probes and metrics do not answer the upload errors
    assert not {"413", "415"} & set(ops[("GET", "/healthz")]["responses"])
