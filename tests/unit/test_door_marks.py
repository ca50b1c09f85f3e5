"""Documents handed over by the HTTP door (pure logic): ingest's check of the door's mark
(``services/ingest/door.py``, the claim read from an in-memory ``request_claims``) and the sink's
choice of which assembled documents are cached under their file's key (``services/sink/document_cache.py``),
and the door's test of which cache hits are answered as a document."""

from __future__ import annotations

import asyncio

import pytest

from schemas.errors import ErrorCode
from schemas.events import RequestEvent, ResultDocument, SubmitEvent
from schemas.keys import image_object_key, result_object_key
from services.api.serving_submit import is_document_file
from services.api.uploads import Upload
from services.common.errors import OcrError
from services.common.s3 import ObjectStore
from services.ingest import door
from services.sink.document_cache import document_cache_key
from services.sink.settings import SinkSettings

S = SinkSettings()
STORE = ObjectStore(S.s3)
SHA = "ab" * 32
URI = STORE.uri(image_object_key(SHA))


class MemoryClaims:
    """``request_claims`` in memory: ``query`` answers :func:`services.common.requests.claims.held_claim`'s SELECT."""

    def __init__(self, *rows: dict):
        self.rows = {r["request_id"]: r for r in rows}

    async def query(self, sql: str, request_id: str) -> list[dict]:
        assert "FROM request_claims" in sql
        return [self.rows[request_id]] if request_id in self.rows else []


def claim_row(request_id: str = "doc-1", door_name: str = "http", api_key_id: str | None = "k1",
              sha: str | None = SHA, task: str = "ocr") -> dict:
    return {"request_id": request_id, "content_sha256": sha, "task": task, "api_key_id": api_key_id,
            "door": door_name, "origin": None, "token": "t" * 32, "claimed_at_ms": 1}


def marked(**kw) -> SubmitEvent:
    return SubmitEvent(**{"request_id": "doc-1", "image_uri": URI, "door": "http", "api_key_id": "k1", **kw})


def verify(db: MemoryClaims, ev: SubmitEvent):
    return asyncio.run(door.verify_claim(db, STORE, ev))


def test_a_plain_submission_is_not_marked_and_a_door_or_key_marks_it():
    assert not door.is_marked(SubmitEvent(image_b64="aGk="))
    assert door.is_marked(SubmitEvent(image_b64="aGk=", door="http"))
    assert door.is_marked(SubmitEvent(image_b64="aGk=", api_key_id="k1"))


def test_the_doors_own_claim_verifies_and_names_the_sha():
    held = verify(MemoryClaims(claim_row()), marked())
    assert (held.request_id, held.door, held.api_key_id, held.content_sha256) == ("doc-1", "http", "k1", SHA)
    door.check_content(held, SHA)  # the object hashes to the claim: no error


@pytest.mark.parametrize("rows, event, says", [
    ((), marked(), "request_id 'doc-1' is not claimed, not by the HTTP door"),
    ((claim_row(door_name="kafka", api_key_id=None),), marked(), "request_id 'doc-1' is claimed by the kafka door"),
    ((claim_row(),), marked(api_key_id="intruder"), "the HTTP door claimed it for another API key, task or image"),
    ((claim_row(),), marked(task="extract"), "the HTTP door claimed it for another API key, task or image"),
    ((claim_row(sha=None),), marked(), "the HTTP door claimed it for another API key, task or image"),
    ((claim_row(),), marked(image_uri=STORE.uri("uploads/x")), "is not the object the HTTP door stored"),
    ((claim_row(),), marked(request_id=None), "names no request_id"),
    ((claim_row(api_key_id=None),), SubmitEvent(request_id="doc-1", image_uri=URI, api_key_id="k1"),
     "claimed it for another API key"),
])
def test_a_forged_mark_is_refused_with_its_code(rows, event, says):
    with pytest.raises(OcrError) as err:
        verify(MemoryClaims(*rows), event)
    assert err.value.code == ErrorCode.HTTP_DOOR_UNVERIFIED
    assert says in err.value.message


def test_an_object_replaced_after_the_claim_is_refused():
    held = verify(MemoryClaims(claim_row()), marked())
    with pytest.raises(OcrError) as err:
        door.check_content(held, "cd" * 32)
    assert err.value.code == ErrorCode.HTTP_DOOR_UNVERIFIED
    assert err.value.message == ("request_id 'doc-1': the stored object hashes to cdcdcdcdcdcd..., "
                                 "the HTTP door claimed abababababab...")


# -- the sink: which documents are cached under their file's key ---------------------------------

DOC = RequestEvent(request_id="doc-1", content_sha256=SHA, task="ocr", api_key_id=None)
GEN = S.generation("ocr", None)


def page_final(n: int, **kw) -> ResultDocument:
    sha = f"{n:02d}" * 32
    key = S.cache_key_of(sha, GEN, None)
    return ResultDocument(**{"request_id": f"doc-1:p{n}", "status": "ok", "content_sha256": sha, "cache_key": key,
                             "result_uri": STORE.uri(result_object_key(key)), "document_id": "doc-1",
                             "page_number": n, **kw})


def summary(**kw) -> ResultDocument:
    return ResultDocument(**{"request_id": "doc-1", "status": "ok", "content_sha256": SHA, "document_id": "doc-1",
                             "page_count": 2, "failed_pages": [], **kw})


def test_an_ok_document_of_this_generation_is_cached_under_its_files_key():
    assert document_cache_key(S, STORE, DOC, [page_final(1), page_final(2)], summary()) == f"{GEN.gen_id}:{SHA}"


@pytest.mark.parametrize("finals, final", [
    ([page_final(1), page_final(2, status="error", cache_key=None, result_uri=None)],
     summary(status="partial", failed_pages=[2])),
    ([page_final(1), page_final(2, cache_key="g0:" + "02" * 32)], summary()),  # another generation's page
    ([page_final(1), page_final(2, result_uri=STORE.uri("requests/doc-1:p2.json"))], summary()),  # not cacheable
    ([], summary()),
])
def test_a_partial_document_or_a_page_of_another_generation_is_not_cached(finals, final):
    assert document_cache_key(S, STORE, DOC, finals, final) is None


# -- the door: which cache hits are answered as a document ----------------------------------------

@pytest.mark.parametrize("head, expected", [
    (b"%PDF-1.4\n", True), (b"\xef\xbb\xbf junk %PDF-1.7\n", True), (b"II*\x00\x08\x00", True),
    (b"MM\x00*\x00\x00", True), (b"\x89PNG\r\n\x1a\n", False), (b"GIF89a", False), (b"II+\x00", False),
])
def test_a_file_is_a_document_by_its_first_bytes(head, expected):
    assert is_document_file(Upload(head + b"\x00" * 64, "0" * 64, None)) is expected
