"""Webhook signatures: HMAC-SHA256 over the timestamp and the body (the Stripe scheme).

Every delivery carries::

    X-Ocrstream-Timestamp: 1767225600            (Unix seconds when the attempt was signed)
    X-Ocrstream-Signature: v1=5257a869e7ec...    (hex HMAC-SHA256(secret, f"{timestamp}.{body}"))

The signed payload is the timestamp, a full stop and the raw request body bytes, as in
Stripe's ``Stripe-Signature`` ``v1`` scheme (https://docs.stripe.com/webhooks#verify-manually);
Standard Webhooks (https://www.standardwebhooks.com/) signs the same way with a message id in
front. A receiver recomputes the HMAC with its secret over the bytes it received, compares in
constant time and refuses timestamps older than a tolerance (replays). The signature header may
hold several space-separated ``v1=`` values while a secret is being rotated; one match suffices.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SCHEME = "v1"
TIMESTAMP_HEADER = "X-Ocrstream-Timestamp"
SIGNATURE_HEADER = "X-Ocrstream-Signature"
DELIVERY_HEADER = "X-Ocrstream-Delivery"
ATTEMPT_HEADER = "X-Ocrstream-Attempt"


def _digest(secret: str | bytes, timestamp: int | str, body: bytes) -> str:
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(secret: str | bytes, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The timestamp and signature headers of one delivery.

    Args:
        secret: The HMAC key (the API key's webhook secret, or ``webhook_secret``).
        body: The exact request body bytes that will be sent.
        timestamp: Unix seconds; now by default.

    Returns:
        ``{TIMESTAMP_HEADER: "<seconds>", SIGNATURE_HEADER: "v1=<64 hex digits>"}``.
    """
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: f"{SCHEME}={_digest(secret, ts, body)}"}


def verify_signature(secret: str | bytes, timestamp: str | int, body: bytes, signature: str,
                     tolerance_s: float = 300, now: float | None = None) -> bool:
    """Check a delivery the way a receiver should (use it in your webhook endpoint).

    Example::

        ok = verify_signature(secret, request.headers["X-Ocrstream-Timestamp"], raw_body,
                              request.headers["X-Ocrstream-Signature"])

    Args:
        secret: The shared HMAC key.
        timestamp: The ``X-Ocrstream-Timestamp`` header (Unix seconds).
        body: The raw request body bytes as received (not re-serialised JSON).
        signature: The ``X-Ocrstream-Signature`` header: one or more space- or comma-separated
            ``v1=<hex>`` values.
        tolerance_s: Largest accepted distance between ``timestamp`` and ``now``, s (replay
            window); 0 or less disables the check.
        now: Unix seconds to compare with; the clock by default.

    Returns:
        True when the timestamp is within the tolerance and some ``v1`` value equals the
        HMAC-SHA256 of ``f"{timestamp}.".encode() + body`` (compared in constant time).
    """
    try:
        ts = int(str(timestamp).strip())
    except ValueError:
        return False
    if tolerance_s > 0 and abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    expected = _digest(secret, ts, body)
    ok = False
    for part in signature.replace(",", " ").split():
        scheme, _, value = part.partition("=")
        if scheme == SCHEME and hmac.compare_digest(value.strip().lower().encode(), expected.encode()):
            ok = True
    return ok
