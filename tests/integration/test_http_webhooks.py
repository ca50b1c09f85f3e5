"""Webhooks on the real stack: signed delivery to a local receiver, retry after a 500, every
attempt in MariaDB, callbacks refused by the SSRF guard, redirects never followed."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import orjson
import pytest

from services.common.webhooks.signing import verify_signature
from tests.conftest import text_image
from tests.integration.conftest import API_ENV, WEBHOOK_RETRY_FOR_S, WEBHOOK_SECRET
from tests.stack import API, REPO, db_rows, metric_value

pytestmark = pytest.mark.stack


class Receiver:
    """A webhook endpoint on 127.0.0.1 (``http.server`` in a thread) answering attempt ``i``
    with ``statuses[i]`` (the last one repeats) and recording every request it gets.

    Args:
        statuses: HTTP statuses to answer, in order.
        location: ``Location`` header sent with 3xx answers.
    """

    def __init__(self, statuses: list[int], location: str | None = None):
        self.statuses = statuses
        self.location = location
        self.hits: list[dict] = []
        self._lock = threading.Lock()
        rcv = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with rcv._lock:
                    rcv.hits.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    status = rcv.statuses[min(len(rcv.hits), len(rcv.statuses)) - 1]
                self.send_response(status)
                if 300 <= status < 400 and rcv.location:
                    self.send_header("Location", rcv.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Receiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _delivery(rid: str, until_state: tuple[str, ...], timeout: float = 90) -> dict:
    """The request's delivery row once its state is one of ``until_state`` (or the last seen row)."""
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = db_rows("SELECT * FROM webhook_deliveries WHERE request_id = %s", rid)
        if rows and rows[0]["state"] in until_state:
            break
        time.sleep(0.2)
    assert len(rows) == 1, f"expected one delivery for {rid}, got {rows}"
    return rows[0]


def _attempts(delivery_id: str) -> list[dict]:
    return db_rows("SELECT attempt, http_status, error FROM webhook_attempts WHERE delivery_id = %s ORDER BY attempt",
                    delivery_id)


def _submit(c: httpx.Client, lines: list[str], callback_url: str, rid: str) -> httpx.Response:
    return c.post("/v1/ocr", content=text_image(lines, size=40), headers={"Content-Type": "image/png"},
                  params={"callback_url": callback_url, "request_id": rid})


def test_completion_is_delivered_signed_and_retried_after_a_500(api):
    rid = f"wh-ok-{time.time_ns()}"
    with Receiver([500, 200]) as rcv, httpx.Client(base_url=api.url, timeout=90) as c:
        r = _submit(c, ["HOOK DELIVERED"], f"{rcv.url}/hooks/ocr?tenant=t1", rid)
        assert r.status_code == 202, r.text
        done = c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()
        assert done["status"] == "ok" and done["result"]["text"] == "HOOK DELIVERED"

        row = _delivery(rid, ("delivered", "failed"))
        assert row["state"] == "delivered" and row["attempts"] == 2 and row["last_status"] == 200
        assert row["url"] == f"{rcv.url}/hooks/ocr?tenant=t1"
        assert _attempts(row["delivery_id"]) == [
            {"attempt": 1, "http_status": 500, "error": "HTTP 500"},
            {"attempt": 2, "http_status": 200, "error": None},
        ]

        assert len(rcv.hits) == 2  # one failure, one retry, nothing after the 200
        for n, hit in enumerate(rcv.hits, start=1):
            h = hit["headers"]
            assert hit["path"] == "/hooks/ocr?tenant=t1"
            assert h["Host"] == f"127.0.0.1:{rcv.port}" and h["Content-Type"] == "application/json"
            assert h["X-Ocrstream-Delivery"] == row["delivery_id"] and h["X-Ocrstream-Attempt"] == str(n)
            d, ts, sig = h["X-Ocrstream-Delivery"], h["X-Ocrstream-Timestamp"], h["X-Ocrstream-Signature"]
            assert verify_signature(WEBHOOK_SECRET, d, ts, hit["body"], sig)
            assert not verify_signature("another-secret", d, ts, hit["body"], sig)
            assert not verify_signature(WEBHOOK_SECRET, "whd_" + "0" * 40, ts, hit["body"], sig)  # id is signed
            ev = orjson.loads(hit["body"])
            assert ev["schema"] == "ocr.completed.v1" and ev["request_id"] == rid
            assert ev["result"]["status"] == "ok" and ev["result"]["text"] == "HOOK DELIVERED"
            assert ev["result"]["callback_url"] == row["url"]
        assert rcv.hits[0]["body"] == rcv.hits[1]["body"]  # a retry sends the same event

        metrics = httpx.get(f"http://127.0.0.1:{api.webhooks.port}/metrics", timeout=10).text  # the webhooks stage's
        assert metric_value(metrics, "ocrstream_webhook_attempts_total", outcome="5xx") >= 1
        assert metric_value(metrics, "ocrstream_webhook_deliveries_total", outcome="delivered") >= 1


