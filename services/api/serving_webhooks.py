"""The door's check of a ``callback_url`` when it accepts a request or a job.

Delivery is the webhooks stage's (``services/webhooks/``, :mod:`services.webhooks.delivery` says
how a completion reaches its callback); the door refuses at once what that stage would never send.
"""

from __future__ import annotations

from services.api.errors import ApiError
from services.common.webhooks.callbacks import CallbackRefused, check_callback

__all__ = ["validate_callback_url"]


async def validate_callback_url(url: str, settings, key_id: str | None = None, enabled: bool = True) -> None:
    """Refuse, at submit time, a callback the webhooks stage would never send.

    Checks the URL (:func:`services.common.webhooks.callbacks.check_callback`: scheme, no user info, host on
    ``webhook_allowed_hosts``, every resolved address public unless ``webhook_allow_private``)
    and that the callback can be signed: a request without an API key needs ``webhook_secret``.

    Args:
        url: The ``callback_url`` option.
        settings: :class:`~services.api.settings.ApiSettings`.
        key_id: The submitting API key, or None.

        enabled: Whether this door accepts callbacks (``webhook_enabled``); checked after the
            URL, before the signing secret.

    Raises:
        ApiError: 400 ``callback_not_allowed`` with the specific reason; 400 ``invalid_request``
            when the URL passes but webhooks are disabled here.
    """
    try:
        await check_callback(url, settings.webhook_allowed_hosts, settings.webhook_allow_private)
    except CallbackRefused as exc:
        raise ApiError("callback_not_allowed", exc.reason) from None
    if not enabled:  # nothing here would ever send it: refuse rather than drop it silently
        raise ApiError("invalid_request", "callback_url is refused: webhooks are disabled on this server "
                                               "(OCRSTREAM_WEBHOOK_ENABLED=false)")
    if key_id is None and settings.webhook_secret is None:
        raise ApiError("callback_not_allowed",
                       "callbacks of requests without an API key cannot be signed: the server has no webhook_secret")
