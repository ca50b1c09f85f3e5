"""The HTTP door's upload budget under slow clients, on the real stack: bodies charged as their
bytes arrive, cut with 408 when they stall or trickle, per-client and per-key upload slots,
small bodies (cached images among them) answered while large slow uploads hold the budget, and
rate limits charged per image of a batch.

Slow clients are raw sockets bound to their own loopback addresses (127.0.0.x): the door sees
each as another client address, as it would see clients on the internet."""

from __future__ import annotations

import os
import re
import select
import socket
import threading
import time
import uuid

import httpx
import pytest

from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.integration.test_http_auth import cli
from tests.stack import API, metric_value

pytestmark = pytest.mark.stack

KiB = 1024
MiB = 1024 * KiB
BUDGET = 8 * MiB
DECLARED = 2 * MiB  # what each slow client announces: over the small-body size (1 MiB), under one S3 part
SENT_FIRST = 160 * KiB  # what it sends at once: 32 of them hold 5 MiB of the 8 MiB budget
PER_CLIENT = 8
IDLE_S = 4.0  # the trickler sends every 0.5 s: room for a loaded machine to stall it
MIN_RATE = 24 * KiB
GRACE_S = 20.0  # the slow uploads stay open while the test checks what else gets through
PACE_ENV = {
    "OCRSTREAM_LIMITS__MAX_IMAGE_BYTES": str(5 * MiB),
    "OCRSTREAM_HTTP_UPLOAD_BUDGET_BYTES": str(BUDGET),
    "OCRSTREAM_HTTP_UPLOADS_PER_CLIENT": str(PER_CLIENT),
    "OCRSTREAM_HTTP_BODY_TIMEOUT_S": "60",
    "OCRSTREAM_HTTP_BODY_IDLE_TIMEOUT_S": str(IDLE_S),
    "OCRSTREAM_HTTP_BODY_MIN_RATE_BYTES_PER_S": str(MIN_RATE),
    "OCRSTREAM_HTTP_BODY_MIN_RATE_GRACE_S": str(GRACE_S),
}


@pytest.fixture(scope="module")
def door(pipeline):
    """A door with an 8 MiB upload budget, 8 uploads per client address and a 4 s idle timeout."""
    st = pipeline.start(API, extra_env={**API_ENV, **PACE_ENV})
    st.url = f"http://127.0.0.1:{st.port}"
    yield st
    pipeline.stop(st)


def head(path: str = "/v1/ocr", length: int = DECLARED, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n{extra}"
            f"Content-Length: {length}\r\n\r\n").encode()


def connect(port: int, client: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(client, 0))


