"""Large raw uploads to the HTTP door stream to S3 while they are read (multipart to a staging
key, then the content object): on the real stack, with the door's S3 prefix namespaced."""

from __future__ import annotations

import hashlib
import os
import select
import socket
import struct
import time
import uuid
import zlib

import httpx
import pytest

from services.common.s3 import staging_rule_id
from services.api.uploads import MULTIPART_OVERHEAD
from tests.conftest import text_image
from tests.integration.conftest import API_BODY_TIMEOUT_S, API_ENV
from tests.stack import API, metric_value

pytestmark = pytest.mark.stack

MiB = 1024 * 1024
PART = 5 * MiB  # the smallest part S3 allows: streaming starts early and the bodies stay small
LIMIT = 45 * MiB
BUDGET = 12 * MiB  # under one 20 MiB body: only the parts held are charged


def padded_png(lines: list[str], total_bytes: int) -> bytes:
    """A PNG of ``lines`` (tests.conftest.text_image) grown to ``total_bytes`` by a private
    ancillary chunk of random bytes before IEND: a valid PNG that decoders skip through, so
    the text read is exactly ``lines`` whatever the size."""
    png = text_image(lines, size=40)
    assert png.endswith(b"IEND\xaeB`\x82")
    body, iend = png[:-12], png[-12:]
    n = total_bytes - len(png) - 12
    data = os.urandom(n)
    ctype = b"noIs"  # ancillary, private, safe to copy (PNG spec 5.4)
    chunk = struct.pack(">I", n) + ctype + data + struct.pack(">I", zlib.crc32(ctype + data) & 0xFFFFFFFF)
    out = body + chunk + iend
    assert len(out) == total_bytes
    return out


@pytest.fixture(scope="module")
def door(pipeline):
    """A door taking 45 MiB bodies, streaming from 5 MiB on under its own staging prefix, with an
    upload budget smaller than the bodies it is sent."""
    prefix = f"staging/{uuid.uuid4().hex[:10]}/"
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_LIMITS__MAX_IMAGE_BYTES": str(LIMIT),
                                        "OCRSTREAM_HTTP_STREAM_PART_BYTES": str(PART),
                                        "OCRSTREAM_HTTP_UPLOAD_BUDGET_BYTES": str(BUDGET),
                                        "OCRSTREAM_S3__STAGING_PREFIX": prefix})
    st.url = f"http://127.0.0.1:{st.port}"
    st.prefix = prefix
    yield st
    pipeline.stop(st)


def staged(s3, prefix: str) -> tuple[list[str], list[str]]:
    """(staging object keys, incomplete multipart upload keys) under ``prefix``.

    Uploads are listed bucket-wide and filtered here: MinIO's ListMultipartUploads matches a
    ``Prefix`` only as a whole object key (a shorter prefix lists nothing)."""
    objs = s3.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    ups = [u["Key"] for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=s3.bucket)
           for u in page.get("Uploads", []) if u["Key"].startswith(prefix)]
    return [o["Key"] for o in objs], ups


def staged_outcomes(door) -> dict[str, float]:
    with httpx.Client(base_url=door.url, timeout=10) as c:
        text = c.get("/metrics").text
    return {o: metric_value(text, "ocrstream_http_staged_uploads_total", outcome=o)
            for o in ("completed", "aborted", "abort_failed")}


def test_a_20_mib_upload_streams_to_its_content_object_and_a_repeat_is_cached(door, s3):
    text = "STREAMED UPLOAD 4821"  # a text the engine reads exactly; the random padding makes the bytes new
    img = padded_png([text], 20 * MiB)
    sha = hashlib.sha256(img).hexdigest()
    before = staged_outcomes(door)
    with httpx.Client(base_url=door.url, timeout=120) as c:
        r = c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"})
        assert r.status_code == 202, r.text
        got = c.get(f"/v1/ocr/{r.json()['request_id']}", params={"wait": 60}).json()
        assert got["status"] == "ok", got
        assert got["result"]["text"] == text and got["result"]["content_sha256"] == sha
        obj = s3.get_object(Bucket=s3.bucket, Key=f"images/{sha[:2]}/{sha}")
        assert obj["ContentType"] == "image/png" and obj["Body"].read() == img
        assert staged(s3, door.prefix) == ([], [])
        assert staged_outcomes(door)["completed"] == before["completed"] + 1

        again = c.post("/v1/ocr", content=img, headers={"Content-Type": "image/png"})
        assert again.status_code == 200, again.text
        assert again.json()["cache_hit"] is True and again.json()["result"]["text"] == text
        assert staged(s3, door.prefix) == ([], [])
        assert staged_outcomes(door)["aborted"] == before["aborted"] + 1


