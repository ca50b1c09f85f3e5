"""API keys, rate limits and quotas of the HTTP door on the real stack: keys made by the real CLI,
a door started with keys required, real MariaDB and Redis."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest
import redis

from services.common.db import Database
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.integration.test_http_events import sse
from tests.stack import API, REPO, free_port, metric_value

pytestmark = pytest.mark.stack

AUTH_CACHE_S = 0.5
DEFAULT_BURST = 4
CHALLENGE = 'Bearer realm="ocrstream"'
AUTH_ENV = {
    "OCRSTREAM_AUTH_REQUIRED": "true",
    "OCRSTREAM_AUTH_CACHE_S": str(AUTH_CACHE_S),
    "OCRSTREAM_RATE_LIMIT_PER_S": "0.01",  # one token per 100 s: the default bucket never refills in a test
    "OCRSTREAM_RATE_LIMIT_BURST": str(DEFAULT_BURST),
    "OCRSTREAM_WEBHOOK_ENABLED": "false",
}


@dataclass
class Key:
    key_id: str
    token: str
    webhook_secret: str


def cli(*args: str) -> subprocess.CompletedProcess:
    """``ocrstream ARGS`` in this session's namespace (a wide terminal so tables are not cut)."""
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="200"), timeout=60)


@pytest.fixture(scope="module")
def make_key():
    """``make_key(name, *options)``: a key created by ``ocrstream keys create``; deleted after the module."""
    made: list[str] = []
    tag = f"test-{time.time_ns() % 10**9}"

    def make(name: str, *options: str) -> Key:
        out = cli("keys", "create", "--name", f"{tag}-{name}", *options)
        assert out.returncode == 0, out.stderr
        fields = dict(re.findall(r"^(\w+):\s+(\S+)$", out.stdout, re.M))
        key = Key(fields["key_id"], fields["api_key"], fields["webhook_secret"])
        assert key.token.startswith(f"ocs_{key.key_id}_") and key.webhook_secret.startswith("whsec_")
        made.append(key.key_id)
        return key

    make.tag = tag
    yield make
    import asyncio

    db = Database(CommonSettings().mysql, pool_size=1)
    for key_id in made:
        asyncio.run(db.execute("DELETE FROM api_keys WHERE key_id = %s", key_id))


@pytest.fixture(scope="module")
def auth_api(pipeline):
    """A second HTTP door with keys required and a low default rate limit."""
    st = pipeline.start(API, extra_env=AUTH_ENV)
    st.url = f"http://127.0.0.1:{st.port}"
    yield st
    pipeline.stop(st)


def _client(st) -> httpx.Client:
    return httpx.Client(base_url=st.url, timeout=90)


def _not_an_image(c: httpx.Client, headers: dict) -> httpx.Response:
    """A submission the guard lets through gets 415 (checked after the key); one it stops, 401/429."""
    return c.post("/v1/ocr", content=b"plain text", headers={"Content-Type": "text/plain", **headers})


