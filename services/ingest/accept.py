"""Accepting one image: check it from its header, store it once under its SHA-256, describe it.

Shared by both doors of the ingest stage: the Kafka consumer of ``ocr.submit``
(:mod:`services.ingest.handler`) and the HTTP front door (:mod:`services.ingest.api`).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from schemas.errors import ErrorCode
from schemas.keys import image_object_key
from services.common.errors import OcrError
from services.common.imaging import ImageInfo, sniff
from services.common.s3 import ObjectStore
from services.common.settings import Limits

CONTENT_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "TIFF": "image/tiff",
                 "WEBP": "image/webp", "BMP": "image/bmp", "PDF": "application/pdf"}


@dataclass(frozen=True)
class Accepted:
    """An image that passed the checks and is stored: ``image_uri`` is ``s3://<bucket>/images/<sha[:2]>/<sha>``."""

    content_sha256: str
    image_uri: str
    size_bytes: int
    info: ImageInfo


async def accept_image(data: bytes, limits: Limits, store: ObjectStore, sha256: str | None = None) -> Accepted:
    """Check ``data`` (byte limit, format sniffed from the bytes, pixel and page limits read from
    the header; nothing is decoded) and store it under its content hash unless already there.

    Args:
        data: The upload.
        limits: Byte, pixel and page limits.
        store: Where images are kept.
        sha256: The hex SHA-256 of ``data`` when the caller hashed it while reading.

    Raises:
        OcrError: ``input_too_large``, ``empty_input``, ``unsupported_format``, ``corrupt_image``,
            ``image_too_large`` or ``too_many_pages`` (input errors: the same bytes always fail),
            or a transient S3 error from the store.
    """
    if len(data) > limits.max_image_bytes:
        raise OcrError(ErrorCode.INPUT_TOO_LARGE, f"{len(data)} bytes exceeds the limit of {limits.max_image_bytes}")
    info = await asyncio.to_thread(sniff, data, limits.max_pixels, limits.max_pages)
    sha = sha256 or await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    key = image_object_key(sha)
    await store.put_if_absent(key, data, CONTENT_TYPES.get(info.format, "application/octet-stream"))
    return Accepted(content_sha256=sha, image_uri=store.uri(key), size_bytes=len(data), info=info)
