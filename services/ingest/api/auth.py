"""API keys and per-key rate limits of the HTTP front door."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from services.ingest.api.errors import ApiError


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``key_id`` None when keys are not required (local use)."""

    key_id: str | None = None


ANONYMOUS = Principal()


class Guard:
    """Authenticates a request and applies its key's rate limit.

    Args:
        settings: ``auth_required`` and the default rate limit.
    """

    def __init__(self, settings, cache=None, db=None):
        self.s = settings
        self.cache = cache
        self.db = db

    async def check(self, request: Request) -> Principal:
        """The caller's principal.

        Raises:
            ApiError: 401 ``unauthorized`` (missing, unknown or revoked key), 429 ``rate_limited``.
        """
        if not self.s.auth_required:
            return ANONYMOUS
        raise ApiError(401, "unauthorized", "API keys are not available yet")