def test_a_cache_hit_answered_at_once_still_gets_its_webhook(api):
    """The door answers a cached image in the upload call (200); the completion it publishes
    carries the callback, and the answer waits for Kafka's acknowledgement of it, so the webhook
    is as durable as any other."""
    first, again = f"wh-miss-{time.time_ns()}", f"wh-hit-{time.time_ns()}"
    with Receiver([200]) as rcv, httpx.Client(base_url=api.url, timeout=90) as c:
        image = text_image(["HOOK CACHED"], size=40)
        r = c.post("/v1/ocr", content=image, headers={"Content-Type": "image/png"}, params={"request_id": first})
        assert r.status_code == 202, r.text
        assert c.get(f"/v1/ocr/{first}", params={"wait": 60}).json()["status"] == "ok"
        r = c.post("/v1/ocr", content=image, headers={"Content-Type": "image/png"},
                   params={"request_id": again, "callback_url": f"{rcv.url}/hooks/hit"})
        assert r.status_code == 200 and r.json()["cache_hit"] is True, r.text
        row = _delivery(again, ("delivered", "failed"))
        assert row["state"] == "delivered" and row["attempts"] == 1
        [hit] = rcv.hits
        h = hit["headers"]
        assert verify_signature(WEBHOOK_SECRET, h["X-Ocrstream-Delivery"], h["X-Ocrstream-Timestamp"], hit["body"],
                                h["X-Ocrstream-Signature"])
        ev = orjson.loads(hit["body"])
        assert ev["request_id"] == again and ev["result"]["cache_hit"] is True and ev["result"]["text"] == "HOOK CACHED"


@pytest.mark.parametrize("callback_url, message", [
    ("http://example.com/hook", "callback host 'example.com' is not on the allow-list"),
    ("https://127.0.0.1.example.net/hook", "callback host '127.0.0.1.example.net' is not on the allow-list"),
    ("ftp://127.0.0.1/hook", "callback_url must be http or https, not 'ftp'"),
    ("http://admin:pw@127.0.0.1/hook", "callback_url must not contain a user name or password"),
])
def test_callback_to_a_disallowed_url_is_refused_and_nothing_is_queued(api, callback_url, message):
    rid = f"wh-refused-{time.time_ns()}"
    with httpx.Client(base_url=api.url, timeout=30) as c:
        r = _submit(c, ["NEVER SENT"], callback_url, rid)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"code": "callback_not_allowed", "message": message}
        assert c.get(f"/v1/ocr/{rid}").status_code == 404


def test_redirect_is_not_followed_and_the_delivery_gives_up(api):
    """A 302 (here to another allowed endpoint, which would show if it were followed; in an
    attack it points at e.g. http://169.254.169.254/) is a failed attempt; retries stop at the
    give-up time and the delivery ends ``failed``."""
    rid = f"wh-302-{time.time_ns()}"
    with Receiver([200]) as trap, Receiver([302], location=f"{trap.url}/trap") as redirector, \
            httpx.Client(base_url=api.url, timeout=90) as c:
        r = _submit(c, ["REDIRECT 302"], f"{redirector.url}/hook", rid)
        assert r.status_code == 202, r.text
        assert c.get(f"/v1/ocr/{rid}", params={"wait": 60}).json()["status"] == "ok"

        row = _delivery(rid, ("delivered", "failed"), timeout=WEBHOOK_RETRY_FOR_S + 90)
        assert row["state"] == "failed" and row["last_status"] == 302 and row["delivered_at_ms"] is None
        assert row["give_up_at_ms"] - row["created_at_ms"] == WEBHOOK_RETRY_FOR_S * 1000
        attempts = _attempts(row["delivery_id"])
        assert len(attempts) >= 2  # retried with backoff until the give-up time
        assert [a["attempt"] for a in attempts] == list(range(1, len(attempts) + 1))
        expected = f"HTTP 302: redirect to '{trap.url}/trap' not followed"
        assert all(a["http_status"] == 302 and a["error"] == expected for a in attempts)
        assert len(redirector.hits) == len(attempts) == row["attempts"]
        assert trap.hits == []


@pytest.fixture(scope="module")
def keyed_api(api, pipeline):
    """A door requiring API keys (its callbacks delivered by the session's webhooks stage) and a
    key made by ``ocrstream keys create``: ``(door, key_id, api_key, webhook_secret)``."""
    out = subprocess.run([sys.executable, "-m", "services.cli", "keys", "create", "--name", f"wh-{time.time_ns()}",
                          "--rate", "0"], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="200"), timeout=60)
    assert out.returncode == 0, out.stderr
    fields = dict(re.findall(r"^(\w+):\s+(\S+)$", out.stdout, re.M))
    st = pipeline.start(API, extra_env={**API_ENV, "OCRSTREAM_AUTH_REQUIRED": "true"})
    st.url = f"http://127.0.0.1:{st.port}"
    yield st, fields["key_id"], fields["api_key"], fields["webhook_secret"]
    pipeline.stop(st)
    db_rows("DELETE FROM api_keys WHERE key_id = %s", fields["key_id"])