def test_ops_routes_stay_open_and_cors_is_closed(auth_api):
    with _client(auth_api) as c:
        for path in ("/healthz", "/readyz", "/metrics", "/"):
            assert c.get(path).status_code == 200, path
        r = c.get("/healthz", headers={"Origin": "https://elsewhere.example"})
        assert "access-control-allow-origin" not in r.headers
        pre = c.options("/v1/ocr", headers={"Origin": "https://elsewhere.example",
                                            "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers


def test_missing_malformed_and_unknown_keys_get_401(auth_api, make_key):
    good = make_key("probe", "--rate", "0")
    wrong_secret = good.token[:-1] + ("A" if good.token[-1] != "A" else "B")
    unknown = "ocs_000000000000_" + "x" * 43
    cases = [
        ({}, "an API key is required"),
        ({"X-API-Key": "hunter2"}, "malformed API key"),
        ({"Authorization": f"Basic {good.token}"}, "must be 'Bearer <API key>'"),
        ({"X-API-Key": good.token, "Authorization": f"Bearer {unknown}"}, "different keys"),
        ({"X-API-Key": unknown}, "unknown API key"),
        ({"Authorization": f"Bearer {wrong_secret}"}, "unknown API key"),
    ]
    with _client(auth_api) as c:
        for headers, message in cases:
            for r in (_not_an_image(c, headers), c.get("/v1/ocr/some-id", headers=headers)):
                assert r.status_code == 401, (headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "unauthorized" and message in err["message"], (headers, err)
                challenge = r.headers["www-authenticate"]
                if headers:
                    assert challenge.startswith(CHALLENGE + ', error="invalid_token"'), challenge
                else:
                    assert challenge == CHALLENGE
        # the same key as header or bearer token passes the guard
        assert _not_an_image(c, {"X-API-Key": good.token}).status_code == 415
        assert _not_an_image(c, {"Authorization": f"Bearer {good.token}"}).status_code == 415
        metrics = c.get("/metrics").text
    assert metric_value(metrics, "ocrstream_auth_total", outcome="unknown") == 4
    assert metric_value(metrics, "ocrstream_auth_total", outcome="missing") == 2


def test_a_key_reads_its_own_results_only(auth_api, make_key):
    alice = make_key("alice", "--rate", "100", "--burst", "100")
    bob = make_key("bob", "--rate", "100", "--burst", "100")
    with _client(auth_api) as c:
        r = c.post("/v1/ocr", content=text_image(["KEYED", "ALICE"]), headers={"Content-Type": "image/png",
                                                                          "X-API-Key": alice.token})
        assert r.status_code == 202, r.text
        rid = r.json()["request_id"]
        got = c.get(f"/v1/ocr/{rid}", params={"wait": 60}, headers={"Authorization": f"Bearer {alice.token}"})
        assert got.status_code == 200 and got.json()["status"] == "ok", got.text
        assert got.json()["result"]["text"] == "KEYED\nALICE"
        assert got.json()["result"]["api_key_id"] == alice.key_id
        other = c.get(f"/v1/ocr/{rid}", headers={"X-API-Key": bob.token})
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
        assert c.get(f"/v1/ocr/{rid}").status_code == 401


def test_revoked_key_is_refused_once_the_lookup_cache_expires(auth_api, make_key):
    key = make_key("to-revoke", "--rate", "0")
    with _client(auth_api) as c:
        assert _not_an_image(c, {"X-API-Key": key.token}).status_code == 415
        out = cli("keys", "revoke", key.key_id)
        assert out.returncode == 0 and f"revoked {key.key_id}" in out.stdout, out.stderr
        time.sleep(AUTH_CACHE_S + 0.2)  # the documented bound: OCRSTREAM_AUTH_CACHE_S
        r = _not_an_image(c, {"X-API-Key": key.token})
        assert r.status_code == 401 and r.json()["error"]["message"] == f"API key {key.key_id} has been revoked"
        assert 'error="invalid_token"' in r.headers["www-authenticate"]
    again = cli("keys", "revoke", key.key_id)  # idempotent
    assert again.returncode == 0
    assert cli("keys", "revoke", "000000000000").returncode == 1


@pytest.mark.parametrize("options, burst", [(("--rate", "0.01", "--burst", "3"), 3), ((), DEFAULT_BURST)],
                         ids=["per-key", "server-default"])
def test_burst_plus_one_rapid_requests_the_last_gets_429_with_retry_after(auth_api, make_key, options, burst):
    key = make_key("bucket", *options)
    other = make_key("bystander")
    with _client(auth_api) as c:
        got = [_not_an_image(c, {"X-API-Key": key.token}) for _ in range(burst + 2)]
        assert [r.status_code for r in got] == [415] * burst + [429, 429]
        for r in got[burst:]:
            assert r.json()["error"]["code"] == "rate_limited"
            # 0.01 tokens/s: 100 s to the next token, less what refilled since (whole seconds, rounded up)
            assert 90 <= int(r.headers["retry-after"]) <= 100
        assert f"API key {key.key_id} is limited to 0.01 requests/s (burst {burst})" in got[-1].json()["error"]["message"]
        # reads take tokens too; another key has its own bucket
        assert c.get("/v1/ocr/nope", headers={"X-API-Key": key.token}).status_code == 429
        assert _not_an_image(c, {"X-API-Key": other.token}).status_code == 415


def test_a_small_keyed_upload_takes_its_limit_and_cache_lookup_in_one_redis_call(auth_api, make_key):
    """The Helm configuration's cached path: a small raw body is read first, then one Lua call takes
    the token, counts the submission and looks the image up (no second round trip for the limit).
    The limit still holds: the bucket's last token goes to a cached answer, the next is a 429 that
    stores nothing; and a bad request read first still takes its token."""
    key = make_key("one-call", "--rate", "0.01", "--burst", "4", "--quota-per-day", "100")
    auth = {"X-API-Key": key.token, "Content-Type": "image/png"}
    img = text_image(["KEYED HIT 8801"])

    def calls(c: httpx.Client) -> tuple[float, float]:
        text = c.get("/metrics").text
        return tuple(metric_value(text, "ocrstream_store_call_seconds_count", store="redis", op=op)
                     for op in ("ratelimit_lookup", "ratelimit"))

    with _client(auth_api) as c:
        before = calls(c)
        first = c.post("/v1/ocr", content=img, headers=auth)  # token 1: a miss, sent to the pipeline
        assert first.status_code == 202, first.text
        done = c.get(f"/v1/ocr/{first.json()['request_id']}?wait=60", headers={"X-API-Key": key.token})  # token 2
        assert done.status_code == 200 and done.json()["result"]["text"] == "KEYED HIT 8801", done.text
        hit = c.post("/v1/ocr", content=img, headers=auth)  # token 3: answered from the cache
        assert hit.status_code == 200 and hit.json()["cache_hit"] is True and hit.json()["result"]["text"] == "KEYED HIT 8801"
        after = calls(c)
        assert (after[0] - before[0], after[1] - before[1]) == (2, 1)  # the GET's limit alone is a call of its own
        assert c.post("/v1/ocr", content=b"not an image", headers=auth).status_code == 415  # token 4
        refused = c.post("/v1/ocr", content=img, headers=auth)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited", refused.text
        assert 90 <= int(refused.headers["retry-after"]) <= 100
        assert c.post("/v1/ocr", content=b"not an image", headers=auth).status_code == 429
    # three submissions counted against the quota (the refused ones count nothing)
    r = redis.Redis.from_url(os.environ.get("OCRSTREAM_REDIS__URL", "redis://127.0.0.1:6379/0"))
    try:
        prefix = os.environ["OCRSTREAM_REDIS__KEY_PREFIX"]
        day = int(time.time() * 1000) // 86_400_000
        assert int(r.get(f"{prefix}:quota:{key.key_id}:{day}")) == 3
    finally:
        r.close()


def test_daily_quota_counts_submissions_not_reads(auth_api, make_key):
    key = make_key("quota", "--rate", "0", "--quota-per-day", "2")
    with _client(auth_api) as c:
        got = [_not_an_image(c, {"X-API-Key": key.token}) for _ in range(3)]
        assert [r.status_code for r in got] == [415, 415, 429]
        err = got[2].json()["error"]
        assert err["code"] == "quota_exceeded" and "used its 2 submissions of this UTC day" in err["message"]
        midnight_s = 86_400 - int(time.time()) % 86_400
        assert 1 <= int(got[2].headers["retry-after"]) <= midnight_s + 1
        assert c.get("/v1/ocr/nope", headers={"X-API-Key": key.token}).status_code == 404


def test_a_batch_counts_one_submission_per_image(auth_api, make_key):
    """A quota of 4 takes one batch of 3 and then one image; a batch of 3 more is refused whole and
    counts nothing; one larger than the whole quota is told to split (it used to count as one POST:
    two batches of 5 passed a quota of 2)."""
    key = make_key("batchquota", "--rate", "0", "--quota-per-day", "4")
    files = lambda n: [("files", (f"{i}.txt", b"not an image", "text/plain")) for i in range(n)]  # noqa: E731
    auth = {"X-API-Key": key.token}
    with _client(auth_api) as c:
        r = c.post("/v1/ocr/batch", files=files(3), headers=auth)
        assert r.status_code == 200 and [it["error"]["code"] for it in r.json()["items"]] == ["unsupported_format"] * 3
        r = c.post("/v1/ocr/batch", files=files(3), headers=auth)
        err = r.json()["error"]
        assert r.status_code == 429 and err["code"] == "quota_exceeded" and 1 <= int(r.headers["retry-after"]) <= 86_401
        assert err["message"].startswith(f"a batch counts one submission per image: 3 images, but API key {key.key_id} "
                                         "has 1 of its 4 submissions of this UTC day left")
        r = c.post("/v1/ocr/batch", files=files(5), headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request" and "retry-after" not in r.headers
        assert "5 images exceed" in r.json()["error"]["message"]
        assert _not_an_image(c, auth).status_code == 415  # the one left
        assert _not_an_image(c, auth).status_code == 429


def test_keys_list_shows_limits_and_revocation_never_secrets(auth_api, make_key):
    limited = make_key("listed", "--rate", "2.5", "--burst", "7", "--quota-per-day", "900")
    revoked = make_key("listed-revoked")
    assert cli("keys", "revoke", revoked.key_id).returncode == 0
    out = cli("keys", "list")
    assert out.returncode == 0, out.stderr
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in out.stdout.splitlines() if line.count("│") >= 8}
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$"
    row = rows[limited.key_id]
    assert row[1:5] == [f"{make_key.tag}-listed", "2.5", "7", "900"]
    assert re.match(stamp, row[5]) and row[6] == ""
    row = rows[revoked.key_id]
    assert row[1:5] == [f"{make_key.tag}-listed-revoked", "default", "default", "default"]
    assert re.match(stamp, row[6])
    for key in (limited, revoked):
        assert key.token.split("_", 2)[2] not in out.stdout and key.webhook_secret not in out.stdout
    active = cli("keys", "list", "--active").stdout
    assert limited.key_id in active and revoked.key_id not in active


def test_redis_down_lets_keyed_requests_through_and_counts_them(pipeline, make_key):
    key = make_key("fail-open")
    st = pipeline.start(API, extra_env={**AUTH_ENV, "OCRSTREAM_RATE_LIMIT_BURST": "1",
                                        "OCRSTREAM_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0"})
    st.url = f"http://127.0.0.1:{st.port}"
    try:
        with _client(st) as c:
            got = [_not_an_image(c, {"X-API-Key": key.token}).status_code for _ in range(3)]
            assert got == [415, 415, 415]  # burst 1, yet nothing is limited: fail open
            assert metric_value(c.get("/metrics").text, "ocrstream_rate_limit_total", outcome="unavailable") == 3
            assert _not_an_image(c, {}).status_code == 401  # keys are still required
    finally:
        pipeline.stop(st)


def test_an_event_stream_shows_a_key_its_own_requests_only(auth_api, make_key):
    alice = make_key("sse-alice", "--rate", "100", "--burst", "100")
    bob = make_key("sse-bob", "--rate", "100", "--burst", "100")
    with _client(auth_api) as c:
        mine = c.post("/v1/ocr", content=text_image(["ALICE STREAM"]), headers={"Content-Type": "image/png",
                                                                                "X-API-Key": alice.token})
        theirs = c.post("/v1/ocr", content=text_image(["BOB STREAM"]), headers={"Content-Type": "image/png",
                                                                               "X-API-Key": bob.token})
        assert mine.status_code == theirs.status_code == 202, (mine.text, theirs.text)
        a_rid, b_rid = mine.json()["request_id"], theirs.json()["request_id"]
        assert c.get("/v1/events", params={"id": a_rid}).status_code == 401
        # another key's request only: 404, as GET /v1/ocr/{id} answers
        r = c.get("/v1/events", params={"id": a_rid}, headers={"X-API-Key": bob.token})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        # mixed: bob's own request is followed, alice's is an error event, and its completion never shows
        with c.stream("GET", "/v1/events", params={"id": [b_rid, a_rid], "timeout": 120},
                      headers={"Authorization": f"Bearer {bob.token}"}) as resp:
            assert resp.status_code == 200
            events = [ev for ev in sse(resp) if "comment" not in ev]
    assert [(ev["event"], ev["id"]) for ev in events[1:2]] == [("error", a_rid)]
    assert events[1]["data"]["error"]["code"] == "not_found"
    completed = [ev for ev in events if ev["event"] == "completed"]
    assert [ev["id"] for ev in completed] == [b_rid]
    assert completed[0]["data"]["result"]["text"] == "BOB STREAM"
    assert completed[0]["data"]["result"]["api_key_id"] == bob.key_id
    assert events[-1]["event"] == "end" and events[-1]["data"]["not_found"] == [a_rid]
    assert events[-1]["data"]["reason"] == "done"
