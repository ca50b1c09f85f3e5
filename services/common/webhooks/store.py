"""MariaDB rows of webhook deliveries: enqueue, claim due ones, record each attempt.

Tables ``webhook_deliveries`` (one row per callback, with its state) and ``webhook_attempts``
(one row per attempt), from migrations 002-004; finished rows are deleted after a retention
period (:meth:`WebhookStore.purge_finished`). Rows belong to a webhooks group
(``group_id``); a webhooks process only ever claims its own group's rows.

Claiming is safe across replicas: due rows are selected ``FOR UPDATE SKIP LOCKED`` and, in the
same transaction, their ``attempts`` is incremented and ``next_attempt_at_ms`` pushed past a
lease. The incremented ``attempts`` is the attempt number and the fencing token: the outcome
is written only ``WHERE attempts = <that number>``, so a replica whose lease ran out (and whose
row was claimed again) can never overwrite the newer attempt's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.db import Database

_ENQUEUE = """
INSERT INTO webhook_deliveries (delivery_id, group_id, request_id, key_id, url, body, state, attempts,
  next_attempt_at_ms, give_up_at_ms, created_at_ms)
VALUES (%s,%s,%s,%s,%s,%s,'pending',0,%s,%s,%s)
ON DUPLICATE KEY UPDATE delivery_id = delivery_id
"""

_DUE = """
SELECT delivery_id, request_id, key_id, url, body, attempts, give_up_at_ms, created_at_ms
FROM webhook_deliveries
WHERE group_id = %s AND state = 'pending' AND next_attempt_at_ms <= %s
ORDER BY next_attempt_at_ms
LIMIT %s
FOR UPDATE SKIP LOCKED
"""

_ATTEMPT = """
INSERT INTO webhook_attempts (delivery_id, attempt, at_ms, http_status, error, duration_ms)
VALUES (%s,%s,%s,%s,%s,%s)
ON DUPLICATE KEY UPDATE delivery_id = delivery_id
"""

_OUTCOME = """
UPDATE webhook_deliveries
SET state = %s, last_status = %s, last_error = %s, next_attempt_at_ms = %s, delivered_at_ms = %s
WHERE delivery_id = %s AND attempts = %s AND state = 'pending'
"""

_OLD_FINISHED = """
SELECT delivery_id FROM webhook_deliveries
WHERE group_id = %s AND created_at_ms < %s AND state <> 'pending'
LIMIT %s
"""


@dataclass(frozen=True)
class NewDelivery:
    """A callback to enqueue.

    Attributes:
        delivery_id: Deterministic id (same completion, same group: same id).
        request_id: The request whose completion is delivered.
        key_id: The API key that submitted it (whose secret signs), or None.
        url: The callback URL.
        body: The JSON body to send (UTF-8 text).
    """

    delivery_id: str
    request_id: str
    key_id: str | None
    url: str
    body: str


@dataclass(frozen=True)
class Claimed:
    """A delivery claimed for one attempt.

    Attributes:
        attempt: This attempt's number (1 = first); also the fencing token of :meth:`WebhookStore.record`.
        give_up_at_ms: No retry is scheduled after this time (Unix ms).
    """

    delivery_id: str
    request_id: str
    key_id: str | None
    url: str
    body: str
    attempt: int
    give_up_at_ms: int
    created_at_ms: int


class WebhookStore:
    """Delivery rows of one webhooks group.

    Args:
        db: The MariaDB pool.
        group_id: The webhooks group owning the rows (the webhooks stage's consumer group).

    Database errors (``pymysql.OperationalError`` and the like) propagate to the caller.
    """

    def __init__(self, db: Database, group_id: str):
        self.db = db
        self.group_id = group_id

    async def enqueue(self, items: list[NewDelivery], now_ms: int, retry_for_ms: int) -> None:
        """Insert pending deliveries due now, given up ``retry_for_ms`` after ``now_ms``;
        ids already present are left as they are (a replayed completion is not sent twice)."""
        if not items:
            return
        rows = [(d.delivery_id, self.group_id, d.request_id, d.key_id, d.url, d.body, now_ms, now_ms + retry_for_ms,
                 now_ms) for d in items]

        def run(cur, rows):
            cur.executemany(_ENQUEUE, rows)

        await self.db.transact("webhook_enqueue", run, rows)

    async def claim(self, limit: int, now_ms: int, lease_ms: int) -> list[Claimed]:
        """Up to ``limit`` due deliveries of this group, each claimed for one attempt: no other
        claim returns them until ``lease_ms`` has passed or :meth:`record` reschedules them."""
        group = self.group_id

        def run(cur, limit):
            cur.execute(_DUE, (group, now_ms, limit))
            rows = cur.fetchall()
            if not rows:
                return []
            ids = [r["delivery_id"] for r in rows]
            marks = ",".join(["%s"] * len(ids))
            cur.execute(f"UPDATE webhook_deliveries SET attempts = attempts + 1, next_attempt_at_ms = %s"
                        f" WHERE delivery_id IN ({marks})", (now_ms + lease_ms, *ids))
            return [Claimed(r["delivery_id"], r["request_id"], r["key_id"], r["url"], r["body"], r["attempts"] + 1,
                            r["give_up_at_ms"], r["created_at_ms"]) for r in rows]

        return await self.db.transact("webhook_claim", run, limit)

    async def record(self, c: Claimed, *, at_ms: int, duration_ms: float, http_status: int | None,
                     error: str | None, state: str, next_attempt_at_ms: int, delivered_at_ms: int | None) -> bool:
        """Store attempt ``c.attempt`` and the delivery's new state in one transaction.

        Args:
            state: ``pending`` (retry at ``next_attempt_at_ms``), ``delivered`` or ``failed``.

        Returns:
            False when the claim was lost (another replica claimed the row after the lease ran
            out, or it is no longer pending): the attempt row is kept, the state is not changed.
        """
        err = error[:1024] if error else None

        def run(cur):
            cur.execute(_ATTEMPT, (c.delivery_id, c.attempt, at_ms, http_status, err, round(duration_ms, 3)))
            cur.execute(_OUTCOME, (state, http_status, err, next_attempt_at_ms, delivered_at_ms, c.delivery_id,
                                   c.attempt))
            return cur.rowcount == 1

        return await self.db.transact("webhook_record", run)

    async def release(self, c: Claimed, next_attempt_at_ms: int) -> None:
        """Make a claimed delivery due again at ``next_attempt_at_ms`` without recording an attempt
        (shutdown before it was sent); the attempt number is not reused."""

        def run(cur):
            cur.execute("UPDATE webhook_deliveries SET next_attempt_at_ms = %s"
                        " WHERE delivery_id = %s AND attempts = %s AND state = 'pending'",
                        (next_attempt_at_ms, c.delivery_id, c.attempt))

        await self.db.transact("webhook_release", run)

    async def purge_finished(self, before_ms: int, batch: int = 1000) -> int:
        """Delete this group's delivered and failed deliveries created before ``before_ms`` (epoch
        ms), with their attempt rows, ``batch`` deliveries per transaction. Pending deliveries are
        kept whatever their age (they end by ``give_up_at_ms``).

        Returns:
            The number of deliveries deleted.
        """
        group = self.group_id

        def run(cur):
            cur.execute(_OLD_FINISHED, (group, before_ms, batch))
            ids = [r["delivery_id"] for r in cur.fetchall()]
            if ids:
                marks = ",".join(["%s"] * len(ids))
                cur.execute(f"DELETE FROM webhook_attempts WHERE delivery_id IN ({marks})", ids)
                cur.execute(f"DELETE FROM webhook_deliveries WHERE delivery_id IN ({marks}) AND state <> 'pending'", ids)
            return len(ids)

        total = 0
        while True:
            n = await self.db.transact("webhook_purge", run)
            total += n
            if n < batch:
                return total
