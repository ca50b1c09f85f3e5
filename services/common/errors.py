"""Exceptions shared by the stages, and the transient/permanent split the runner branches on.

Like aiokafka's errors, ours carry a ``retriable`` attribute: a retriable failure (a store or
the broker unreachable) is retried with backoff for as long as it lasts and never sends a
message to the DLQ; a permanent one (a bug, a poison message) is retried a bounded number of
times, then the message goes to ``ocr.dlq``.
"""

from __future__ import annotations

import asyncio

import botocore.exceptions
from aiokafka.errors import InvalidProducerEpoch, OutOfOrderSequenceNumber, ProducerFenced, UnknownProducerId
import pymysql.err
import redis.exceptions

from schemas.errors import ErrorCode, OcrstreamError

__all__ = ["OcrError", "OcrstreamError", "StoreUnavailable", "TRANSIENT_LIBRARY_ERRORS", "TRANSIENT_S3_CODES", "is_transient"]


class OcrError(OcrstreamError):
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


class StoreUnavailable(OcrstreamError):
    """A store (S3, Redis, MariaDB) or the broker did not answer; retried with backoff."""

    retriable = True


#: Library errors that mean "a dependency is down", not "this input is bad": the connection and
#: timeout errors of the standard library, botocore (S3), PyMySQL (MariaDB) and redis-py.
TRANSIENT_LIBRARY_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError, TimeoutError, asyncio.TimeoutError,
    botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ProxyConnectionError,
    pymysql.err.OperationalError, pymysql.err.InterfaceError,
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,  # BusyLoadingError is a ConnectionError
)

PRODUCER_STATE_ERRORS: tuple[type[BaseException], ...] = (
    OutOfOrderSequenceNumber, UnknownProducerId, InvalidProducerEpoch, ProducerFenced)
"""Send errors after which an idempotent producer's id and sequence numbers are of no more use
(without a transactional id, aiokafka reports ``INVALID_PRODUCER_EPOCH`` as ``ProducerFenced``).
Not retriable to aiokafka; transient here, since the producer renews itself on them
(:class:`services.common.kafka.RenewingProducer`) and the same message then goes through."""

#: S3 error codes (a ``ClientError``'s ``Error.Code``) that mean "try again later" (AWS S3 error
#: responses: SlowDown, ServiceUnavailable, InternalError, RequestTimeout; MinIO answers the same).
TRANSIENT_S3_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"})


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` means "something we depend on is down", not "this message is bad".

    A producer's lost sequence state (:data:`PRODUCER_STATE_ERRORS`) is transient. Then checks the
    ``retriable`` attribute (:class:`OcrstreamError` and aiokafka's
    ``KafkaError``), then the connection and timeout errors of the standard library, botocore,
    PyMySQL and redis-py by class (:data:`TRANSIENT_LIBRARY_ERRORS`), and an S3 error answer that
    means "try again" (:data:`TRANSIENT_S3_CODES`).
    """
    if isinstance(exc, PRODUCER_STATE_ERRORS):
        return True
    retriable = getattr(exc, "retriable", None)
    if retriable is not None:
        return bool(retriable)
    if isinstance(exc, TRANSIENT_LIBRARY_ERRORS):
        return True
    if isinstance(exc, botocore.exceptions.ClientError):
        return exc.response.get("Error", {}).get("Code", "") in TRANSIENT_S3_CODES
    return False
