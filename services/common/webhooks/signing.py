"""Webhook signatures: HMAC-SHA256 over the delivery id, the timestamp and the body.

Every delivery carries::

    X-Ocrstream-Delivery: whd_3f2a...            (delivery id, the same on every retry)
    X-Ocrstream-Timestamp: 1767225600            (Unix seconds when the attempt was signed)
    X-Ocrstream-Signature: v1=5257a869e7ec...    (hex HMAC-SHA256(key, f"{delivery_id}.{timestamp}.{body}"))

Scheme ``v1``, exactly:

* **Key**: the whole secret string as UTF-8 bytes, prefix included: for an API key's secret
  ``whsec_Ab3...`` the key is ``b"whsec_Ab3..."``; nothing is base64-decoded.
* **Signed bytes**: ``delivery_id.encode("ascii") + b"." + str(timestamp).encode("ascii") + b"."
  + body``, where ``body`` is the raw request body as received (not re-serialised JSON).
* **Signature**: ``"v1=" + hmac_sha256(key, signed).hexdigest()`` (64 lower-case hex digits).

Signing the delivery id means a captured delivery cannot be replayed under another
``X-Ocrstream-Delivery`` to slip past a receiver's deduplication; signing the timestamp bounds
how long it can be replayed at all. The layout of the signed bytes (id, timestamp, body, joined
by full stops) is that of Standard Webhooks (https://www.standardwebhooks.com/, the
``webhook-id``/``webhook-timestamp`` spec), but the scheme is *not* Standard Webhooks
compatible: its headers are ``webhook-*``, its key is the base64-decoded part after
``whsec_`` and its signature is ``v1,<base64>``. Stripe's ``v1`` scheme
(https://docs.stripe.com/webhooks#verify-manually) signs only ``f"{timestamp}.{body}"``.

A receiver recomputes the HMAC over the bytes it received, compares in constant time and
refuses timestamps older than a tolerance (replays), then deduplicates on the delivery id. The
signature header may hold several space-separated ``v1=`` values while a secret is being
rotated; one match suffices.
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


def signed_payload(delivery_id: str, timestamp: int | str, body: bytes) -> bytes:
    """The bytes scheme ``v1`` signs: ``b"{delivery_id}.{timestamp}." + body``.

    Raises:
        UnicodeEncodeError: ``delivery_id`` is not ASCII (ours never are: ``whd_`` + hex).
    """
    return f"{delivery_id}.{timestamp}.".encode("ascii") + body


def _digest(secret: str | bytes, delivery_id: str, timestamp: int | str, body: bytes) -> str:
    key = secret.encode("utf-8") if isinstance(secret, str) else secret  # the whole string, whsec_ included
    return hmac.new(key, signed_payload(delivery_id, timestamp, body), hashlib.sha256).hexdigest()


def sign(secret: str | bytes, delivery_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The delivery id, timestamp and signature headers of one delivery attempt.

    Args:
        secret: The HMAC key: the API key's webhook secret (``whsec_...``) or ``webhook_secret``,
            used whole as UTF-8 bytes (bytes are used as given).
        delivery_id: The delivery id (``X-Ocrstream-Delivery``), ASCII.
        body: The exact request body bytes that will be sent.
        timestamp: Unix seconds; now by default.

    Returns:
        ``{DELIVERY_HEADER: delivery_id, TIMESTAMP_HEADER: "<seconds>", SIGNATURE_HEADER: "v1=<64 hex digits>"}``.
    """
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return {DELIVERY_HEADER: delivery_id, TIMESTAMP_HEADER: str(ts),
            SIGNATURE_HEADER: f"{SCHEME}={_digest(secret, delivery_id, ts, body)}"}


def verify_signature(secret: str | bytes, delivery_id: str, timestamp: str | int, body: bytes, signature: str,
                     tolerance_s: float = 300, now: float | None = None) -> bool:
    """Check a delivery the way a receiver should (use it in your webhook endpoint).

    Example::

        h = request.headers
        ok = verify_signature(secret, h["X-Ocrstream-Delivery"], h["X-Ocrstream-Timestamp"], raw_body,
                              h["X-Ocrstream-Signature"])

    Args:
        secret: The shared HMAC key, the whole string as UTF-8 (``whsec_...`` prefix included).
        delivery_id: The ``X-Ocrstream-Delivery`` header.
        timestamp: The ``X-Ocrstream-Timestamp`` header (Unix seconds).
        body: The raw request body bytes as received (not re-serialised JSON).
        signature: The ``X-Ocrstream-Signature`` header: one or more space- or comma-separated
            ``v1=<hex>`` values.
        tolerance_s: Largest accepted distance between ``timestamp`` and ``now``, s (replay
            window); 0 or less disables the check.
        now: Unix seconds to compare with; the clock by default.

    Returns:
        True when the timestamp is within the tolerance and some ``v1`` value equals the
        HMAC-SHA256 of :func:`signed_payload` (compared in constant time); False otherwise,
        including a non-ASCII delivery id or timestamp.
    """
    try:
        ts = int(str(timestamp).strip())
    except ValueError:
        return False
    if tolerance_s > 0 and abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    try:
        expected = _digest(secret, delivery_id, ts, body)
    except UnicodeEncodeError:
        return False
    ok = False
    for part in signature.replace(",", " ").split():
        scheme, _, value = part.partition("=")
        if scheme == SCHEME and hmac.compare_digest(value.strip().lower().encode(), expected.encode()):
            ok = True
    return ok
