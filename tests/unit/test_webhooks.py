"""Webhook pieces without the stack: the SSRF guard, signatures, ids and backoff."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

import pytest
from pydantic import SecretStr

from services.common.webhooks.callbacks import CallbackRefused, address_refusal, check_callback, parse_callback_url
from services.api.errors import ApiError
from services.api.settings import ApiSettings
from services.common.webhooks.signing import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, sign, verify_signature
from services.api.serving_webhooks import validate_callback_url
from services.webhooks.delivery import backoff_s
from services.webhooks.handler import delivery_id

ALLOW = ["hooks.example.com", "*.partner.example", "127.0.0.1", "localhost", "169.254.169.254", "[::1]", "::1"]


# -- URL checks without DNS -------------------------------------------------------------------
@pytest.mark.parametrize("url, reason", [
    ("ftp://hooks.example.com/x", "must be http or https, not 'ftp'"),
    ("file:///etc/passwd", "must be http or https, not 'file'"),
    ("http://user:pw@hooks.example.com/x", "must not contain a user name or password"),
    ("http://user@hooks.example.com/x", "must not contain a user name or password"),
    ("http://evil.example.org/x", "host 'evil.example.org' is not on the allow-list"),
    ("http://hooks.example.com.evil.org/", "host 'hooks.example.com.evil.org' is not on the allow-list"),
    ("http://partner.example/x", "host 'partner.example' is not on the allow-list"),  # *. needs a sub-domain
    ("http://127.0.0.1\\@evil.org/", "must not contain a user name or password"),  # one parser: as sent
    ("http://:80/x", "no host"),
    ("http://hooks.example.com:99999/x", "port 99999 is not a TCP port"),
    ("http://hooks.example.com:0/x", "port 0 is not a TCP port"),
])
def test_static_refusals_name_the_reason(url, reason):
    with pytest.raises(CallbackRefused) as err:
        parse_callback_url(url, ALLOW)
    assert reason in err.value.reason
    assert err.value.retriable is False


def test_allow_list_is_case_insensitive_and_matches_patterns():
    url, host = parse_callback_url("https://HOOKS.Example.COM./cb?x=1#frag", ALLOW)
    assert host == "hooks.example.com"
    assert str(url) == "https://hooks.example.com./cb?x=1"  # the fragment is never sent
    assert parse_callback_url("http://a.b.partner.example:8443/", ALLOW)[1] == "a.b.partner.example"


def test_empty_allow_list_allows_nothing():
    with pytest.raises(CallbackRefused, match="no host is allowed"):
        parse_callback_url("https://hooks.example.com/", [])


@pytest.mark.parametrize("addr, why", [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.10", "private"), ("172.16.5.5", "private"),
    ("169.254.169.254", "link-local"), ("100.64.0.1", "not globally routable"), ("0.0.0.0", "unspecified"),
    ("224.0.0.1", "multicast"), ("::1", "loopback"), ("fd00::1", "private"), ("fe80::1", "link-local"),
    ("::ffff:169.254.169.254", "link-local"), ("2002:a9fe:a9fe::1", "link-local"),  # 6to4 of 169.254.169.254
    ("192.0.2.7", "private"), ("240.0.0.1", "private"), ("::", "unspecified"),
])
def test_non_public_addresses_are_refused(addr, why):
    assert address_refusal(ipaddress.ip_address(addr), allow_private=False) == why


def test_public_addresses_pass_and_allow_private_keeps_unspecified_and_multicast_out():
    assert address_refusal(ipaddress.ip_address("93.184.215.14"), False) is None
    assert address_refusal(ipaddress.ip_address("2606:4700::1111"), False) is None
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), True) is None
    assert address_refusal(ipaddress.ip_address("169.254.169.254"), True) is None
    assert address_refusal(ipaddress.ip_address("0.0.0.0"), True) == "unspecified"
    assert address_refusal(ipaddress.ip_address("239.1.1.1"), True) == "multicast"


# -- checks with resolution (IP literals and localhost only: no network) ----------------------
async def test_metadata_address_is_refused_even_when_on_the_allow_list():
    with pytest.raises(CallbackRefused) as err:
        await check_callback("http://169.254.169.254/latest/meta-data/", ALLOW, allow_private=False)
    assert err.value.reason == ("callback address 169.254.169.254 is a link-local address; "
                                "only public addresses may be called")


async def test_a_name_resolving_to_loopback_is_refused():
    with pytest.raises(CallbackRefused) as err:
        await check_callback("http://localhost:9/hook", ALLOW, allow_private=False)
    assert err.value.reason.startswith("callback host 'localhost' resolves to ")
    assert "loopback address" in err.value.reason


async def test_allowed_target_is_pinned_to_the_checked_address():
    t = await check_callback("http://localhost:8123/hook?a=1", ALLOW, allow_private=True)
    assert t.host == "localhost" and t.host_header == "localhost:8123"
    assert set(t.addresses) <= {"127.0.0.1", "::1"} and t.addresses
    pinned = t.pinned_url("127.0.0.1")
    assert str(pinned) == "http://127.0.0.1:8123/hook?a=1"
    t6 = await check_callback("https://[::1]/x", ALLOW, allow_private=True)
    assert t6.addresses == ("::1",) and t6.host_header == "[::1]" and str(t6.pinned_url()) == "https://[::1]/x"


async def test_unresolvable_host_is_retriable():
    with pytest.raises(CallbackRefused) as err:
        await check_callback("http://no-such-host.invalid/", ["*.invalid"], allow_private=False)
    assert err.value.retriable is True and "does not resolve" in err.value.reason


async def test_submit_check_maps_refusals_to_400_and_needs_a_secret():
    s = ApiSettings(webhook_allowed_hosts=["127.0.0.1"], webhook_allow_private=False,
                    webhook_secret=SecretStr("k"))
    with pytest.raises(ApiError) as err:
        await validate_callback_url("http://127.0.0.1:9/x", s)
    assert (err.value.status, err.value.code) == (400, "callback_not_allowed")
    assert err.value.message == "callback address 127.0.0.1 is a loopback address; only public addresses may be called"
    unsigned = ApiSettings(webhook_allowed_hosts=["127.0.0.1"], webhook_allow_private=True, webhook_secret=None)
    with pytest.raises(ApiError) as err:
        await validate_callback_url("http://127.0.0.1:9/x", unsigned)
    assert "cannot be signed" in err.value.message
    await validate_callback_url("http://127.0.0.1:9/x", unsigned, key_id="k_1")  # the key's secret signs


# -- signatures -------------------------------------------------------------------------------
def test_signature_is_hmac_sha256_of_delivery_id_timestamp_and_body():
    body = b'{"request_id":"r1","text":"h\xc3\xa9llo"}'
    did = delivery_id("g1", "e" * 32)
    secret = "whsec_Zm9vYmFy-_x"  # the key is this whole string as UTF-8, whsec_ included
    h = sign(secret, did, body, timestamp=1_767_225_600)
    want = hmac.new(secret.encode(), f"{did}.1767225600.".encode() + body, hashlib.sha256).hexdigest()
    assert h == {DELIVERY_HEADER: did, TIMESTAMP_HEADER: "1767225600", SIGNATURE_HEADER: f"v1={want}"}
    ts, sig = h[TIMESTAMP_HEADER], h[SIGNATURE_HEADER]
    assert verify_signature(secret, did, ts, body, sig, now=1_767_225_600 + 299)
    assert not verify_signature(secret, did, ts, body, sig, now=1_767_225_600 + 301)  # replay window
    assert not verify_signature("other", did, ts, body, sig, now=1_767_225_600)
    assert not verify_signature(secret.removeprefix("whsec_"), did, ts, body, sig, now=1_767_225_600)
    assert not verify_signature(secret, did, ts, body + b" ", sig, now=1_767_225_600)
    assert not verify_signature(secret, did, "1767225601", body, sig, now=1_767_225_600)  # timestamp is signed
    assert not verify_signature(secret, did, "soon", body, sig)
    assert not verify_signature(secret, did, ts, body, "v0=" + want, now=1_767_225_600)
    assert not verify_signature(secret, did, ts, body, "v1=ünïcode", now=1_767_225_600)
    rotated = f"v1={'0' * 64} {sig}"  # two secrets during a rotation: one match suffices
    assert verify_signature(secret, did, ts, body, rotated, now=1_767_225_600)
    assert verify_signature(secret, did, ts, body, sig, tolerance_s=0)  # check disabled


def test_a_replay_under_another_delivery_id_fails_verification():
    """A captured delivery re-sent with a fresh X-Ocrstream-Delivery (to get past the receiver's
    deduplication) does not verify: the id is part of the signed bytes."""
    body = b'{"request_id":"r1"}'
    did = delivery_id("g1", "e" * 32)
    h = sign("s3cret", did, body, timestamp=1_767_225_600)
    ts, sig = h[TIMESTAMP_HEADER], h[SIGNATURE_HEADER]
    assert verify_signature("s3cret", did, ts, body, sig, now=1_767_225_600)
    assert not verify_signature("s3cret", delivery_id("g1", "f" * 32), ts, body, sig, now=1_767_225_600)
    assert not verify_signature("s3cret", did + "x", ts, body, sig, now=1_767_225_600)
    assert not verify_signature("s3cret", "whd_é", ts, body, sig, now=1_767_225_600)  # non-ASCII id: False, no crash
    # the old Stripe-style payload (timestamp and body only) is not accepted either
    stripe = hmac.new(b"s3cret", b"1767225600." + body, hashlib.sha256).hexdigest()
    assert not verify_signature("s3cret", did, ts, body, f"v1={stripe}", now=1_767_225_600)


def test_delivery_ids_are_deterministic_per_group():
    a = delivery_id("g1", "e" * 32)
    assert a == delivery_id("g1", "e" * 32) and a.startswith("whd_") and len(a) == 44
    assert a != delivery_id("g2", "e" * 32) and a != delivery_id("g1", "f" * 32)


def test_backoff_doubles_with_jitter_and_is_capped():
    for attempt, full in ((1, 1.0), (2, 2.0), (3, 4.0), (10, 60.0), (200, 60.0)):
        got = [backoff_s(attempt, 1.0, 60.0) for _ in range(50)]
        assert all(full / 2 <= g <= full for g in got), (attempt, min(got), max(got))
        assert len(set(got)) > 1  # jittered


@pytest.mark.parametrize("url", [
    "http://2130706433/hook",          # 127.0.0.1 as one decimal number
    "http://0x7f.0.0.1/hook",          # hexadecimal octet
    "http://127.1/hook",               # short form
    "http://0/hook",                   # 0.0.0.0
    "http://[::ffff:127.0.0.1]/hook",  # IPv4-mapped IPv6
    "http://[::127.0.0.1]/hook",       # IPv4-compatible IPv6
    "http://[64:ff9b::a9fe:a9fe]/hook",  # NAT64 of 169.254.169.254
    "http://[fe80::1%25eth0]/hook",    # link-local with a zone id
    "http://0177.0.0.1/hook",          # octal octet
])
async def test_other_spellings_of_internal_addresses_are_refused(url):
    """The forms URL parsers and resolvers disagree on: each ends refused, whatever the reason."""
    with pytest.raises(CallbackRefused):
        await check_callback(url, ["*"], allow_private=False)


# -- the webhooks stage's intake: which completion becomes which delivery row ---------------------

def _intake():
    from services.webhooks.handler import WebhooksHandler
    from services.webhooks.settings import WebhooksSettings

    return WebhooksHandler(WebhooksSettings(webhook_group_id="hooks-test"), db=None)


def _record(topic: str, value: bytes | None, offset: int = 7):
    from aiokafka import ConsumerRecord

    from services.common.records import RecordParser

    return RecordParser({})(ConsumerRecord(topic, 0, offset, 0, 0, None, value, None, 0, 0, []))


def _completion(callback_url: str | None, key_id: str | None = None) -> bytes:
    from schemas.events import CompletedEvent, ResultDocument
    from services.common.codec import dumps

    doc = ResultDocument(request_id="r1", status="ok", text="HELLO", callback_url=callback_url, api_key_id=key_id)
    return dumps(CompletedEvent(event_id="ev-r1", request_id="r1", result=doc))


def test_a_completion_with_a_callback_is_one_delivery_of_its_bytes_and_one_without_is_none():
    h = _intake()
    body = _completion("https://hooks.example.com/ocr", key_id="k1")
    d = h.delivery_of(_record(h.s.topics.completed, body))
    assert d.delivery_id == delivery_id("hooks-test", "ev-r1") and d.delivery_id.startswith("whd_")
    assert (d.request_id, d.key_id, d.url, d.body) == ("r1", "k1", "https://hooks.example.com/ocr", body.decode())
    assert h.delivery_of(_record(h.s.topics.completed, _completion(None))) is None
    # unreadable bytes: logged and skipped, never a batch that fails forever
    assert h.delivery_of(_record(h.s.topics.completed, b"{not json")) is None
    assert h.delivery_of(_record(h.s.topics.completed, b'{"result": {"callback_url": "https://x"}}')) is None
    assert h.delivery_of(_record(h.s.topics.completed, None)) is None  # a tombstone
    assert h.delivery_of(_record(h.s.topics.job_completed, None)) is None


def test_a_job_completion_with_a_webhook_url_is_delivered_under_the_job_id():
    from schemas.jobs import JobCompletedEvent, JobProgress, JobSummary
    from services.common.codec import dumps

    h = _intake()
    ev = JobCompletedEvent(event_id="jev-1", job_id="job-1", webhook_url="https://hooks.example.com/jobs",
                           api_key_id="k2", progress=JobProgress(job_id="job-1", state="completed", done=1),
                           summary=JobSummary(requests=1, by_status={"ok": 1}, by_error_code={}, latency_ms={},
                                              engine_ms=0.0, cache_hit_rate=0.0, pages=1, lines=1, chars=5),
                           report={}, completed_at_ms=1)
    d = h.delivery_of(_record(h.s.topics.job_completed, dumps(ev)))
    assert (d.delivery_id, d.request_id, d.key_id, d.url) == (delivery_id("hooks-test", "jev-1"), "job-1", "k2",
                                                              "https://hooks.example.com/jobs")
    no_hook = ev.model_copy(update={"webhook_url": None})
    assert h.delivery_of(_record(h.s.topics.job_completed, dumps(no_hook))) is None
