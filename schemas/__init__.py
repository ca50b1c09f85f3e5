"""Event models, topic names, error codes and key builders shared by every ocrstream stage."""

from schemas.errors import ErrorCode, RETRYABLE_CODES
from schemas.events import (
    CompletedEvent,
    DlqEvent,
    InferEvent,
    OcrOutput,
    RequestEvent,
    ResultDocument,
    ResultEvent,
    SubmitEvent,
)
from schemas.keys import CacheGeneration, cache_key, image_object_key, result_object_key
from schemas.reading import ErrorInfo, Line, Page
from schemas.topics import Topics

__all__ = [
    "CacheGeneration",
    "CompletedEvent",
    "DlqEvent",
    "ErrorCode",
    "ErrorInfo",
    "InferEvent",
    "Line",
    "OcrOutput",
    "Page",
    "RETRYABLE_CODES",
    "RequestEvent",
    "ResultDocument",
    "ResultEvent",
    "SubmitEvent",
    "Topics",
    "cache_key",
    "image_object_key",
    "result_object_key",
]