def test_callback_of_a_keyed_request_is_signed_with_the_keys_secret(keyed_api):
    door, key_id, token, key_secret = keyed_api
    rid = f"wh-key-{time.time_ns()}"
    with Receiver([200]) as rcv, httpx.Client(base_url=door.url, timeout=90, headers={"X-API-Key": token}) as c:
        r = _submit(c, ["HOOK DELIVERED"], f"{rcv.url}/keyed", rid)
        assert r.status_code in (200, 202), r.text  # the image may be cached by the test above
        row = _delivery(rid, ("delivered", "failed"))
        assert row["state"] == "delivered" and row["key_id"] == key_id and row["attempts"] == 1
        [hit] = rcv.hits
        h = hit["headers"]
        d, ts, sig = h["X-Ocrstream-Delivery"], h["X-Ocrstream-Timestamp"], h["X-Ocrstream-Signature"]
        assert d == row["delivery_id"] and key_secret.startswith("whsec_")
        assert verify_signature(key_secret, d, ts, hit["body"], sig)
        # the key is the whole whsec_... string as UTF-8 bytes, nothing decoded
        assert sig == "v1=" + hmac.new(key_secret.encode(), f"{d}.{ts}.".encode() + hit["body"], hashlib.sha256).hexdigest()
        assert not verify_signature(WEBHOOK_SECRET, d, ts, hit["body"], sig)
        ev = orjson.loads(hit["body"])
        assert ev["request_id"] == rid and ev["result"]["api_key_id"] == key_id
        assert ev["result"]["text"] == "HOOK DELIVERED"


def test_finished_deliveries_are_deleted_after_the_retention_period_with_their_attempts():
    """purge_finished on real MariaDB: an old delivered row goes with its attempts; an old row
    still pending, a recent delivered row and another group's old row stay."""
    import asyncio
    import uuid

    from services.common.db import Database
    from services.common.settings import CommonSettings
    from services.common.webhooks.store import NewDelivery, WebhookStore

    tag = uuid.uuid4().hex[:10]
    day = 86_400_000
    now = int(time.time() * 1000)

    def new(name: str) -> NewDelivery:
        return NewDelivery(f"{tag}-{name}", f"req-{tag}-{name}", None, "https://example.com/hook", "{}")

    async def run():
        db = Database(CommonSettings().mysql, pool_size=1)
        mine, other = WebhookStore(db, f"purge-{tag}"), WebhookStore(db, f"purge-other-{tag}")
        await mine.enqueue([new("old-done"), new("old-pending")], now - 10 * day, 3_600_000)
        await mine.enqueue([new("new-done")], now, 3_600_000)
        await other.enqueue([new("other-old-done")], now - 10 * day, 3_600_000)
        for store, finished in ((mine, {"old-done", "new-done"}), (other, {"other-old-done"})):
            for c in await store.claim(10, now, 60_000):
                done = c.delivery_id.removeprefix(f"{tag}-") in finished
                assert await store.record(c, at_ms=now, duration_ms=1.0, http_status=200 if done else 500, error=None,
                                          state="delivered" if done else "pending", next_attempt_at_ms=now + 60_000,
                                          delivered_at_ms=now if done else None)
        assert await mine.purge_finished(now - 7 * day, batch=1) == 1
        assert await mine.purge_finished(now - 7 * day) == 0

    asyncio.run(run())
    left = db_rows("SELECT delivery_id, state FROM webhook_deliveries WHERE delivery_id LIKE %s ORDER BY delivery_id", f"{tag}-%")
    assert [(r["delivery_id"].removeprefix(f"{tag}-"), r["state"]) for r in left] == [
        ("new-done", "delivered"), ("old-pending", "pending"), ("other-old-done", "delivered")]
    attempts = db_rows("SELECT delivery_id FROM webhook_attempts WHERE delivery_id LIKE %s ORDER BY delivery_id", f"{tag}-%")
    assert [r["delivery_id"].removeprefix(f"{tag}-") for r in attempts] == ["new-done", "old-pending", "other-old-done"]


