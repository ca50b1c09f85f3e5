"""Pure logic of request ids and S3 references: the one id rule both doors use, the one claim
rule (:func:`services.common.requests.claims.compare`), the allow-list check of ``s3://`` references."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.events import SubmitEvent
from schemas.ids import REQUEST_ID_MAX_LENGTH, is_request_id, request_id_problem
from services.common.requests.claims import RequestClaim, compare
from services.common.errors import OcrError
from services.common.s3 import reference_problem
from services.api.protocol import SubmitOptions

SHA_A, SHA_B = "a" * 64, "b" * 64
BAD_IDS = ["", "x" * 65, "a b", "tab\there", "nl\n", "nul\x00x", "bell\x07", "é", "a\ud800", ".", "..", "...",
           "slash/x", "pct%41", "q?x", "hash#x"]
GOOD_IDS = ["a", "x" * 64, "order-55", "a.b_c:d-e", ".hidden", "0" * 32, "web-" + "f" * 32]


@pytest.mark.parametrize("rid", BAD_IDS)
def test_an_id_outside_the_rule_is_refused_by_both_doors_models(rid):
    assert not is_request_id(rid) and request_id_problem(rid) is not None
    with pytest.raises(ValidationError):
        SubmitEvent(request_id=rid, image_b64="AA==")
    with pytest.raises(ValidationError):
        SubmitOptions(request_id=rid)


@pytest.mark.parametrize("rid", GOOD_IDS)
def test_an_id_inside_the_rule_is_taken_unchanged_by_both(rid):
    assert is_request_id(rid) and request_id_problem(rid) is None
    assert SubmitEvent(request_id=rid, image_b64="AA==").request_id == rid
    assert SubmitOptions(request_id=rid).request_id == rid


def test_the_problem_message_escapes_and_counts_without_cutting_onto_another_id():
    long = "k" * (REQUEST_ID_MAX_LENGTH + 1)
    assert request_id_problem(long).startswith(f"request_id '{long}' (65 characters) is not a valid request id")
    assert "\\x07" in request_id_problem("bell\x07") and "\x07" not in request_id_problem("bell\x07")
    assert "\\ud800" in request_id_problem("a\ud800")
    assert request_id_problem(42) == ("request_id int is not a valid request id: 1 to 64 characters of "
                                      "A-Z a-z 0-9 . _ : - (not only dots)")


def _claim(**kw) -> RequestClaim:
    base = dict(request_id="r-1", content_sha256=SHA_A, task="ocr", door="kafka", api_key_id=None, origin=None)
    return RequestClaim(**{**base, **kw})


def test_same_image_task_and_key_is_a_retry_at_either_door():
    assert compare(_claim(), _claim(door="http")) == ("retry", None)
    assert compare(_claim(door="http", api_key_id="k1"), _claim(door="http", api_key_id="k1")) == ("retry", None)


def test_the_same_record_again_is_a_retry_even_before_its_image_was_read():
    held = _claim(content_sha256=None, task=None, origin="ocr.submit/0/7")
    assert compare(held, _claim(origin="ocr.submit/0/7")) == ("retry", None)
    kind, reason = compare(held, _claim(origin="ocr.submit/0/8"))
    assert kind == "conflict" and "refused before its image was read" in reason


@pytest.mark.parametrize("mine, says", [
    (_claim(content_sha256=SHA_B), "request_id 'r-1' is already used for a different image (content SHA-256 aaaaaaaaaaaa..., "
                                   "this one's bbbbbbbbbbbb...)"),
    (_claim(task="layout"), "request_id 'r-1' is already used for the same image with task 'ocr'"),
    (_claim(door="http", api_key_id="k2"), "request_id 'r-1' is already used by a request made without an API key "
                                           "(the Kafka door, or the HTTP door with keys off)"),
    (_claim(content_sha256=None, task=None, origin="ocr.submit/1/1"),
     "request_id 'r-1' is already used by another request (content SHA-256 aaaaaaaaaaaa...)"),
])
def test_anything_else_is_a_conflict_that_says_what_differs(mine, says):
    assert compare(_claim(), mine) == ("conflict", says)


def test_another_keys_claim_reveals_nothing_of_its_image():
    kind, reason = compare(_claim(door="http", api_key_id="k1"), _claim(door="http", api_key_id="k2", content_sha256=SHA_B))
    assert (kind, reason) == ("conflict", "request_id 'r-1' is already used by another API key")
    kind, reason = compare(_claim(door="http", api_key_id="k1"), _claim())
    assert (kind, reason) == ("conflict", "request_id 'r-1' is already used by a request of an API key (the HTTP door)")


ALLOWED = ["ocrstream/uploads/"]


@pytest.mark.parametrize("uri", ["s3://ocrstream/uploads/abc", "s3://ocrstream/uploads/a/b/c.png",
                                 "s3://ocrstream/uploads//x", "s3://ocrstream/uploads/%41bc"])
def test_references_under_the_allowed_prefix_pass(uri):
    assert reference_problem(uri, ALLOWED) is None


@pytest.mark.parametrize("uri", [
    "s3://ocrstream/results/ab/x.json", "s3://ocrstream/images/ab/" + SHA_A, "s3://other/uploads/x",
    "s3://ocrstream.evil/uploads/x", "s3://ocrstream/uploadsx/y", "s3://ocrstream//uploads/x", "s3://ocrstream/Uploads/x",
])
def test_references_elsewhere_are_refused_naming_the_allowed_locations(uri):
    assert reference_problem(uri, ALLOWED) == (f"image_uri {uri!r} is outside the S3 locations ingest may read: "
                                               "s3://ocrstream/uploads/ (OCRSTREAM_S3_ALLOWED_PREFIXES)")


@pytest.mark.parametrize("key", ["uploads/../results/x", "uploads/%2e%2e/results/x", "uploads/%252E%252E/results/x",
                                 "uploads/.%2E/results/x", "uploads/./x", "uploads/..\\results\\x", "uploads/a%5c..%5cb",
                                 "uploads/nul%00"])
def test_path_tricks_under_the_prefix_are_refused(key):
    problem = reference_problem(f"s3://ocrstream/{key}", ALLOWED)
    assert problem is not None and "segment, a backslash or a control character" in problem


def test_a_whole_bucket_entry_and_an_empty_list():
    assert reference_problem("s3://scans/any/thing", ["scans/"]) is None
    assert "none (S3 references are turned off)" in reference_problem("s3://ocrstream/uploads/x", [])
    with pytest.raises(OcrError):
        reference_problem("s3://bucket-only", ALLOWED)


def test_the_allow_list_setting_defaults_to_the_upload_prefix_and_refuses_uris():
    from services.ingest.settings import IngestSettings

    assert IngestSettings().allowed_prefixes() == [f"{IngestSettings().s3.bucket}/uploads/"]  # the tests' namespace bucket
    assert IngestSettings(s3={"bucket": "ocrstream"}).allowed_prefixes() == ["ocrstream/uploads/"]
    assert IngestSettings(s3_allowed_prefixes=[]).allowed_prefixes() == []
    assert IngestSettings(s3_allowed_prefixes=["scans/in/", "b/"]).allowed_prefixes() == ["scans/in/", "b/"]
    for bad in ("s3://scans/in/", "scans", "/in/"):
        with pytest.raises(ValidationError):
            IngestSettings(s3_allowed_prefixes=[bad])


def test_a_page_ids_form_is_the_systems_alone():
    from schemas.events import SubmitEvent
    from schemas.ids import chosen_request_id_problem, is_page_request_id, page_request_id

    assert is_page_request_id(page_request_id("invoice-7", 2)) and is_page_request_id(page_request_id("x" * 60, 3000))
    for rid in ("D:p2", "a.b:p0", "x:p123456"):
        assert is_request_id(rid)  # readable: GET /v1/ocr/D:p2
        assert "has the form of a document page's id" in chosen_request_id_problem(rid)
        with pytest.raises(ValueError, match="form of a document page's id"):
            SubmitEvent(request_id=rid, image_b64="aGk=")
    for rid in ("D:p2a", "D:page2", "D-p2", "p2", "D:P2", "D:p"):
        assert chosen_request_id_problem(rid) is None, rid
    assert chosen_request_id_problem("bell\x07").startswith("request_id 'bell\\x07' is not a valid request id")
