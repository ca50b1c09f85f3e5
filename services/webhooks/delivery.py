"""Webhook delivery: due ``webhook_deliveries`` rows POSTed, signed, to their checked callback URLs.

How a completion reaches its callback (never blocking the pipeline):

1. **Intake** (:mod:`services.webhooks.handler`, on the stage's runner): the webhooks stage's
   consumer group reads ``ocr.completed`` and ``ocr.job-completed``; for a completion whose result
   has a ``callback_url`` (a job's: ``webhook_url``) it inserts a ``webhook_deliveries`` row (id
   derived from the group and the completion's ``event_id``: a replayed completion is not sent
   twice); the runner commits the offsets only after the rows are written.
2. **Delivery** (:class:`WebhookSender`, here): a loop claims due rows of its group (``FOR UPDATE
   SKIP LOCKED``, :mod:`services.common.webhooks.store`), checks the URL again
   (:mod:`services.common.webhooks.callbacks`: allow-list, public addresses; DNS is resolved
   again), POSTs the completion JSON to the checked address with a timeout and without following
   redirects, and records the attempt in ``webhook_attempts``. 2xx marks the delivery
   ``delivered``; anything else (3xx included) schedules a retry after an exponential backoff with
   jitter, until ``webhook_retry_for_s`` after intake, then ``failed``. A URL refused by the guard
   fails at once (a failed DNS lookup is retried).
3. **Signature.** Each attempt is signed with HMAC-SHA256 over
   ``f"{delivery_id}.{timestamp}.{body}"`` (:mod:`services.common.webhooks.signing`, scheme ``v1``;
   the delivery id is signed so a replay cannot change it) keyed with the submitting API key's
   webhook secret, or ``webhook_secret`` for requests made without a key (the whole string as
   UTF-8). The door refuses a request without a key at submit time when ``webhook_secret`` is not
   set: callbacks are never sent unsigned.

Delivery is at least once: a process that dies after sending but before recording lets the row
come due again after its lease. Receivers deduplicate on ``X-Ocrstream-Delivery``.

Headers of every attempt: ``Content-Type: application/json``, ``X-Ocrstream-Delivery`` (the
delivery id), ``X-Ocrstream-Attempt`` (1, 2, ...), ``X-Ocrstream-Timestamp`` and
``X-Ocrstream-Signature``. The body is the ``ocr.completed.v1`` event exactly as published
(``{"schema", "event_id", "request_id", "result": {...ResultDocument}}``). A job's completion
whose job was created with a ``webhook_url`` is delivered the same way; its body is the
``ocr.job_completed.v1`` event (``docs/jobs.md``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client import Counter, Histogram

from schemas.events import now_ms
from services.common.db import Database
from services.common.keys.api_keys import KeyStore
from services.common.telemetry import Telemetry
from services.common.webhooks.callbacks import RESOLVE_TIMEOUT_S, CallbackRefused, check_callback
from services.common.webhooks.signing import ATTEMPT_HEADER, sign
from services.common.webhooks.store import Claimed, WebhookStore
from services.webhooks.settings import WebhooksSettings

log = logging.getLogger(__name__)

SecretLookup = Callable[[str], "Awaitable[str | None] | str | None"]


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """Delay after failed attempt ``attempt`` (1-based): ``min(max_s, base_s * 2**(attempt-1))``
    with equal jitter (between half and all of it), s."""
    d = min(max_s, base_s * 2 ** min(attempt - 1, 30))
    return d / 2 + random.uniform(0, d / 2)


def _outcome_of(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else "error"


class WebhookSender:
    """Delivers the due rows of its group (see the module docstring). One per webhooks process,
    started and stopped beside the stage's runner.

    Args:
        settings: The stage's settings (``webhook_*``).
        db: The MariaDB pool (deliveries and attempts; API keys' secrets).
        telemetry: The process's telemetry; metrics go to its registry.
        secret_of: Returns an API key's webhook secret (or None when the key is unknown),
            sync or async. Defaults to :meth:`services.common.keys.api_keys.KeyStore.secret_of`
            (``api_keys.webhook_secret``, read on every attempt: a rotated secret applies at once).
    """

    def __init__(self, settings: WebhooksSettings, db: Database, telemetry: Telemetry,
                 secret_of: SecretLookup | None = None):
        self.s = settings
        self.db = db
        self.store = WebhookStore(db, settings.webhook_group_id)
        self._secret_of = secret_of or KeyStore(db).secret_of
        self.client: httpx.AsyncClient | None = None
        self._loops: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._lease_ms = int((settings.webhook_timeout_s + RESOLVE_TIMEOUT_S + 30) * 1000)
        self._db_down = False
        r = telemetry.registry
        self.deliveries = Counter("ocrstream_webhook_deliveries", "Webhook deliveries by outcome (enqueued, delivered, failed)",
                                  ["outcome"], registry=r)
        self.attempts = Counter("ocrstream_webhook_attempts",
                                "Webhook attempts by outcome (2xx, 3xx, 4xx, 5xx, timeout, error, refused)",
                                ["outcome"], registry=r)
        self.purged = Counter("ocrstream_webhook_deliveries_purged", "Finished webhook deliveries deleted after the retention period",
                              registry=r)
        self.attempt_seconds = Histogram("ocrstream_webhook_attempt_seconds", "Webhook attempt latency by outcome",
                                         ["outcome"], registry=r,
                                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    # -- lifecycle ----------------------------------------------------------------------------
    def enqueued(self, n: int) -> None:
        """``n`` new rows were enqueued by the intake: count them and look for due rows now."""
        self.deliveries.labels("enqueued").inc(n)
        self._wake.set()

    async def start(self) -> None:
        """Open the HTTP client and start the delivery (and purge) loops."""
        s = self.s
        # no proxies (the checked address must be the one connected to); no keep-alive (a pooled
        # connection is keyed by address, so it could carry another host's TLS session)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.webhook_timeout_s), follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_connections=s.webhook_concurrency, max_keepalive_connections=0),
        )
        self._loops = [asyncio.create_task(self._deliver(), name="webhook-deliver")]
        if s.webhook_retention_days > 0:
            self._loops.append(asyncio.create_task(self._purge(), name="webhook-purge"))

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking work, let attempts in flight finish for up to ``grace_s`` seconds (the rest
        are released, due again at once) and close the HTTP client."""
        for t in self._loops:
            t.cancel()
        for t in self._loops:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - a loop that died is logged, shutdown goes on
                log.error("webhooks: %s ended with %r", t.get_name(), exc)
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)
        if self.client is not None:
            await self.client.aclose()

    # -- delivery -----------------------------------------------------------------------------
    async def _deliver(self) -> None:
        s = self.s
        while True:
            self._wake.clear()
            free = s.webhook_concurrency - len(self._inflight)
            claimed: list[Claimed] = []
            if free > 0:
                try:
                    claimed = await self.store.claim(free, now_ms(), self._lease_ms)
                    if self._db_down:
                        log.info("webhooks: MariaDB is back")
                    self._db_down = False
                except Exception as exc:  # noqa: BLE001 - MariaDB down: try again next round
                    if not self._db_down:
                        log.warning("webhooks: claiming due deliveries failed (%r); retrying", exc)
                    self._db_down = True
            for c in claimed:
                task = asyncio.create_task(self._attempt(c), name=f"webhook-{c.delivery_id}")
                self._inflight.add(task)
                task.add_done_callback(self._attempt_done)
            if claimed and len(claimed) == free:
                continue  # more may be due
            try:
                await asyncio.wait_for(self._wake.wait(), s.webhook_poll_interval_s)
            except asyncio.TimeoutError:
                pass

    async def _purge(self) -> None:
        """Every ``webhook_purge_interval_s``: delete this group's finished deliveries older than
        ``webhook_retention_days`` (every replica may run it; the deletes are idempotent)."""
        s = self.s
        while True:
            try:
                n = await self.store.purge_finished(now_ms() - int(s.webhook_retention_days * 86_400_000))
                if n:
                    self.purged.inc(n)
                    log.info("webhooks: deleted %d finished deliveries older than %g days", n, s.webhook_retention_days)
            except Exception as exc:  # noqa: BLE001 - MariaDB down: next round
                log.warning("webhooks: deleting old deliveries failed (%r); next try in %g s", exc,
                            s.webhook_purge_interval_s)
            await asyncio.sleep(s.webhook_purge_interval_s)

    def _attempt_done(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("webhooks: attempt task failed: %r", task.exception())

    async def _secret(self, key_id: str | None) -> str | None:
        if key_id is None:
            return self.s.webhook_secret.get_secret_value() if self.s.webhook_secret else None
        got = self._secret_of(key_id)
        return await got if inspect.isawaitable(got) else got

    async def _send(self, c: Claimed, secret: str) -> tuple[int, str | None]:
        """POST once to a checked address; ``(status, Location header)``.

        Raises:
            CallbackRefused: The guard refused the URL now.
            httpx.HTTPError, TimeoutError: The attempt failed.
        """
        s = self.s
        target = await check_callback(c.url, s.webhook_allowed_hosts, s.webhook_allow_private)
        body = c.body.encode()
        headers = {"Content-Type": "application/json", "User-Agent": "ocrstream-webhooks/1",
                   "Host": target.host_header, ATTEMPT_HEADER: str(c.attempt),
                   **sign(secret, c.delivery_id, body)}  # X-Ocrstream-Delivery, -Timestamp, -Signature
        ext = {"sni_hostname": target.host} if target.url.scheme == "https" else {}
        async with asyncio.timeout(s.webhook_timeout_s):
            for i, addr in enumerate(target.addresses):
                try:
                    async with self.client.stream("POST", target.pinned_url(addr), content=body, headers=headers,
                                                  extensions=ext) as resp:
                        return resp.status_code, resp.headers.get("location")
                except httpx.ConnectError:
                    if i == len(target.addresses) - 1:
                        raise
        raise AssertionError("unreachable")

    async def _attempt(self, c: Claimed) -> None:
        s = self.s
        t0 = time.perf_counter()
        at = now_ms()
        status: int | None = None
        error: str | None = None
        permanent = False
        try:
            secret = await self._secret(c.key_id)
            if secret is None:
                raise CallbackRefused(f"no webhook secret to sign with: API key {c.key_id!r} is unknown"
                                      if c.key_id else "no webhook secret to sign with: webhook_secret is not set")
            status, location = await self._send(c, secret)
            outcome = _outcome_of(status)
            if 300 <= status < 400:
                error = f"HTTP {status}: redirect to {location!r} not followed"
            elif not 200 <= status < 300:
                error = f"HTTP {status}"
        except CallbackRefused as exc:
            outcome, error, permanent = "refused", f"refused: {exc.reason}", not exc.retriable
        except (TimeoutError, httpx.TimeoutException):
            outcome, error = "timeout", f"no answer within {s.webhook_timeout_s:g}s"
        except asyncio.CancelledError:
            try:
                await asyncio.shield(self.store.release(c, now_ms()))
            except Exception:  # noqa: BLE001 - the lease runs out instead
                pass
            raise
        except Exception as exc:  # noqa: BLE001 - connection refused/reset, TLS, DB read of the secret
            outcome, error = "error", f"{type(exc).__name__}: {exc}"[:1024]
        seconds = time.perf_counter() - t0
        self.attempts.labels(outcome).inc()
        self.attempt_seconds.labels(outcome).observe(seconds)
        done = now_ms()
        if outcome == "2xx":
            state, next_at, delivered_at = "delivered", done, done
        elif permanent or done >= c.give_up_at_ms:
            state, next_at, delivered_at = "failed", done, None
        else:
            delay_ms = int(backoff_s(c.attempt, s.webhook_backoff_base_s, s.webhook_backoff_max_s) * 1000)
            state, next_at, delivered_at = "pending", min(done + delay_ms, c.give_up_at_ms), None
        log_fn = log.info if state != "pending" else log.warning
        log_fn("webhooks: %s (request %s) attempt %d: %s -> %s", c.delivery_id, c.request_id, c.attempt,
               error or f"HTTP {status}", state)
        for tries in range(3):
            try:
                kept = await self.store.record(c, at_ms=at, duration_ms=seconds * 1000, http_status=status, error=error,
                                               state=state, next_attempt_at_ms=next_at, delivered_at_ms=delivered_at)
                break
            except Exception as exc:  # noqa: BLE001 - MariaDB down: retry; else the lease runs out
                if tries == 2:
                    log.error("webhooks: recording %s attempt %d failed (%r); it comes due again after its lease",
                              c.delivery_id, c.attempt, exc)
                    return
                await asyncio.sleep(1.0)
        if not kept:
            log.warning("webhooks: %s attempt %d finished after its claim was taken over", c.delivery_id, c.attempt)
        elif state != "pending":
            self.deliveries.labels(state).inc()