def answer_of(sock: socket.socket, timeout: float = 10) -> tuple[int, bytes]:
    """(status, whole answer) read from ``sock`` until the JSON body has ended."""
    sock.settimeout(timeout)
    got = b""
    while not got.endswith(b"}}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return int(got.split(b" ", 2)[1]), got


class Trickler(threading.Thread):
    """Sends one byte to each of its sockets every ``every_s`` seconds (never idle long enough for
    the idle timeout) until the door answers it; records (seconds since start, answer)."""

    def __init__(self, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.socks: list[socket.socket] = []
        self.answers: dict[int, tuple[float, bytes]] = {}
        self.started_at = time.monotonic()
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def add(self, sock: socket.socket) -> None:
        with self.lock:
            self.socks.append(sock)

    def run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                socks = list(enumerate(self.socks))
            for i, sock in socks:
                if i in self.answers:
                    continue
                if select.select([sock], [], [], 0)[0]:
                    self.answers[i] = (time.monotonic() - self.started_at, answer_of(sock)[1])
                    continue
                try:
                    sock.sendall(b"x")
                except OSError:
                    pass
            self.stopping.wait(self.every_s)

    def wait_answered(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < n and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self.stopping.set()
        self.join(10)
        for sock in self.socks:
            sock.close()


def gauges(door) -> dict[str, float]:
    with httpx.Client(base_url=door.url, timeout=10) as c:
        text = c.get("/metrics").text
    return {"open": metric_value(text, "ocrstream_http_uploads_open"),
            "held": metric_value(text, "ocrstream_http_upload_held_bytes", budget="uploads"),
            "small": metric_value(text, "ocrstream_http_upload_held_bytes", budget="small")}


def wait_for(door, want: dict[str, float], timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while (g := gauges(door)) != {**g, **want} and time.monotonic() < deadline:
        time.sleep(0.1)
    return g


def test_slow_uploads_hold_only_what_they_sent_small_and_cached_images_pass_and_the_slow_are_cut(door):
    """32 clients on 4 addresses announce 2 MiB bodies, send 160 KiB and then one byte every
    0.5 s (24 KiB/s is the minimum after 20 s). They hold 5 MiB of the 8 MiB budget (what they
    sent, not the 64 MiB they announced); more from an address already at its 8 are refused at
    once with 429. Meanwhile a cached image answers 200 and a new one 202 at once; a 4 MiB
    upload, which the held budget has no room for, 503. Each slow body is cut with 408 once its average rate is under the minimum (after its
    grace), and afterwards nothing is held."""
    cached = text_image(["CACHED 7781"])  # fixed texts the engine reads; the namespace is new each run
    fresh_text = "FRESH 7782"
    with httpx.Client(base_url=door.url, timeout=90) as c:
        rid = c.post("/v1/ocr", content=cached, headers={"Content-Type": "image/png"}).json()["request_id"]
        assert c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()["status"] == "ok"
    assert wait_for(door, {"open": 0, "held": 0, "small": 0}) == {"open": 0, "held": 0, "small": 0}

    addresses = [f"127.0.0.{11 + i}" for i in range(4)]
    slow = Trickler()
    slow.start()
    try:
        for addr in addresses:
            for _ in range(PER_CLIENT):
                sock = connect(door.port, addr)
                sock.sendall(head() + os.urandom(SENT_FIRST))
                slow.add(sock)
        # 5 MiB held: what they sent (and the bytes trickled since), not the 64 MiB they announced
        deadline = time.monotonic() + 5
        while ((g := gauges(door))["open"] < 32 or g["held"] < 32 * SENT_FIRST) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g["open"] == 32 and not slow.answers, (g, list(slow.answers.values())[:1])
        assert 32 * SENT_FIRST <= g["held"] < 32 * SENT_FIRST + 32 * 40 and g["small"] == 0, g

        for _ in range(3):  # an address at its limit: refused from its headers, before its body
            with connect(door.port, addresses[0]) as extra:
                extra.sendall(head())
                status, answer = answer_of(extra)
            assert status == 429 and b'"code":"too_many_uploads"' in answer, answer[:300]
            assert b"retry-after: 1\r\n" in answer.lower()
            assert f"client {addresses[0]} already has {PER_CLIENT} uploads in progress".encode() in answer

        victim = httpx.HTTPTransport(local_address="127.0.0.30")
        with httpx.Client(base_url=door.url, timeout=10, transport=victim) as c:
            t0 = time.monotonic()
            hit = c.post("/v1/ocr", content=cached, headers={"Content-Type": "image/png"})
            new = c.post("/v1/ocr", content=text_image([fresh_text]), headers={"Content-Type": "image/png"})
            took = time.monotonic() - t0
            large = c.post("/v1/ocr", content=os.urandom(4 * MiB), headers={"Content-Type": "image/png"})
        assert hit.status_code == 200 and hit.json()["cache_hit"] is True, hit.text
        assert new.status_code == 202, new.text
        assert took < 15, took  # not held until the slow uploads are cut (26.7 s)
        assert large.status_code == 503 and large.json()["error"]["code"] == "overloaded", large.text
        assert gauges(door)["open"] == 32 and not slow.answers  # all still in progress meanwhile

        slow.wait_answered(32, timeout=120)
        answers = slow.answers
    finally:
        slow.close()
    assert len(answers) == 32, f"{32 - len(answers)} slow uploads never answered"
    for at, answer in answers.values():
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
        assert b'"code":"request_timeout"' in answer and f"slower than {MIN_RATE} bytes/s".encode() in answer
        # 20 s of grace + 160 KiB of credit at 24 KiB/s = 26.7 s of waiting; before the 60 s whole-body bound
        assert 25 < at < 90, at
    assert wait_for(door, {"open": 0, "held": 0, "small": 0}) == {"open": 0, "held": 0, "small": 0}
    with httpx.Client(base_url=door.url, timeout=90) as c:
        got = c.get(f"/v1/ocr/{new.json()['request_id']}", params={"wait": 60}).json()
    assert got["status"] == "ok" and got["result"]["text"] == fresh_text, got


def test_a_body_that_stalls_is_cut_by_the_idle_timeout_and_gives_its_bytes_back(door):
    with connect(door.port, "127.0.0.40") as sock:
        sock.sendall(head() + os.urandom(100 * KiB))
        assert wait_for(door, {"open": 1, "held": 100 * KiB})["held"] == 100 * KiB
        t0 = time.monotonic()
        status, answer = answer_of(sock, timeout=30)
        took = time.monotonic() - t0
    assert status == 408 and f"no byte of the body came for {IDLE_S:g} s".encode() in answer, answer[:300]
    assert took < IDLE_S + 5, took
    assert wait_for(door, {"open": 0, "held": 0}) == {"open": 0, "held": 0, "small": 0}


# -- per key, and rate limits per image ------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(pipeline):
    """A door with keys required, 2 uploads per key, and a default bucket that never refills in a test;
    a body may stall 60 s (its tests hold uploads open while they check what else gets in)."""
    st = pipeline.start(API, extra_env={**API_ENV, **PACE_ENV, "OCRSTREAM_AUTH_REQUIRED": "true",
                                        "OCRSTREAM_AUTH_CACHE_S": "0", "OCRSTREAM_HTTP_UPLOADS_PER_KEY": "2",
                                        "OCRSTREAM_RATE_LIMIT_PER_S": "0.01", "OCRSTREAM_RATE_LIMIT_BURST": "5",
                                        "OCRSTREAM_WEBHOOK_ENABLED": "false",
                                        "OCRSTREAM_HTTP_BODY_IDLE_TIMEOUT_S": "60"})
    st.url = f"http://127.0.0.1:{st.port}"
    made: list[str] = []

    def make(*options: str) -> str:
        out = cli("keys", "create", "--name", f"fair-{uuid.uuid4().hex[:8]}", *options)
        assert out.returncode == 0, out.stderr
        fields = dict(re.findall(r"^(\w+):\s+(\S+)$", out.stdout, re.M))
        made.append(fields["key_id"])
        return fields["api_key"]

    st.make_key = make
    yield st
    for key_id in made:
        cli("keys", "revoke", key_id)
    pipeline.stop(st)


def test_a_key_has_at_most_its_uploads_in_progress_whatever_its_addresses(keyed):
    k1, k2 = keyed.make_key("--burst", "10"), keyed.make_key("--burst", "10")
    held = []
    try:
        for addr in ("127.0.0.51", "127.0.0.52"):
            sock = connect(keyed.port, addr)
            sock.sendall(head(extra=f"X-API-Key: {k1}\r\n") + os.urandom(10 * KiB))
            held.append(sock)
        wait_for(keyed, {"open": 2})
        with connect(keyed.port, "127.0.0.53") as third:
            third.sendall(head(extra=f"X-API-Key: {k1}\r\n"))
            status, answer = answer_of(third)
        assert status == 429 and b'"code":"too_many_uploads"' in answer, answer[:300]
        assert b"uploads in progress (OCRSTREAM_HTTP_UPLOADS_PER_KEY)" in answer
        with connect(keyed.port, "127.0.0.53") as other:  # another key from that address is let in
            other.sendall(head(extra=f"X-API-Key: {k2}\r\n") + os.urandom(KiB))
            assert wait_for(keyed, {"open": 3})["open"] == 3
    finally:
        for sock in held:
            sock.close()
    assert wait_for(keyed, {"open": 0, "held": 0})["open"] == 0


def _files(n: int) -> list:
    return [("files", (f"{i}.txt", b"not an image", "text/plain")) for i in range(n)]


def test_a_batch_of_n_images_costs_n_tokens_all_or_none(keyed):
    """Burst 5, no refill within the test: a batch of 3 leaves 2 tokens; a batch of 3 more is
    refused whole and takes nothing (both tokens still serve two images); then the bucket is
    empty and a batch is refused before its body is read."""
    auth = {"X-API-Key": keyed.make_key()}
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        r = c.post("/v1/ocr/batch", files=_files(3), headers=auth)
        assert r.status_code == 200 and [it["error"]["code"] for it in r.json()["items"]] == ["unsupported_format"] * 3
        r = c.post("/v1/ocr/batch", files=_files(3), headers=auth)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
        assert "3 images need 3 tokens" in r.json()["error"]["message"] and "nothing was taken" in r.json()["error"]["message"]
        assert 90 <= int(r.headers["retry-after"]) <= 100  # one more token at 0.01/s
        for _ in range(2):
            assert c.post("/v1/ocr", content=b"x", headers={**auth, "Content-Type": "text/plain"}).status_code == 415
        r = c.post("/v1/ocr", content=b"x", headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
    with connect(keyed.port, "127.0.0.60") as sock:  # empty bucket: refused from the headers
        sock.sendall(f"POST /v1/ocr/batch HTTP/1.1\r\nHost: x\r\nX-API-Key: {auth['X-API-Key']}\r\n"
                     f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {DECLARED}\r\n\r\n".encode())
        status, answer = answer_of(sock)
    assert status == 429 and b'"code":"rate_limited"' in answer, answer[:300]


def test_a_batch_of_the_burst_empties_the_bucket_and_the_next_image_is_refused(keyed):
    auth = {"X-API-Key": keyed.make_key()}
    with httpx.Client(base_url=keyed.url, timeout=60) as c:
        r = c.post("/v1/ocr/batch", files=_files(5), headers=auth)
        assert r.status_code == 200 and len(r.json()["items"]) == 5, r.text
        r = c.post("/v1/ocr", content=text_image(["SIXTH"]), headers={**auth, "Content-Type": "image/png"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
        # a batch over the burst passes a full bucket and leaves it in debt: 7 images, 5 tokens -> -2
        other = {"X-API-Key": keyed.make_key()}
        r = c.post("/v1/ocr/batch", files=_files(7), headers=other)
        assert r.status_code == 200 and len(r.json()["items"]) == 7, r.text
        r = c.post("/v1/ocr", content=b"x", headers={**other, "Content-Type": "text/plain"})
        assert r.status_code == 429 and 290 <= int(r.headers["retry-after"]) <= 300  # 3 tokens to one at 0.01/s
