"""Reading ``multipart/form-data`` as a stream (services.api.forms): option fields, file
parts hashed and limited while they arrive, large file parts cut into S3 parts as they come
(a recording store passed in), and nothing left staged when reading fails."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from starlette.requests import Request

from services.api.errors import ApiError
from services.api.forms import read_multipart
from services.api.uploads import UploadBudget

BOUNDARY = "b0undAry"


def form_body(*parts: tuple[str, str | None, bytes], close: bool = True) -> bytes:
    """A multipart/form-data body: ``(field name, file name or None for a text field, bytes)``."""
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n".encode()
        if filename is not None:
            out += b"Content-Type: application/octet-stream\r\n"
        out += b"\r\n" + data + b"\r\n"
    return out + (f"--{BOUNDARY}--\r\n".encode() if close else b"")


class Body:
    """An ASGI ``receive`` handing out ``body`` in ``chunk``-byte messages; counts what was read."""

    def __init__(self, body: bytes, chunk: int):
        self.chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
        self.read = 0

    async def __call__(self) -> dict:
        data = self.chunks[self.read]
        self.read += 1
        return {"type": "http.request", "body": data, "more_body": self.read < len(self.chunks)}


def request(receive: Body, ctype: str = f"multipart/form-data; boundary={BOUNDARY}") -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/ocr",
                    "headers": [(b"content-type", ctype.encode())]}, receive)


class RecordingUpload:
    def __init__(self, key: str, log: list):
        self.key, self.log, self.parts, self.state, self.upload_id = key, log, [], "open", key

    async def upload_part(self, data) -> None:
        self.parts.append(bytes(data))
        self.log.append(f"part {self.key} {len(data)}")

    async def abort(self) -> None:
        self.state = "aborted"
        self.log.append(f"abort {self.key}")


class RecordingStore:
    """Hands out a new recording multipart upload per staging key."""

    def __init__(self):
        self.log: list[str] = []
        self.uploads: list[RecordingUpload] = []

    def staging_key(self) -> str:
        return f"staging/{len(self.uploads) + 1}"

    async def start_multipart(self, key: str) -> RecordingUpload:
        self.uploads.append(RecordingUpload(key, self.log))
        return self.uploads[-1]


def read(body: bytes, chunk: int = 7, *, image_limit: int = 1000, total_limit: int = 10_000, max_files: int = 4,
         store=None, part_bytes: int = 0, budget=None, ctype: str | None = None):
    receive = Body(body, chunk)
    req = request(receive) if ctype is None else request(receive, ctype)
    ends: list[str] = []

    async def main():
        return await read_multipart(req, image_limit, total_limit, max_files, budget, store=store,
                                    part_bytes=part_bytes, on_staged_end=ends.append)

    return asyncio.run(main()), receive, ends


@pytest.mark.parametrize("chunk", [1, 5, 64, 100_000])
def test_fields_anywhere_and_small_files_in_memory_hashed_while_read(chunk):
    img = bytes(range(256)) * 3
    body = form_body(("task", None, b"ocr"), ("file", "a.png", img), ("source", None, "f\u00f6rm".encode()),
                     ("file", "b.png", b"second"), ("callback_url", None, b"http://x/cb"))
    (uploads, fields), _, ends = read(body, chunk, store=RecordingStore(), part_bytes=10_000)
    assert fields == {"task": "ocr", "source": "f\u00f6rm", "callback_url": "http://x/cb"}
    assert [(u.filename, u.data, u.sha256, u.staged) for u in uploads] == [
        ("a.png", img, hashlib.sha256(img).hexdigest(), None),
        ("b.png", b"second", hashlib.sha256(b"second").hexdigest(), None)]
    assert ends == []


@pytest.mark.parametrize("chunk", [3, 10, 4096])
def test_a_large_file_part_is_sent_in_parts_while_read_and_spooled(chunk):
    big = bytes(range(256)) * 40  # 10,240 bytes: parts of 1,000
    store = RecordingStore()
    budget = UploadBudget(0).reservation()
    body = form_body(("file", "big.png", big), ("file", "small.png", b"tiny"), ("task", None, b"ocr"))
    (uploads, fields), _, ends = read(body, chunk, image_limit=20_000, total_limit=30_000, store=store,
                                      part_bytes=1000, budget=budget)
    big_up, small_up = uploads
    assert fields == {"task": "ocr"}
    assert big_up.data == b"" and big_up.size_bytes == len(big) and big_up.filename == "big.png"
    assert big_up.sha256 == hashlib.sha256(big).hexdigest()
    [up] = store.uploads
    assert b"".join(up.parts) == big and all(len(p) >= 1000 for p in up.parts[:-1])
    big_up.staged.spool.seek(0)
    assert big_up.staged.spool.read() == big
    assert (small_up.data, small_up.staged) == (b"tiny", None)
    assert budget.in_memory < len(big)  # the parts sent were given back
    asyncio.run(big_up.staged.discard())
    assert store.log[-1] == "abort staging/1" and ends == ["aborted"]


def test_a_file_part_over_the_limit_is_refused_while_the_body_is_still_arriving():
    body = form_body(("file", "huge.png", b"x" * 5000), ("task", None, b"ocr"))
    receive = Body(body, 100)
    with pytest.raises(ApiError) as err:
        asyncio.run(read_multipart(request(receive), 1000, 100_000, 4))
    assert (err.value.status, err.value.code) == (413, "input_too_large")
    assert "1000 bytes" in err.value.message
    assert receive.read <= 12 < len(receive.chunks)  # cut off right after the file passed 1000 bytes


def test_a_failure_after_a_streamed_file_aborts_its_upload():
    store = RecordingStore()
    body = form_body(("files", "one.png", b"a" * 3000), ("files", "two.png", b"b" * 3000),
                     ("files", "empty.png", b""))
    with pytest.raises(ApiError) as err:
        read(body, 50, image_limit=5000, store=store, part_bytes=1000)
    assert (err.value.status, err.value.code) == (400, "empty_input") and "empty.png" in err.value.message
    assert [u.state for u in store.uploads] == ["aborted", "aborted"]


def test_a_body_cut_off_mid_file_ignores_that_file_and_aborts_its_upload():
    store = RecordingStore()
    body = form_body(("file", "cut.png", b"c" * 3000), close=False)[:-200]
    with pytest.raises(ApiError) as err:
        read(body, 64, image_limit=5000, store=store, part_bytes=1000)
    assert (err.value.status, err.value.code) == (400, "invalid_request")  # it has one: cut, not missing
    assert err.value.message == ("multipart body rejected: its file part is cut off by the end of the body "
                                 "(no closing boundary)")
    assert [u.state for u in store.uploads] == ["aborted"]


def test_the_whole_body_limit_still_applies():
    body = form_body(("file", "a.png", b"x" * 900), ("note", None, b"y" * 2000))
    with pytest.raises(ApiError) as err:
        read(body, image_limit=1000, total_limit=1500)
    assert (err.value.status, err.value.code) == (413, "input_too_large") and "1500 bytes" in err.value.message


@pytest.mark.parametrize("body, ctype, code, words", [
    (form_body(("file", "a.png", b"")), None, "empty_input", "'a.png' is empty"),
    (form_body(("file", "", b"")), None, "empty_input", "'file' is empty"),  # a form sent with no file chosen
    (form_body(("task", None, b"ocr")), None, "empty_input", "no file part"),
    (form_body(*[("f", f"{i}.png", b"x") for i in range(5)]), None, "invalid_request", "Too many files"),
    (form_body(*[(f"k{i}", None, b"v") for i in range(33)], ("file", "a.png", b"x")), None, "invalid_request",
     "Too many fields"),
    (form_body(("note", None, b"n" * (64 * 1024 + 1)), ("file", "a.png", b"x")), None, "invalid_request",
     "maximum size of 64KB"),
    (form_body(("file", "a.png", b"x")).replace(b'name="file"; ', b""), None, "invalid_request",
     '"name" must be provided'),
    (form_body(("file", "a.png", b"x")), "multipart/form-data", "invalid_request", "Missing boundary"),
    (b"--" + BOUNDARY.encode() + b"\r\nno header end here\x00\r\n", None, "invalid_request", "Invalid multipart data"),
])
def test_bad_bodies_get_the_same_errors_as_before(body, ctype, code, words):
    with pytest.raises(ApiError) as err:
        read(body, 64, total_limit=200_000, ctype=ctype)
    assert err.value.status == 400 and err.value.code == code, err.value.message
    assert words in err.value.message, err.value.message
