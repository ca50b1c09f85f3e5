"""Event models: validation, round trips and the JSON Schema drift check."""

import base64

import orjson
import pytest
from pydantic import ValidationError

from schemas import generate
from schemas.errors import ErrorCode
from schemas.events import ALL_EVENTS, CompletedEvent, RequestEvent, ResultDocument, ResultEvent, SubmitEvent
from schemas.reading import Line
from services.common.codec import completion_event_id, derived_request_id, dumps, loads


def test_jsonschema_files_match_models():
    """Fails when a model changed without `python -m schemas.generate`."""
    for fname, text in generate.render().items():
        path = generate.OUT_DIR / fname
        assert path.exists(), f"missing {path}: run python -m schemas.generate"
        assert path.read_text() == text, f"{path} is stale: run python -m schemas.generate"
    assert sorted(p.name for p in generate.OUT_DIR.glob("*.json")) == sorted(f"{n}.json" for n in ALL_EVENTS)


def test_submit_needs_exactly_one_image():
    with pytest.raises(ValidationError, match="exactly one of image_b64 or image_uri"):
        SubmitEvent()
    with pytest.raises(ValidationError, match="exactly one"):
        SubmitEvent(image_b64="AA==", image_uri="s3://b/k")
    with pytest.raises(ValidationError):
        SubmitEvent(image_uri="http://example/x.png")
    ev = SubmitEvent(image_b64=base64.b64encode(b"\x89PNG").decode())
    assert ev.image_bytes() == b"\x89PNG"


def test_submit_refuses_dot_segments_in_the_image_key():
    """MinIO refuses such keys (XMinioInvalidResourceName): retried, then internal_error, before."""
    for uri in ("s3://ocrstream/../../etc/passwd", "s3://b/images/./x.png", "s3://b/a/.."):
        with pytest.raises(ValidationError, match="'.' or '..' path segment"):
            SubmitEvent(image_uri=uri)
    assert SubmitEvent(image_uri="s3://b/a..b/c.v1.png").image_uri == "s3://b/a..b/c.v1.png"


def test_submit_rejects_bad_request_id():
    with pytest.raises(ValidationError):
        SubmitEvent(request_id="has space", image_uri="s3://b/k")


def test_round_trip_keeps_schema_name():
    req = RequestEvent(request_id="r1", content_sha256="a" * 64, image_uri="s3://b/images/aa/" + "a" * 64)
    raw = dumps(req)
    assert orjson.loads(raw)["schema"] == "ocr.request.v1"
    back = loads(RequestEvent, raw)
    assert back == req


def test_line_box_must_have_four_points():
    with pytest.raises(ValidationError):
        Line(text="x", box=[[0, 0], [1, 0], [1, 1]], confidence=0.5)
    with pytest.raises(ValidationError):
        Line(text="x", box=[[0, 0], [1, 0], [1, 1], [0, 1]], confidence=1.5)


def test_result_event_error_code_is_enum():
    ev = ResultEvent.model_validate(
        {"request": {"request_id": "r"}, "status": "error", "error": {"code": "corrupt_image", "message": "m"}}
    )
    assert ev.error.code is ErrorCode.CORRUPT_IMAGE
    with pytest.raises(ValidationError):
        ResultEvent.model_validate({"request": {"request_id": "r"}, "status": "error", "error": {"code": "nope", "message": "m"}})


def test_completion_ids_are_deterministic():
    assert completion_event_id("abc") == completion_event_id("abc")
    assert completion_event_id("abc") != completion_event_id("abd")
    assert len(completion_event_id("abc")) == 32
    assert derived_request_id("ocr.submit", 1, 42) == derived_request_id("ocr.submit", 1, 42)
    assert derived_request_id("ocr.submit", 1, 42) != derived_request_id("ocr.submit", 2, 42)
    doc = ResultDocument(request_id="abc", status="ok")
    a = dumps(CompletedEvent(event_id=completion_event_id("abc"), request_id="abc", result=doc))
    b = dumps(CompletedEvent(event_id=completion_event_id("abc"), request_id="abc", result=doc))
    assert a == b