def test_a_chunked_body_over_the_limit_is_cut_off_with_413_and_leaves_no_parts(door, s3):
    before = staged_outcomes(door)
    chunk = os.urandom(MiB)

    def body():
        for _ in range(LIMIT // MiB + 10):
            yield chunk

    with httpx.Client(base_url=door.url, timeout=120) as c:
        r = c.post("/v1/ocr", content=body(), headers={"Content-Type": "image/png"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "input_too_large", r.text
    after = staged_outcomes(door)
    assert after["aborted"] == before["aborted"] + 1 and after["completed"] == before["completed"]
    assert staged(s3, door.prefix) == ([], [])


def _send_12_of_30_mib_and_go_away(door, s3, head: bytes) -> None:
    """Send ``head`` and 12 MiB of a declared 30 MiB body, wait until its staging upload began,
    close the connection, and check the door aborted it: one more ``aborted``, nothing left."""
    before = staged_outcomes(door)
    with socket.create_connection(("127.0.0.1", door.port), timeout=30) as sock:
        sock.sendall(head)
        for _ in range(12):
            sock.sendall(os.urandom(MiB))
        deadline = time.monotonic() + 60
        while not staged(s3, door.prefix)[1] and time.monotonic() < deadline:  # the multipart upload began
            time.sleep(0.1)
        assert len(staged(s3, door.prefix)[1]) == 1
    deadline = time.monotonic() + 60
    while staged_outcomes(door)["aborted"] == before["aborted"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert staged_outcomes(door)["aborted"] == before["aborted"] + 1
    assert staged(s3, door.prefix) == ([], [])


def test_a_client_that_goes_away_mid_upload_leaves_no_parts(door, s3):
    head = (f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {30 * MiB}\r\n\r\n").encode()
    _send_12_of_30_mib_and_go_away(door, s3, head)
    # counted as the client's doing, not a server error with a traceback in the log
    with httpx.Client(base_url=door.url, timeout=10) as c:
        text = c.get("/metrics").text
    assert metric_value(text, "ocrstream_http_requests_total", route="submit", outcome="client_closed") >= 1
    assert metric_value(text, "ocrstream_http_requests_total", route="submit", outcome="error") == 0
    assert "Exception in ASGI application" not in door.log.read_text()


def test_a_body_that_stalls_mid_upload_gets_408_and_leaves_no_parts(door, s3):
    before = staged_outcomes(door)
    head = (f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {20 * MiB}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", door.port), timeout=API_BODY_TIMEOUT_S * 5) as sock:
        sock.sendall(head + os.urandom(7 * MiB))  # past one part, then nothing
        answer = b""
        while not answer.endswith(b"}}") and (chunk := sock.recv(4096)):  # head and body may come apart
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"408", answer[:200]
    assert b'"code":"request_timeout"' in answer
    after = staged_outcomes(door)
    assert after["aborted"] == before["aborted"] + 1 and after["completed"] == before["completed"]
    assert staged(s3, door.prefix) == ([], [])


@pytest.mark.parametrize("second_length", ["content-length", "chunked"])
def test_a_full_budget_refuses_the_new_upload_not_the_one_in_progress(door, s3, second_length):
    """The 12 MiB budget holds one streamed upload (two 5 MiB parts set aside at admission): a
    second big upload arriving while the first is half sent gets 503 ``overloaded``, and the first
    one, which no longer competes chunk by chunk with it, completes. A second sent chunked (no
    length) is set aside the most a streamed body can hold, so it is refused the same way."""
    text = "ADMITTED UPLOAD 9034"  # read exactly by the engine; the bytes are new each time (random padding)
    first = padded_png([text], 20 * MiB)
    head = (f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
            f"Content-Length: {len(first)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", door.port), timeout=120) as sock:
        sock.sendall(head + first[: 7 * MiB])
        deadline = time.monotonic() + 60
        while not staged(s3, door.prefix)[1] and time.monotonic() < deadline:  # its multipart upload began
            time.sleep(0.1)
        # the second announces 20 MiB: refused from its headers, before a byte of its body is read
        # (without admission it would be let in and wait for its body, and no answer would come)
        with socket.create_connection(("127.0.0.1", door.port), timeout=10) as other:
            other.sendall(head if second_length == "content-length" else
                          b"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n")
            second = b""
            while not second.endswith(b"}}") and (chunk := other.recv(4096)):
                second += chunk
        assert second.split(b"\r\n", 1)[0].split(b" ")[1] == b"503", second[:300]
        assert b'"code":"overloaded"' in second
        sock.sendall(first[7 * MiB:])
        answer = b""
        while not answer.endswith(b"}}") and (chunk := sock.recv(65536)):
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"202", answer[:300]
    rid = answer.split(b'"request_id":"', 1)[1].split(b'"', 1)[0].decode()
    with httpx.Client(base_url=door.url, timeout=120) as c:
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
    assert got["status"] == "ok" and got["result"]["text"] == text, got
    assert staged(s3, door.prefix) == ([], [])


def test_a_streamed_body_that_is_not_an_image_is_refused_and_leaves_nothing(door, s3):
    before = staged_outcomes(door)
    with httpx.Client(base_url=door.url, timeout=120) as c:
        r = c.post("/v1/ocr", content=b"%!PS-Adobe " + os.urandom(7 * MiB),
                   headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_format", r.text
    assert staged_outcomes(door)["aborted"] == before["aborted"] + 1
    assert staged(s3, door.prefix) == ([], [])


def test_init_installs_the_staging_lifecycle_rule_once(s3, stack_env):
    import subprocess
    import sys

    from tests.stack import REPO

    for _ in range(2):  # idempotent: run by the session already, and again
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
    rules = s3.get_bucket_lifecycle_configuration(Bucket=s3.bucket)["Rules"]
    ours = [r for r in rules if r["ID"] == staging_rule_id("staging/")]
    assert len(ours) == 1, rules
    assert ours[0]["Filter"] == {"Prefix": "staging/"} and ours[0]["Status"] == "Enabled"
    assert ours[0]["Expiration"] == {"Days": 1}


# -- multipart/form-data: file parts stream the same way ------------------------------------

BOUNDARY = "ocrstreamTestBoundary7f3a"
FORM_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def form_part(name: str, value: bytes, filename: str | None = None) -> bytes:
    """One part of a multipart/form-data body (RFC 7578): a file part when ``filename`` is given."""
    disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
    ctype = "Content-Type: image/png\r\n" if filename is not None else ""
    return f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n{ctype}\r\n".encode() + value + b"\r\n"


FORM_END = f"--{BOUNDARY}--\r\n".encode()


def send_until_answered(port: int, head: bytes, chunks) -> tuple[bytes, int]:
    """Send ``head``, then the body chunks one by one until the door answers; returns (the
    answer, body bytes sent before it came). A door that refuses the body part-way answers
    (and may close) while the client still has bytes to send."""
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:  # no waiting: the door's body deadline is running
                answer = sock.recv(65536)
                break
            try:
                sock.sendall(chunk)
            except OSError:  # closed (or no longer read) by a door that has answered
                break
            sent += len(chunk)
        while not answer.endswith(b"}}") and (more := sock.recv(65536)):
            answer += more
    return answer, sent


def test_a_20_mib_multipart_file_streams_to_its_content_object_with_its_fields(door, s3):
    text = "FORM UPLOAD 6390"  # read exactly by the engine; the bytes are new (random padding)
    img = padded_png([text], 20 * MiB)
    sha = hashlib.sha256(img).hexdigest()
    # option fields before and after the file part: both apply
    body = (form_part("source", b"web-form") + form_part("file", img, "scan.png")
            + form_part("metadata", b'{"desk": "7"}') + FORM_END)
    before = staged_outcomes(door)
    with httpx.Client(base_url=door.url, timeout=120) as c:
        r = c.post("/v1/ocr", content=body, headers={"Content-Type": FORM_TYPE})
        assert r.status_code == 202, r.text
        got = c.get(f"/v1/ocr/{r.json()['request_id']}", params={"wait": 60}).json()
        assert got["status"] == "ok", got
        doc = got["result"]
        assert doc["text"] == text and doc["content_sha256"] == sha
        assert (doc["filename"], doc["source"], doc["metadata"]) == ("scan.png", "web-form", {"desk": "7"})
        obj = s3.get_object(Bucket=s3.bucket, Key=f"images/{sha[:2]}/{sha}")
        assert obj["ContentType"] == "image/png" and obj["Body"].read() == img
        assert staged(s3, door.prefix) == ([], [])
        assert staged_outcomes(door)["completed"] == before["completed"] + 1

        again = c.post("/v1/ocr", files={"file": ("again.png", img, "image/png")})  # httpx's own encoding
        assert again.status_code == 200, again.text
        assert again.json()["cache_hit"] is True and again.json()["result"]["text"] == text
        assert staged(s3, door.prefix) == ([], [])
        assert staged_outcomes(door)["aborted"] == before["aborted"] + 1


@pytest.mark.parametrize("route", ["/v1/ocr", "/v1/ocr/batch"])
def test_a_multipart_file_over_the_limit_gets_413_before_the_body_is_sent(door, s3, route):
    """Chunked (no Content-Length to refuse up front): the file part alone passes the 45 MiB
    image limit long before the body ends (the batch's whole-body limit is 128 MiB), and the
    door answers while the client is still sending (sent as fast as the door reads: its body
    deadline is 6 s)."""
    before = staged_outcomes(door)
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM_TYPE}\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode()

    def framed(data: bytes) -> bytes:
        return b"%x\r\n" % len(data) + data + b"\r\n"

    total = 80 * MiB
    start = form_part("source", b"limit") + form_part("file", b"", "huge.png")[:-2]  # the file's bytes follow
    chunks = [framed(start)] + [framed(os.urandom(MiB)) for _ in range(total // MiB)]
    answer, sent = send_until_answered(door.port, head, chunks)
    assert answer.split(b"\r\n", 1)[0].split(b" ")[1] == b"413", answer[:300]
    # the batch: the file's limit; /v1/ocr: that or its body's, only 64 KiB more (one chunk read may pass both)
    limits = [LIMIT] if route.endswith("batch") else [LIMIT, LIMIT + MULTIPART_OVERHEAD]
    assert any(f'"the upload exceeds the limit of {n} bytes"'.encode() in answer for n in limits), answer[:300]
    assert sent < total * 3 // 4, sent
    after = staged_outcomes(door)
    assert after["aborted"] == before["aborted"] + 1 and after["completed"] == before["completed"]
    assert staged(s3, door.prefix) == ([], [])


def test_a_batch_streams_its_large_file_and_keeps_the_small_one_in_memory(door, s3):
    """Sent chunked: a batch's admission sets aside its whole declared body (its small files stay
    in memory), which this door's 12 MiB budget would refuse for 20 MiB; without a length it is
    charged as it is read, and the streamed file's parts are given back as they are sent."""
    texts = ["BATCH STREAM 2718", "SMALL ONE 4417"]
    big, small = padded_png([texts[0]], 20 * MiB), text_image([texts[1]], size=40)
    body = form_part("files", big, "big.png") + form_part("source", b"batch") + form_part("files", small, "small.png")
    body += FORM_END
    before = staged_outcomes(door)

    def chunks():
        for i in range(0, len(body), MiB):
            yield body[i:i + MiB]

    with httpx.Client(base_url=door.url, timeout=120) as c:
        r = c.post("/v1/ocr/batch", content=chunks(), headers={"Content-Type": FORM_TYPE})
        assert r.status_code == 202, r.text
        items = r.json()["items"]
        assert [it["filename"] for it in items] == ["big.png", "small.png"]
        got = [c.get(f"/v1/ocr/{it['request_id']}", params={"wait": 60}).json() for it in items]
    assert [g["result"]["text"] for g in got] == texts, got
    assert all(g["result"]["source"] == "batch" for g in got)
    sha = hashlib.sha256(big).hexdigest()
    assert s3.get_object(Bucket=s3.bucket, Key=f"images/{sha[:2]}/{sha}")["Body"].read() == big
    after = staged_outcomes(door)
    assert after["completed"] == before["completed"] + 1 and after["aborted"] == before["aborted"]
    assert staged(s3, door.prefix) == ([], [])


def test_a_client_that_goes_away_mid_multipart_file_leaves_no_parts(door, s3):
    start = form_part("file", b"", "gone.png")[:-2]
    head = (f"POST /v1/ocr HTTP/1.1\r\nHost: x\r\nContent-Type: {FORM_TYPE}\r\n"
            f"Content-Length: {len(start) + 30 * MiB}\r\n\r\n").encode()
    _send_12_of_30_mib_and_go_away(door, s3, head + start)