@pytest.fixture(scope="module")
def public_only_api(pipeline):
    """A door as deployed (``webhook_allow_private`` off, its default) whose allow-list names loopback,
    private and link-local hosts, so only the address check can refuse them; it accepts no callback
    (``webhook_enabled`` off: the refusal is at submit, by the address check first)."""
    st = pipeline.start(API, extra_env={
        **API_ENV, "OCRSTREAM_WEBHOOK_ALLOW_PRIVATE": "false", "OCRSTREAM_WEBHOOK_ENABLED": "false",
        "OCRSTREAM_WEBHOOK_ALLOWED_HOSTS":
            '["127.0.0.1", "localhost", "::1", "10.*", "169.254.169.254", "93.184.215.14"]'})
    st.url = f"http://127.0.0.1:{st.port}"
    yield st
    pipeline.stop(st)


PUBLIC_ONLY = "only public addresses may be called"


def test_callbacks_to_private_addresses_are_refused_at_submit_by_a_door_as_deployed(api, public_only_api):
    """A live receiver on loopback: the session's door (private allowed, local testing) delivers to it;
    the door as deployed refuses the same callback at submit, 400 ``callback_not_allowed`` naming the
    address and its range, even for an image it would answer from the cache, and stores nothing."""
    img_lines = ["SSRF GUARD 4040"]
    with Receiver([200]) as rcv, httpx.Client(base_url=api.url, timeout=90) as local, \
            httpx.Client(base_url=public_only_api.url, timeout=30) as door:
        ok_rid = f"wh-local-{time.time_ns()}"
        r = _submit(local, img_lines, f"{rcv.url}/hook", ok_rid)
        assert r.status_code == 202, r.text
        assert _delivery(ok_rid, ("delivered", "failed"))["state"] == "delivered" and len(rcv.hits) == 1

        cases = {
            f"{rcv.url}/hook": f"callback address 127.0.0.1 is a loopback address; {PUBLIC_ONLY}",
            f"http://[::1]:{rcv.port}/hook": f"callback address ::1 is a loopback address; {PUBLIC_ONLY}",
            "http://10.0.0.7/hook": f"callback address 10.0.0.7 is a private address; {PUBLIC_ONLY}",
            "http://169.254.169.254/latest/meta-data/":
                f"callback address 169.254.169.254 is a link-local address; {PUBLIC_ONLY}",
        }
        refused = []
        for url, message in cases.items():
            rid = f"wh-private-{time.time_ns()}"
            refused.append(rid)
            r = _submit(door, img_lines, url, rid)  # the image is cached: the callback is still checked first
            assert r.status_code == 400, (url, r.text)
            assert r.json()["error"] == {"code": "callback_not_allowed", "message": message}
            assert door.get(f"/v1/ocr/{rid}").status_code == 404
        # a name resolving to loopback (whichever of 127.0.0.1 and ::1 the resolver gives first)
        rid = f"wh-private-{time.time_ns()}"
        refused.append(rid)
        r = _submit(door, img_lines, f"http://localhost:{rcv.port}/hook", rid)
        assert r.status_code == 400 and r.json()["error"]["code"] == "callback_not_allowed", r.text
        assert re.fullmatch(rf"callback host 'localhost' resolves to (127\.0\.0\.1|::1), a loopback address; {PUBLIC_ONLY}",
                            r.json()["error"]["message"]), r.text
        assert door.get(f"/v1/ocr/{rid}").status_code == 404

        # the same image without a callback is answered from the cache: only the callback was refused
        cached = door.post("/v1/ocr", content=text_image(img_lines, size=40), headers={"Content-Type": "image/png"})
        assert cached.status_code == 200 and cached.json()["result"]["text"] == "SSRF GUARD 4040", cached.text
        assert len(rcv.hits) == 1  # nothing was delivered for the refused submissions
    marks = ", ".join(["%s"] * len(refused))
    assert db_rows(f"SELECT request_id FROM webhook_deliveries WHERE request_id IN ({marks})", *refused) == []
    assert db_rows(f"SELECT request_id FROM requests WHERE request_id IN ({marks})", *refused) == []


def test_a_callback_is_refused_by_a_door_whose_webhooks_are_disabled(public_only_api):
    """A callback URL the guard lets through (a public address on the allow-list) is still refused,
    400 ``invalid_request`` naming the setting, by a door with ``OCRSTREAM_WEBHOOK_ENABLED=false``:
    nothing there would ever send it. Nothing is stored and no connection is made."""
    rid = f"wh-off-{time.time_ns()}"
    with httpx.Client(base_url=public_only_api.url, timeout=30) as door:
        r = _submit(door, ["HOOKS OFF 3131"], "https://93.184.215.14/hook", rid)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"code": "invalid_request", "message": "callback_url is refused: webhooks are "
                                     "disabled on this server (OCRSTREAM_WEBHOOK_ENABLED=false)"}
        assert door.get(f"/v1/ocr/{rid}").status_code == 404
        ok = door.post("/v1/ocr", content=text_image(["HOOKS OFF 3131"], size=40), headers={"Content-Type": "image/png"})
        assert ok.status_code in (200, 202), ok.text  # without a callback the image goes through
