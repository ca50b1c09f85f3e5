"""Signed webhook delivery of completions to per-request callback URLs."""

from __future__ import annotations

from services.ingest.api.errors import ApiError


def validate_callback_url(url: str, settings) -> None:
    """Refuse a callback URL the dispatcher would never call (checked at submit time).

    Raises:
        ApiError: 400 ``callback_not_allowed``.
    """
    raise ApiError(400, "callback_not_allowed", "webhooks are not available yet")


class WebhookDispatcher:
    """Delivers completions that carry a ``callback_url`` (placeholder)."""

    def __init__(self, settings, db=None, telemetry=None):
        self.s = settings

    async def start(self) -> None:
        """Start delivering in the background."""

    async def stop(self) -> None:
        """Stop delivering."""
