"""API keys and per-key rate limits of the HTTP front door (the guard every ``/v1/`` route calls).

Off by default (``auth_required`` false: every caller is :data:`ANONYMOUS`, no limits apply,
since limits are per key); the Helm values turn it on. Then a ``/v1/`` request must carry a key
(:mod:`.keys`) as ``X-API-Key: <key>`` or ``Authorization: Bearer <key>`` (RFC 6750 §2.1), and:

* no key, a malformed, unknown or revoked key: 401 ``unauthorized`` with a message saying which,
  and ``WWW-Authenticate: Bearer realm="ocrstream"`` (with ``error="invalid_token"`` when a key
  was sent, RFC 6750 §3);
* an empty token bucket: 429 ``rate_limited``; a used-up daily quota (submissions: each
  ``POST /v1/ocr`` let through counts one; reads never use quota): 429 ``quota_exceeded``; both
  with ``Retry-After`` in whole seconds (:mod:`.ratelimit`). A batch costs one token and one
  submission per image, all or none, charged once its files are read (:meth:`Guard.charge_batch`);
  before its body is read it is only checked (:meth:`Guard.peek`: refused at once when not even
  one image could pass);
* MariaDB unreachable for a key not in the lookup cache: 503 ``unavailable`` (fail closed:
  an unverifiable key is never let in);
* Redis unreachable: the request passes unlimited (fail open, counted in
  ``ocrstream_rate_limit_total{outcome="unavailable"}``): Redis trouble never stops OCR.

Lookups are cached in-process for ``auth_cache_s`` seconds, so a revoked key keeps working on a
running door for at most that long after ``ocrstream keys revoke``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pymysql
from prometheus_client import Counter
from starlette.requests import Request

from services.api.errors import ApiError
from services.common.keys.api_keys import KeyStore, MalformedKey, parse_key
from services.api.ratelimit import Decision, RateLimiter

REALM = 'Bearer realm="ocrstream"'
READ_FIRST_PER_KEY = 8
"""Requests of one key at most whose small bodies a door process reads before taking their limit
(:meth:`Guard.read_first`); more at once are limited first, before their bodies are read."""
REFUSED_MEMORY = 10_000
"""Keys at most whose last refusal a door process remembers (:meth:`Guard.read_first`)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``key_id`` None when keys are not required (local use)."""

    key_id: str | None = None
    quota_per_day: int = 0  # the key's daily quota of submissions (0 = none)


ANONYMOUS = Principal()


@dataclass(frozen=True)
class Limit:
    """A key's rate limit and quota for one request, not yet taken (:meth:`Guard.admit`).

    Attributes:
        key_id: The API key's id.
        rate_per_s: Refill, tokens/s (0 = no rate limit).
        burst: Bucket size, tokens.
        quota_per_day: Submissions per UTC day this request counts against (0 = not counted).
        quota: The key's daily quota, for the 429 message.
    """

    key_id: str
    rate_per_s: float
    burst: int
    quota_per_day: int
    quota: int


BATCH_PATH = "/v1/ocr/batch"


def _unauthorized(message: str, key_sent: bool) -> ApiError:
    challenge = REALM if not key_sent else f'{REALM}, error="invalid_token", error_description="{message}"'
    return ApiError("unauthorized", message, headers={"WWW-Authenticate": challenge})


def presented_key(request: Request) -> str:
    """The key a request carries, from ``X-API-Key`` or ``Authorization: Bearer``.

    Raises:
        ApiError: 401 ``unauthorized`` when there is none, when Authorization uses another
            scheme, or when both headers carry different keys.
    """
    header = request.headers.get("x-api-key", "").strip()
    auth = request.headers.get("authorization", "").strip()
    bearer = ""
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("the Authorization header must be 'Bearer <API key>'", True)
        bearer = token.strip()
    if header and bearer and header != bearer:
        raise _unauthorized("X-API-Key and Authorization carry different keys", True)
    key = header or bearer
    if not key:
        raise _unauthorized("an API key is required: send it as X-API-Key or Authorization: Bearer", False)
    return key


class Guard:
    """Authenticates a request and applies its key's rate limit and quota.

    Args:
        settings: :class:`~services.api.settings.ApiSettings` (``auth_required``,
            ``auth_cache_s``, the default ``rate_limit_per_s`` / ``rate_limit_burst`` /
            ``quota_per_day`` for keys that have none of their own).
        cache: The door's :class:`~services.common.cache.entries.ResultCache` (its Redis pool and
            time budget are shared by the rate limiter).
        db: The door's :class:`~services.common.db.Database` (table ``api_keys``).
        telemetry: Where ``ocrstream_auth_total`` and ``ocrstream_rate_limit_total`` are registered.
    """

    def __init__(self, settings, cache=None, db=None, telemetry=None):
        self.s = settings
        self.keys = KeyStore(db, cache_ttl_s=settings.auth_cache_s) if db is not None else None
        self.limiter = RateLimiter(cache) if cache is not None else None
        registry = telemetry.registry if telemetry is not None else None  # None: counted, not exported
        self._reading: dict[str, int] = {}  # key id -> its requests being read before their limit is taken
        self._refused_until: dict[str, float] = {}  # key id -> monotonic s until which its limit refuses
        self.auth_total = Counter("ocrstream_auth", "API key checks on /v1/ routes by outcome",
                                  ["outcome"], registry=registry)
        self.rate_total = Counter("ocrstream_rate_limit", "Rate limit and quota decisions by outcome "
                                  "(unavailable = Redis down, let through)", ["outcome"], registry=registry)

    async def check(self, request: Request) -> Principal:
        """The caller's principal, after its key's rate limit and quota.

        Raises:
            ApiError: 401 ``unauthorized`` (missing, malformed, unknown or revoked key),
                429 ``rate_limited`` / ``quota_exceeded`` (with ``Retry-After``),
                503 ``unavailable`` (the key store cannot be read).
        """
        principal, limit = await self.admit(request)
        await self.take(limit)
        return principal

    async def admit(self, request: Request) -> tuple[Principal, Limit | None]:
        """The caller's principal and its key's limit for this request, not yet taken: the caller
        takes it with :meth:`take` before reading the body, or, for a small body already read,
        in the same Redis call as the cache lookup (:meth:`RateLimiter.hit_and_lookup`, then
        :meth:`enforce`). The limit is None when no limit applies (keys not required, a key
        without rate limit or quota, no Redis).

        Raises:
            ApiError: 401 ``unauthorized`` (missing, malformed, unknown or revoked key),
                503 ``unavailable`` (the key store cannot be read).
        """
        if not self.s.auth_required:
            return ANONYMOUS, None
        try:
            presented = presented_key(request)
            parse_key(presented)
        except ApiError as err:
            sent = "invalid_token" in err.headers["WWW-Authenticate"]
            self.auth_total.labels("malformed" if sent else "missing").inc()
            raise
        except MalformedKey as exc:
            self.auth_total.labels("malformed").inc()
            raise _unauthorized(f"malformed API key: {exc}", True) from None
        if self.keys is None:
            raise ApiError("unavailable", "API keys are required but no key store is configured")
        try:
            key = await self.keys.lookup(presented)
        except (pymysql.MySQLError, OSError) as exc:
            self.auth_total.labels("unavailable").inc()
            raise ApiError("unavailable", f"the key store (MariaDB) cannot be read: {exc!r}",
                           headers={"Retry-After": "1"}) from None
        if key is None:
            self.auth_total.labels("unknown").inc()
            raise _unauthorized("unknown API key", True)
        if key.revoked:
            self.auth_total.labels("revoked").inc()
            raise _unauthorized(f"API key {key.key_id} has been revoked", True)
        self.auth_total.labels("ok").inc()
        rate = self.s.rate_limit_per_s if key.rate_per_s is None else key.rate_per_s
        burst = self.s.rate_limit_burst if key.burst is None else key.burst
        quota = self.s.quota_per_day if key.quota_per_day is None else key.quota_per_day
        principal = Principal(key_id=key.key_id, quota_per_day=quota)
        if self.limiter is None or (rate <= 0 and quota <= 0):
            if self.limiter is not None:
                self.rate_total.labels("unlimited").inc()
            return principal, None
        # submissions count against the quota; a batch is charged per image once its images are
        # known (charge_batch), tokens and submissions in one call
        counts = request.method == "POST"
        return principal, Limit(key.key_id, rate, burst, quota if counts else 0, quota)

    async def take(self, limit: Limit | None) -> None:
        """Take ``limit`` (one token, one submission) in Redis.

        Raises:
            ApiError: 429 ``rate_limited`` / ``quota_exceeded`` (with ``Retry-After``).
        """
        if limit is None or self.limiter is None:
            return
        self.enforce(limit, await self.limiter.hit(limit.key_id, rate_per_s=limit.rate_per_s, burst=limit.burst,
                                                   quota_per_day=limit.quota_per_day))

    async def peek(self, limit: Limit | None) -> None:
        """Refuse a batch before its body is read when its key has no token or no submission left
        (nothing is taken: :meth:`charge_batch` charges it once its images are known).

        Raises:
            ApiError: 429 ``rate_limited`` / ``quota_exceeded`` (with ``Retry-After``).
        """
        if limit is None or self.limiter is None:
            return
        d = await self.limiter.peek(limit.key_id, rate_per_s=limit.rate_per_s, burst=limit.burst,
                                    quota_per_day=limit.quota_per_day)
        if not d.allowed:
            self.enforce(limit, d)

    async def charge_batch(self, limit: Limit | None, images: int) -> None:
        """Charge a batch of ``images`` to its key: one token and one submission per image, all or
        none, in one Redis call (:meth:`RateLimiter.hit` with ``cost=images``). The bucket must
        hold ``min(images, burst)`` tokens; a batch larger than the burst passes only from a full
        bucket and leaves it in debt, which later requests wait out.

        Raises:
            ApiError: 400 ``invalid_request`` when the batch is larger than the whole daily quota
                (no day can take it: split it); 429 ``rate_limited`` when the bucket does not
                hold the tokens, 429 ``quota_exceeded`` when today's rest of the quota cannot
                take it (both with ``Retry-After``); nothing is taken or counted then.
        """
        if limit is None or self.limiter is None or images <= 0:
            return
        quota = limit.quota_per_day
        if quota > 0 and images > quota:
            raise ApiError("invalid_request", f"a batch counts one submission per image: {images} images exceed "
                           f"API key {limit.key_id}'s whole daily quota of {quota}; send fewer per batch")
        d = await self.limiter.hit(limit.key_id, rate_per_s=limit.rate_per_s, burst=limit.burst,
                                   quota_per_day=quota, cost=images)
        self.rate_total.labels(d.outcome).inc()
        if d.allowed:
            return
        # not remembered for read_first: a smaller request may still pass now
        headers = {"Retry-After": str(d.retry_after_s)}
        if d.outcome == "quota_exceeded":
            raise ApiError("quota_exceeded", f"a batch counts one submission per image: {images} images, but API "
                           f"key {limit.key_id} has {max(0, int(d.tokens))} of its {quota} submissions of this "
                           f"UTC day left; retry after {d.retry_after_s} s", headers=headers)
        need = min(images, limit.burst)
        raise ApiError("rate_limited", f"a batch takes one token per image: {images} images need {need} "
                       f"token{'s' if need != 1 else ''} in API key {limit.key_id}'s bucket (burst {limit.burst}, "
                       f"{limit.rate_per_s:g}/s), which holds {max(0.0, d.tokens):.1f}; nothing was taken; "
                       f"retry after {d.retry_after_s} s", headers=headers)

    def read_first(self, limit: Limit) -> bool:
        """Whether a request under ``limit`` may have its body read before the limit is taken
        (:meth:`RateLimiter.hit_and_lookup`); if True, call :meth:`done_reading` when it ends.

        No while the key was refused within its last ``Retry-After`` (in this process): a client
        over its limit gets its 429 before it sends a byte, as when the limit is taken first.
        No when :data:`READ_FIRST_PER_KEY` of the key's requests are already being read first:
        requests not yet charged must not hold the upload budget without bound.
        """
        until = self._refused_until.get(limit.key_id)
        if until is not None:
            if time.monotonic() < until:
                return False
            del self._refused_until[limit.key_id]
        n = self._reading.get(limit.key_id, 0)
        if n >= READ_FIRST_PER_KEY:
            return False
        self._reading[limit.key_id] = n + 1
        return True

    def done_reading(self, limit: Limit) -> None:
        """The end of a request :meth:`read_first` let through."""
        n = self._reading.get(limit.key_id, 0) - 1
        if n > 0:
            self._reading[limit.key_id] = n
        else:
            self._reading.pop(limit.key_id, None)

    def enforce(self, limit: Limit, d: Decision) -> None:
        """Count decision ``d`` on ``limit`` and raise if it refuses.

        Raises:
            ApiError: 429 ``rate_limited`` / ``quota_exceeded`` (with ``Retry-After``).
        """
        self.rate_total.labels(d.outcome).inc()
        if d.allowed:
            return
        self._remember_refusal(limit, d)
        headers = {"Retry-After": str(d.retry_after_s)}
        if d.outcome == "quota_exceeded":
            raise ApiError("quota_exceeded", f"API key {limit.key_id} has used its {limit.quota} submissions of "
                           f"this UTC day; retry after {d.retry_after_s} s", headers=headers)
        raise ApiError("rate_limited", f"API key {limit.key_id} is limited to {limit.rate_per_s:g} requests/s "
                       f"(burst {limit.burst}); retry after {d.retry_after_s} s", headers=headers)

    def _remember_refusal(self, limit: Limit, d: Decision) -> None:
        if len(self._refused_until) >= REFUSED_MEMORY:
            self._refused_until.clear()  # only a shortcut: forgetting costs one read-first request per key
        self._refused_until[limit.key_id] = time.monotonic() + d.retry_after_s
