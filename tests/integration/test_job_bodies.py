"""The job routes' JSON bodies on the real stack: the key is checked before a byte of the body is
read, a body is bounded (64 KiB) and charged to the upload budget while read, and bad values are
400 with the field named, never a 503 blaming Kafka (services/api/bodies.py, docs/limits.md).

A keyed HTTP door of its own (keys required, the session's namespace) and a raw socket client for
bodies that are never finished or far too large."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson
import pytest

from services.api.bodies import JSON_BODY_MAX_BYTES
from tests.integration.test_http_auth import make_key  # noqa: F401 - keys made by the real CLI
from tests.stack import API, Pipeline

pytestmark = pytest.mark.stack

KEYED_ENV = {"OCRSTREAM_AUTH_REQUIRED": "true", "OCRSTREAM_AUTH_CACHE_S": "0.5", "OCRSTREAM_WEBHOOK_ENABLED": "false"}


@pytest.fixture(scope="module")
def door(stack_env, tmp_path_factory):
    """A keyed HTTP door (base URL in ``.url``, port in ``.port``) on the session's namespace."""
    p = Pipeline(env=stack_env, logdir=tmp_path_factory.mktemp("job-bodies-logs"))
    api = p.start(API, extra_env=KEYED_ENV)
    api.url = f"http://127.0.0.1:{api.port}"
    yield api
    p.stop_all()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def raw_post(port: int, path: str, headers: dict[str, str], body: bytes = b"", timeout: float = 20) -> tuple[int, bytes]:
    """POST with a socket: send the headers and ``body`` (a part of what ``Content-Length`` may
    declare), then read the answer; returns its status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def test_without_a_key_a_job_body_is_refused_401_before_it_is_read(door):
    # 250 MB declared, nothing of it sent: the answer comes at once, not after the body
    started = time.monotonic()
    status, body = raw_post(door.port, "/v1/jobs", {"Content-Type": "application/json",
                                                    "Content-Length": str(250 * 2**20)})
    assert status == 401 and orjson.loads(body)["error"]["code"] == "unauthorized"
    assert time.monotonic() - started < 10
    status, _ = raw_post(door.port, "/v1/jobs/some-job/close", {"Content-Type": "application/json",
                                                                 "Content-Length": str(250 * 2**20)})
    assert status == 401


def test_an_oversized_job_body_is_413_and_concurrent_ones_leave_the_door_small(door, make_key):  # noqa: F811
    key = make_key("bodies")
    auth = {"Authorization": f"Bearer {key.token}", "Content-Type": "application/json"}
    # declared over the bound: 413 before a byte is read
    status, body = raw_post(door.port, "/v1/jobs", {**auth, "Content-Length": str(250 * 2**20)})
    assert status == 413 and orjson.loads(body)["error"]["code"] == "input_too_large"
    before = rss_mib(door.proc.pid)

    async def chunked_flood() -> list[int]:
        async def gen():
            chunk = b" " * 2**20  # whitespace: valid JSON padding, 50 MiB of it, never finished in time
            for _ in range(50):
                yield chunk

        async with httpx.AsyncClient(base_url=door.url, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/jobs", content=gen(), headers=auth) for _ in range(4)))
        return [r.status_code for r in rs]

    statuses = asyncio.run(chunked_flood())
    after = rss_mib(door.proc.pid)
    # each stopped at 64 KiB: 413 (or 429 past the key's upload slots, 503 with the budget full)
    assert set(statuses) <= {413, 429, 503} and 413 in statuses, statuses
    assert after - before < 64, (before, after)  # 200 MiB sent, a few KiB held per body
    # a body within the bound still works, and the door answers as fast as before
    made = httpx.post(f"{door.url}/v1/jobs", headers=auth, content=orjson.dumps({"name": "x" * 200}), timeout=30)
    assert made.status_code == 201, made.text
    assert JSON_BODY_MAX_BYTES == 65_536


def test_bad_job_bodies_are_400_naming_the_field(door, make_key):  # noqa: F811
    key = make_key("bodies-bad")
    auth = {"Authorization": f"Bearer {key.token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=door.url, headers=auth, timeout=30) as c:
        # a lone surrogate in a field name: bad input, not a Kafka outage
        r = c.post("/v1/jobs", content=b'{"task": "extract", "fields": ["total", "\\ud800"]}')
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        assert "Invalid JSON" in r.json()["error"]["message"]
        r = c.post("/v1/jobs", json={"name": "bell\x07and\x1bescape"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("body.name: String should match"), r.text
        job = c.post("/v1/jobs", json={"name": "counted"})
        assert job.status_code == 201
        job_id = job.json()["job_id"]
        for expected in ('"3"', "true", "1e3", "3.0", "null"):
            r = c.post(f"/v1/jobs/{job_id}/close", content=b'{"expected": ' + expected.encode() + b"}")
            assert r.status_code == 400, (expected, r.text)
            assert r.json()["error"]["message"].startswith("body.expected: "), (expected, r.text)
        r = c.post(f"/v1/jobs/{job_id}/close", content=b"not json")
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: Invalid JSON"), r.text
