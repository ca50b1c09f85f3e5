"""Accepting one image: check it from its header, store it once under its SHA-256, describe it.

Shared by both doors: the ingest stage's Kafka consumer of ``ocr.submit``
(``services.ingest.handler``) and the HTTP door (``services.api.serving_submit``).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import BinaryIO

from schemas.errors import ErrorCode
from schemas.keys import image_object_key
from services.common.errors import OcrError
from services.common.images.decoding import DecoderPool
from services.common.images.imaging import ImageInfo
from services.common.s3 import MultipartUpload, ObjectStore
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


async def accept_image(data: bytes, limits: Limits, store: ObjectStore, decoder: DecoderPool,
                       sha256: str | None = None, info: ImageInfo | None = None) -> Accepted:
    """Check ``data`` (byte limit, format sniffed from the bytes, pixel and page limits read from
    the header; nothing is decoded) and store it under its content hash unless already there.

    Args:
        data: The upload.
        limits: Byte, pixel and page limits.
        store: Where images are kept.
        decoder: Runs the format check in a decoder process, bounded in time and memory.
        sha256: The hex SHA-256 of ``data`` when the caller hashed it while reading.
        info: The header check's answer when the caller already ran it (ingest's document check,
            :meth:`~services.common.images.decoding.DecoderPool.document_plan`); None: sniffed here.

    Raises:
        OcrError: ``input_too_large``, ``empty_input``, ``unsupported_format``, ``corrupt_image``,
            ``image_too_large``, ``too_many_pages``, ``decode_timeout`` or ``image_too_complex``
            (input errors: the same bytes always fail), or a transient S3 error from the store.
    """
    if len(data) > limits.max_image_bytes:
        raise OcrError(ErrorCode.INPUT_TOO_LARGE, f"{len(data)} bytes exceeds the limit of {limits.max_image_bytes}")
    if info is None:
        info = await decoder.sniff(data)
    sha = sha256 or await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    key = image_object_key(sha)
    await store.put_if_absent(key, data, CONTENT_TYPES.get(info.format, "application/octet-stream"))
    return Accepted(content_sha256=sha, image_uri=store.uri(key), size_bytes=len(data), info=info)


async def accept_staged(spool: BinaryIO, size: int, sha256: str, upload: MultipartUpload, limits: Limits,
                        store: ObjectStore, decoder: DecoderPool, info: ImageInfo | None = None) -> Accepted:
    """:func:`accept_image` for a large HTTP upload that was streamed to S3 while it was read.

    The bytes are in two places: every part in the open multipart ``upload`` (to a staging key)
    and, in the same order, in ``spool`` (a file on local disk). The checks are the same as
    :func:`accept_image`'s, run by the same :func:`~services.common.images.imaging.sniff` on the whole
    spooled file (in a decoder process): a PDF's page count needs its cross-reference table at the end, a GIF's or
    TIFF's frame count walks the whole file, so a check on the first part alone could answer
    differently. Only if they pass is the upload made into ``images/<sha[:2]>/<sha>``
    (:meth:`~services.common.s3.ObjectStore.put_staged_if_absent`: completed, copied, staging
    object deleted; or aborted when the image is already stored).

    Args:
        spool: Seekable file holding exactly the uploaded bytes.
        size: Their length, bytes.
        sha256: Their hex SHA-256 (hashed while reading).
        upload: The open multipart upload holding the same bytes.
        limits: Byte, pixel and page limits.
        store: Where images are kept.
        decoder: Runs the format check in a decoder process (the spool file is passed to it as
            a descriptor, not read here).
        info: The header check's answer when the caller already ran it (the HTTP door's
            document check); None: sniffed here.

    Raises:
        OcrError: the same input errors as :func:`accept_image`; the upload is then left open
            (the caller aborts it). Transient S3 errors as from the store.
    """
    if size > limits.max_image_bytes:
        raise OcrError(ErrorCode.INPUT_TOO_LARGE, f"{size} bytes exceeds the limit of {limits.max_image_bytes}")
    if info is None:
        info = await decoder.sniff(spool)
    key = image_object_key(sha256)
    await store.put_staged_if_absent(upload, key, CONTENT_TYPES.get(info.format, "application/octet-stream"))
    return Accepted(content_sha256=sha256, image_uri=store.uri(key), size_bytes=size, info=info)
