"""Exceptions shared by the stages, and the transient/permanent split the runner branches on.

Like aiokafka's errors, ours carry a ``retriable`` attribute: a retriable failure (a store or
the broker unreachable) is retried with backoff for as long as it lasts and never sends a
message to the DLQ; a permanent one (a bug, a poison message) is retried a bounded number of
times, then the message goes to ``ocr.dlq``.
"""

from __future__ import annotations

import asyncio

from schemas.errors import ErrorCode


class OcrError(Exception):
    """A failure with a stable :class:`~schemas.errors.ErrorCode` that ends a request.

    Args:
        code: The error code reported in the result.
        message: Human-readable detail.
    """

    retriable = False

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class StoreUnavailable(Exception):
    """A store (S3, Redis, MariaDB) or the broker did not answer; retried with backoff."""

    retriable = True


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` means "something we depend on is down", not "this message is bad".

    Checks the ``retriable`` attribute first (ours and aiokafka's), then well-known
    connection/timeout errors of botocore, PyMySQL and redis-py.
    """
    retriable = getattr(exc, "retriable", None)
    if retriable is not None:
        return bool(retriable)
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("botocore") and name in {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ProxyConnectionError",
    }:
        return True
    if module.startswith("pymysql") and name in {"OperationalError", "InterfaceError"}:
        return True
    if module.startswith("redis") and name in {"ConnectionError", "TimeoutError", "BusyLoadingError"}:
        return True
    if module.startswith("botocore") and name == "ClientError":
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        return code in {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"}
    return False
