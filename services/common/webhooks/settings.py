"""Callback rules read by the door (at submit) and the webhooks stage (at each attempt)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from services.common.settings import CommonSettings


class CallbackSettings(CommonSettings):
    """Where callbacks may go and how they are signed (env ``OCRSTREAM_WEBHOOK_*``).

    Both sides must agree: the door refuses a ``callback_url`` the stage would refuse, and a
    request without an API key when there is no ``webhook_secret`` to sign its callback with.
    """

    webhook_allowed_hosts: list[str] = Field(
        default_factory=list, description="host names (fnmatch patterns) callbacks may go to; empty = none"
    )
    webhook_allow_private: bool = Field(
        default=False, description="allow callbacks to loopback/private/link-local addresses (local testing only)"
    )
    webhook_secret: SecretStr | None = Field(
        default=None, description="HMAC key for callbacks of requests made without an API key"
    )
