"""Serialisation helpers for events on the wire (orjson) and the ids derived from records."""

from __future__ import annotations

import hashlib
from typing import TypeVar

import orjson
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def dumps(event: BaseModel) -> bytes:
    """Serialise an event to JSON bytes (by alias, so ``schema`` is written).

    Written by pydantic's own JSON serialiser in one step, without the intermediate dicts of
    ``orjson.dumps(event.model_dump(mode="json", by_alias=True))`` (what it was): 5 instead of
    8 µs for a cache hit's ``ResultEvent``, 38 instead of 70 µs for one with 30 lines. The bytes
    are the same (compact, fields in declaration order, UTF-8 unescaped, the same shortest float
    text, ``1e+16``; tests/unit/test_schemas.py).
    """
    return event.__pydantic_serializer__.to_json(event, by_alias=True)


def loads(model: type[M], raw: bytes | None) -> M:
    """Parse JSON bytes into ``model``.

    Raises:
        orjson.JSONDecodeError: not JSON.
        pydantic.ValidationError: JSON that fails the schema.
    """
    if raw is None:
        raise ValueError("record has no value")
    return model.model_validate(orjson.loads(raw))


def completion_event_id(request_id: str) -> str:
    """Deterministic event id of a request's completion (32 hex digits), so replays are identical."""
    return hashlib.sha256(f"completed:{request_id}".encode()).hexdigest()[:32]


def derived_request_id(topic: str, partition: int, offset: int) -> str:
    """Request id for a submission that carried none: stable under redelivery of the record."""
    return hashlib.sha256(f"{topic}/{partition}/{offset}".encode()).hexdigest()[:32]
