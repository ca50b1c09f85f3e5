"""API key format, hashing and where the guard finds a key in a request."""

from __future__ import annotations

import hashlib

import pytest
from starlette.requests import Request

from services.api.serving_keys import presented_key
from services.api.errors import ApiError
from services.common.keys.api_keys import MalformedKey, hash_key, parse_key

GOOD = "ocs_0123456789ab_" + "A_-z" * 10 + "xyz"


def request(**headers: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/v1/ocr/x",
                    "headers": [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]})


def test_parse_key_splits_id_and_secret():
    assert parse_key(GOOD) == ("0123456789ab", "A_-z" * 10 + "xyz")


@pytest.mark.parametrize("bad", [
    "", "ocs_", "0123456789ab", GOOD[:-1], GOOD + "x", GOOD.replace("ocs_", "sk_"),
    GOOD.replace("0123456789ab", "0123456789AB"), GOOD.replace("0123456789ab", "0123456789a"),
    GOOD[:-1] + "=", " " + GOOD,
])
def test_malformed_keys_are_refused(bad):
    with pytest.raises(MalformedKey):
        parse_key(bad)


def test_hash_is_sha256_hex_of_the_whole_key():
    assert hash_key(GOOD) == hashlib.sha256(GOOD.encode()).hexdigest()
    assert len(hash_key(GOOD)) == 64


def test_key_from_header_or_bearer():
    assert presented_key(request(x_api_key=GOOD)) == GOOD
    assert presented_key(request(authorization=f"Bearer {GOOD}")) == GOOD
    assert presented_key(request(authorization=f"bearer  {GOOD} ")) == GOOD
    assert presented_key(request(x_api_key=GOOD, authorization=f"Bearer {GOOD}")) == GOOD


@pytest.mark.parametrize("headers, message, challenge_error", [
    ({}, "an API key is required", False),
    ({"authorization": f"Basic {GOOD}"}, "Bearer <API key>", True),
    ({"authorization": "Bearer "}, "Bearer <API key>", True),
    ({"x_api_key": GOOD, "authorization": "Bearer other"}, "different keys", True),
])
def test_missing_or_ambiguous_keys_are_401(headers, message, challenge_error):
    with pytest.raises(ApiError) as exc:
        presented_key(request(**headers))
    err = exc.value
    assert err.status == 401 and err.code == "unauthorized" and message in err.message
    assert err.headers["WWW-Authenticate"].startswith('Bearer realm="ocrstream"')
    assert ('error="invalid_token"' in err.headers["WWW-Authenticate"]) is challenge_error