def test_error_codes_are_the_documented_list():
    assert [c.value for c in ErrorCode] == [
        "empty_input", "input_too_large", "unsupported_format", "corrupt_image", "image_too_large",
        "too_many_pages", "missing_object", "invalid_request", "timeout", "engine_error", "internal_error",
        "engine_crash",  # added later: new codes go at the end
        "decode_timeout", "image_too_complex",
        "request_id_conflict", "image_uri_not_allowed",
        "stage_crash",
        "unsupported_task", "unparsable_output",
        "document_too_many_pages", "document_too_large", "document_pages_failed",
        "http_door_unverified",
    ]


def test_inline_base64_may_have_mime_line_breaks():
    raw = bytes(range(256)) * 3
    b64 = base64.b64encode(raw).decode()
    wrapped = "\r\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))  # RFC 2045 lines
    assert SubmitEvent(image_b64=wrapped).image_bytes() == raw
    assert SubmitEvent(image_b64=b64).image_bytes() == raw
    with pytest.raises(ValueError):
        SubmitEvent(image_b64="not*base64").image_bytes()


def test_dumps_writes_the_bytes_of_model_dump_through_orjson():
    # dumps serialises in one step (pydantic's to_json); the wire bytes stay those of the
    # former orjson.dumps(model_dump(mode="json", by_alias=True)): floats, non-ASCII, nesting
    req = RequestEvent(request_id="r-1", content_sha256="a" * 64, image_uri="s3://b/k", size_bytes=7646,
                       metadata={"é": "ü\u2028€ \"q\" \\ \n"}, filename="bön.png",
                       timings_ms={"http": 0.068, "tiny": 1e-7, "sum": 0.1 + 0.2, "neg": -0.0, "n": 3,
                                   "ms": 1796028733445.5})
    lines = [Line(text=f"line {i} ünï €", box=[[1.5, 2], [300.25, 2], [300, 40.1], [1.5, 1 / 3]], confidence=0.98)
             for i in range(3)]
    ev = ResultEvent(request=req, cache_key="k", status="error", error={"code": "corrupt_image", "message": "bad ✗"},
                     lines=lines, pages=[{"index": 1, "width": 5, "height": 7}], warnings=["w"])
    doc = ResultDocument(request_id="r-1", status="ok", lines=lines, text="a\nb", timings_ms={"total": 12.5})
    done = CompletedEvent(event_id="e", request_id="r-1", result=doc)
    for model in (req, ev, doc, done):
        assert dumps(model) == orjson.dumps(model.model_dump(mode="json", by_alias=True))
    assert orjson.loads(dumps(ev))["schema"] == "ocr.result.v1"
    # large and small floats too (orjson >= 3.10 writes the exponent's sign as pydantic does)
    huge = RequestEvent(request_id="r-2", timings_ms={"big": 1e16, "small": 1e-7})
    assert dumps(huge) == orjson.dumps(huge.model_dump(mode="json", by_alias=True))
    assert b'"big":1e+16,"small":1e-7' in dumps(huge)


def test_every_model_with_a_task_answer_takes_it_from_task_answer_and_its_own_fields_come_first():
    """A task's answer is declared once (``TaskAnswer``): a model that carries any answer field is a
    ``TaskAnswer``, and on the wire its own fields come before the answer (``schema`` first)."""
    from pydantic import BaseModel

    import schemas.events as ev
    import schemas.reading as rd

    models = [m for mod in (ev, rd) for m in vars(mod).values() if isinstance(m, type) and issubclass(m, BaseModel)
              and m.__module__ == mod.__name__ and not m.__name__.startswith("_") and m is not rd.TaskAnswer]
    carrying = {m.__name__ for m in models if set(rd.TASK_ANSWER_FIELDS) & set(m.model_fields)}
    assert carrying == {"ResultEvent", "ResultDocument", "OcrOutput", "DocumentPage"}
    for m in models:
        if m.__name__ in carrying:
            assert issubclass(m, rd.TaskAnswer), m.__name__
            names = list(m.model_fields)
            assert names[-len(rd.TASK_ANSWER_FIELDS):] == list(rd.TASK_ANSWER_FIELDS), m.__name__
    doc = ev.ResultDocument(request_id="r1", status="ok", markdown="# A")
    assert list(orjson.loads(doc.model_dump_json(by_alias=True)))[:2] == ["schema", "request_id"]
