"""API keys of the HTTP front door: creation, revocation, lookup by presented key, webhook secrets.

A key looks like ``ocs_<key_id>_<secret>``:

* ``key_id``: 12 lowercase hex characters (48 random bits). Not secret: it names the key in
  ``ocrstream keys list``, in the ``api_keys`` table, on results (``api_key_id``) and in logs.
* ``secret``: 43 URL-safe base64 characters, 256 random bits from :mod:`secrets`.

Only the SHA-256 of the whole key is stored (``api_keys.key_hash``). A fast, unsalted hash is
enough here, unlike for passwords: slow salted hashes (bcrypt, scrypt, argon2) exist to make
guessing *low-entropy, human-chosen* secrets expensive, and to stop one precomputed table from
cracking many users at once. A key with a 256-bit random secret cannot be guessed or found in
any table, however fast each guess is (2^256 tries), so a stolen table of hashes reveals no
usable key; a slow hash would only add milliseconds of CPU to every request. This is the
scheme GitHub and Stripe tokens use. The secret is compared in constant time
(:func:`hmac.compare_digest`).

Each key also gets its own ``webhook_secret`` (stored as is: the webhooks stage needs it to
sign callbacks with HMAC, see :meth:`KeyStore.secret_of`).

Lookups may be cached in-process for ``cache_ttl_s`` seconds (bounded LRU): a revoked key
then keeps working on a process that has it cached for at most that long.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

import pymysql

from services.common.db import Database
from services.common.errors import OcrstreamError

KEY_PREFIX = "ocs"
_KEY_RE = re.compile(r"^ocs_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
_ID_RE = re.compile(r"^[0-9a-f]{12}$")
_COLUMNS = "key_id, name, key_hash, rate_per_s, burst, quota_per_day, created_at_ms, revoked_at_ms"


class MalformedKey(OcrstreamError, ValueError):
    """The presented string is not of the form ``ocs_<12 hex>_<43 base64url>``."""


@dataclass(frozen=True)
class ApiKey:
    """One row of ``api_keys``, without its hash and webhook secret.

    Attributes:
        key_id: Public id (12 hex characters).
        name: Label given at creation.
        rate_per_s: Per-key token refill rate, requests/s; None = the server default; 0 = unlimited.
        burst: Per-key bucket size, requests; None = the server default.
        quota_per_day: Per-key submissions per UTC day; None = the server default; 0 = none.
        created_at_ms: Creation time, Unix ms.
        revoked_at_ms: Revocation time, Unix ms; None while the key is valid.
    """

    key_id: str
    name: str
    rate_per_s: float | None
    burst: int | None
    quota_per_day: int | None
    created_at_ms: int
    revoked_at_ms: int | None

    @property
    def revoked(self) -> bool:
        """True once the key has been revoked."""
        return self.revoked_at_ms is not None


@dataclass(frozen=True)
class NewKey:
    """A freshly created key: the only time its full value and webhook secret are shown.

    Attributes:
        key: The stored row.
        token: The full key ``ocs_<key_id>_<secret>`` to give to the caller.
        webhook_secret: HMAC key of this key's webhook callbacks.
    """

    key: ApiKey
    token: str
    webhook_secret: str


def parse_key(presented: str) -> tuple[str, str]:
    """Split a presented key into ``(key_id, secret)``.

    Raises:
        MalformedKey: Not of the form ``ocs_<12 hex>_<43 base64url>``.
    """
    m = _KEY_RE.match(presented)
    if not m:
        raise MalformedKey("API keys look like ocs_<12 hex characters>_<43 characters>")
    return m.group(1), m.group(2)


def hash_key(token: str) -> str:
    """The stored form of a key: SHA-256 of its UTF-8 bytes, 64 lowercase hex characters."""
    return hashlib.sha256(token.encode()).hexdigest()


def _row_to_key(row: dict) -> ApiKey:
    return ApiKey(
        key_id=row["key_id"], name=row["name"],
        rate_per_s=None if row["rate_per_s"] is None else float(row["rate_per_s"]),
        burst=row["burst"], quota_per_day=row["quota_per_day"],
        created_at_ms=int(row["created_at_ms"]),
        revoked_at_ms=None if row["revoked_at_ms"] is None else int(row["revoked_at_ms"]),
    )


class KeyStore:
    """The ``api_keys`` table (MariaDB), with an optional bounded in-process cache of lookups.

    Args:
        db: The database (migration ``002_http`` applied).
        cache_ttl_s: How long a lookup (found or not) is reused, s; 0 = always ask MariaDB.
            This is the bound on how long a revoked key keeps working on a running process.
        cache_entries: Most key ids cached at once (least recently used dropped first).
    """

    def __init__(self, db: Database, cache_ttl_s: float = 0.0, cache_entries: int = 10_000):
        self.db = db
        self.cache_ttl_s = cache_ttl_s
        self.cache_entries = cache_entries
        # key_id -> (expires at, monotonic s; (key, key_hash) or None when unknown)
        self._cache: OrderedDict[str, tuple[float, tuple[ApiKey, str] | None]] = OrderedDict()

    # -- administration (the CLI) -------------------------------------------------------------
    async def create(self, name: str, *, rate_per_s: float | None = None, burst: int | None = None,
                     quota_per_day: int | None = None) -> NewKey:
        """Create a key with a fresh webhook secret.

        Args:
            name: Label, 1-128 characters.
            rate_per_s: Requests/s refill; None = server default; 0 = unlimited.
            burst: Bucket size, >= 1; None = server default.
            quota_per_day: Submissions per UTC day; None = server default; 0 = none.

        Returns:
            The key, its full value and its webhook secret (never retrievable again, except the
            webhook secret through :meth:`secret_of`).

        Raises:
            ValueError: A bad name or limit.
            pymysql.OperationalError: MariaDB unreachable.
        """
        if not 1 <= len(name) <= 128:
            raise ValueError("name must be 1-128 characters")
        if rate_per_s is not None and rate_per_s < 0:
            raise ValueError("rate must be >= 0 (0 = unlimited)")
        if burst is not None and burst < 1:
            raise ValueError("burst must be >= 1")
        if quota_per_day is not None and quota_per_day < 0:
            raise ValueError("quota per day must be >= 0 (0 = none)")
        for _ in range(5):  # 48-bit ids: a collision is astronomically rare, but cheap to survive
            key_id = secrets.token_hex(6)
            token = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
            webhook_secret = "whsec_" + secrets.token_urlsafe(32)
            created = int(time.time() * 1000)
            try:
                await self.db.execute(
                    "INSERT INTO api_keys (key_id, name, key_hash, webhook_secret, rate_per_s, burst, quota_per_day,"
                    " created_at_ms) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)",
                    key_id, name, hash_key(token), webhook_secret, rate_per_s, burst, quota_per_day, created)
            except pymysql.IntegrityError:
                continue
            self._cache.pop(key_id, None)
            key = ApiKey(key_id, name, rate_per_s, burst, quota_per_day, created, None)
            return NewKey(key=key, token=token, webhook_secret=webhook_secret)
        raise RuntimeError("could not find a free key id after 5 tries")

    async def revoke(self, key_id: str) -> ApiKey | None:
        """Revoke a key (idempotent: a revoked key keeps its first revocation time).

        Returns:
            The key as now stored, or None if no key has this id.
        """
        if not _ID_RE.match(key_id):
            return None
        await self.db.execute("UPDATE api_keys SET revoked_at_ms = %s WHERE key_id = %s AND revoked_at_ms IS NULL",
                              int(time.time() * 1000), key_id)
        self._cache.pop(key_id, None)
        return await self.get(key_id)

    async def list(self, include_revoked: bool = True) -> list[ApiKey]:
        """Every key, oldest first (never the hashes or secrets)."""
        where = "" if include_revoked else " WHERE revoked_at_ms IS NULL"
        rows = await self.db.query(f"SELECT {_COLUMNS} FROM api_keys{where} ORDER BY created_at_ms, key_id")
        return [_row_to_key(r) for r in rows]

    async def get(self, key_id: str) -> ApiKey | None:
        """The key with this id (revoked or not), straight from MariaDB, or None."""
        rows = await self.db.query(f"SELECT {_COLUMNS} FROM api_keys WHERE key_id = %s", key_id)
        return _row_to_key(rows[0]) if rows else None

    # -- the hot path -------------------------------------------------------------------------
    async def _entry(self, key_id: str) -> tuple[ApiKey, str] | None:
        now = time.monotonic()
        hit = self._cache.get(key_id)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(key_id)
            return hit[1]
        rows = await self.db.query(f"SELECT {_COLUMNS} FROM api_keys WHERE key_id = %s", key_id)
        entry = (_row_to_key(rows[0]), rows[0]["key_hash"]) if rows else None
        if self.cache_ttl_s > 0:
            self._cache[key_id] = (now + self.cache_ttl_s, entry)
            self._cache.move_to_end(key_id)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return entry

    async def lookup(self, presented: str) -> ApiKey | None:
        """The key a caller presented, revoked or not (check :attr:`ApiKey.revoked`).

        Returns:
            None when the string is malformed, names no key, or its secret is wrong.

        Raises:
            pymysql.OperationalError: MariaDB unreachable (and the key not cached).
        """
        try:
            key_id, _ = parse_key(presented)
        except MalformedKey:
            return None
        entry = await self._entry(key_id)
        if entry is None or not hmac.compare_digest(entry[1], hash_key(presented)):
            return None
        return entry[0]

    async def secret_of(self, key_id: str) -> str | None:
        """The webhook HMAC secret of a key (also of a revoked key: requests it made before being
        revoked are still signed), or None if no key has this id.

        Raises:
            pymysql.OperationalError: MariaDB unreachable.
        """
        rows = await self.db.query("SELECT webhook_secret FROM api_keys WHERE key_id = %s", key_id)
        return rows[0]["webhook_secret"] if rows else None
