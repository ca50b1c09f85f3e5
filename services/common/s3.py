"""Async wrapper over boto3 for the S3-compatible object store (images and result documents)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import unquote

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from cachetools import TTLCache

from schemas.errors import ErrorCode
from services.common.errors import OcrError
from services.common.settings import S3Settings
from services.common.telemetry import Telemetry

log = logging.getLogger(__name__)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into ``(bucket, key)``.

    Raises:
        OcrError: ``invalid_request`` if ``uri`` is not an s3 URI with a bucket and a key.
    """
    if not uri.startswith("s3://"):
        raise OcrError(ErrorCode.INVALID_REQUEST, f"not an s3:// URI: {uri[:100]!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket or not key:
        raise OcrError(ErrorCode.INVALID_REQUEST, f"s3 URI needs a bucket and a key: {uri[:100]!r}")
    return bucket, key


def _decoded_forms(key: str) -> list[str]:
    """``key`` and what percent-decoding makes of it, decoded again until it no longer changes
    (at most 4 rounds): a server or proxy that decodes a key once more must not find a path in it."""
    forms = [key]
    for _ in range(4):
        nxt = unquote(forms[-1])
        if nxt == forms[-1]:
            break
        forms.append(nxt)
    return forms


def reference_problem(uri: str, allowed: list[str]) -> str | None:
    """Why ingest may not read the ``s3://bucket/key`` at ``uri``, or None when it may.

    ``allowed`` holds ``bucket/prefix`` entries (``OCRSTREAM_S3_ALLOWED_PREFIXES``): the URI's
    bucket must equal an entry's bucket exactly and its key start with the entry's prefix, as
    literal strings (``bucket/`` alone admits the whole bucket). A key is refused anywhere when
    it, or any percent-decoding of it, has a ``.`` or ``..`` path segment, a backslash or a
    control character: S3 keys are flat names that boto3 sends literally (percent-encoding every
    ``%``), so a literal prefix cannot be escaped by S3 itself; these rules also keep it from
    being escaped through a server or proxy that normalises paths.

    Args:
        uri: The submission's ``image_uri``.
        allowed: The allow-list.

    Returns:
        A message for ``image_uri_not_allowed`` (naming the allowed locations), or None.

    Raises:
        OcrError: ``invalid_request`` if ``uri`` is not an ``s3://bucket/key`` URI.
    """
    bucket, key = parse_s3_uri(uri)
    where = ", ".join(f"s3://{entry}" for entry in allowed) or "none (S3 references are turned off)"
    for form in _decoded_forms(key):
        if ("\\" in form or any(ord(c) < 32 or ord(c) == 127 for c in form)
                or any(seg in (".", "..") for seg in form.split("/"))):
            return (f"image_uri {uri[:200]!r}: the key has a '.' or '..' segment, a backslash or a control "
                    f"character (also once percent-decoded); ingest reads only under {where}")
    for entry in allowed:
        ok_bucket, _, prefix = entry.partition("/")
        if bucket == ok_bucket and key.startswith(prefix):
            return None
    return (f"image_uri {uri[:200]!r} is outside the S3 locations ingest may read: {where} "
            "(OCRSTREAM_S3_ALLOWED_PREFIXES)")


class ObjectStore:
    """Blocking boto3 calls run in threads, each timed into ``ocrstream_store_call_seconds``.

    Args:
        cfg: S3 settings (endpoint, credentials, bucket, timeouts).
        telemetry: Where call latencies are recorded; None to skip.
    """

    def __init__(self, cfg: S3Settings, telemetry: Telemetry | None = None):
        self.cfg = cfg
        self.bucket = cfg.bucket
        self.telemetry = telemetry
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=cfg.endpoint_url,
            aws_access_key_id=cfg.access_key,
            aws_secret_access_key=cfg.secret_key.get_secret_value(),
            region_name=cfg.region,
            config=Config(
                connect_timeout=cfg.connect_timeout_s,
                read_timeout=cfg.read_timeout_s,
                retries={"max_attempts": 2, "mode": "standard"},
                max_pool_connections=cfg.max_pool_connections,
                s3={"addressing_style": "path"},
            ),
        )
        # keys known to exist (content-addressed, so never rewritten), bounded in entries and age
        self._known: TTLCache | None = TTLCache(cfg.known_keys, cfg.known_ttl_s) if cfg.known_keys else None

    def uri(self, key: str, bucket: str | None = None) -> str:
        """``s3://<bucket>/<key>`` for a key in our bucket (or ``bucket``)."""
        return f"s3://{bucket or self.bucket}/{key}"

    async def _call(self, op: str, fn, **kw):
        if self.telemetry is None:
            return await asyncio.to_thread(fn, **kw)
        with self.telemetry.store_call("s3", op, **{"s3.key": kw["Key"]} if "Key" in kw else {}):
            return await asyncio.to_thread(fn, **kw)

    async def ping(self) -> bool:
        """True if the bucket answers (a readiness check; raises on connection errors)."""
        await self._call("head_bucket", self.client.head_bucket, Bucket=self.bucket)
        return True

    async def ensure_bucket(self) -> bool:
        """Create the bucket if missing. Returns True when it was created."""
        try:
            await self._call("head_bucket", self.client.head_bucket, Bucket=self.bucket)
            return False
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
                raise
        await self._call("create_bucket", self.client.create_bucket, Bucket=self.bucket)
        return True

    async def exists(self, key: str, bucket: str | None = None) -> bool:
        """True if the object exists."""
        try:
            await self._call("head", self.client.head_object, Bucket=bucket or self.bucket, Key=key)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    async def last_modified_ms(self, key: str) -> int | None:
        """When the object at ``key`` was last written (epoch ms, from HEAD's ``LastModified``), or
        None when it does not exist.

        Raises:
            ClientError: S3 refused the HEAD for another reason (a 403, a 5xx).
        """
        try:
            meta = await self._call("head", self.client.head_object, Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return int(meta["LastModified"].timestamp() * 1000)

    async def list_keys(self, prefix: str, max_keys: int = 1000) -> list[tuple[str, int]]:
        """The objects under ``prefix`` (one LIST, at most ``max_keys``, in key order): ``(key,
        last modified, epoch ms)`` each; empty when there is none.

        Raises:
            ClientError: S3 refused the LIST (a 403, a 5xx).
        """
        resp = await self._call("list", self.client.list_objects_v2, Bucket=self.bucket, Prefix=prefix,
                                MaxKeys=max_keys)
        return [(o["Key"], int(o["LastModified"].timestamp() * 1000)) for o in resp.get("Contents", ())]

    async def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        """Write ``data`` (bytes) at ``key``; overwrites."""
        await self._call("put", self.client.put_object, Bucket=self.bucket, Key=key, Body=data, ContentType=content_type)

    async def put_file(self, key: str, path: str, content_type: str = "application/octet-stream") -> None:
        """Upload the file at ``path`` to ``key`` (overwrites), read from disk in parts (boto3's
        managed transfer: multipart above 8 MiB), so a large file is never all in memory."""
        await self._call("put_file", self.client.upload_file, Filename=path, Bucket=self.bucket, Key=key,
                         ExtraArgs={"ContentType": content_type})

    async def put_if_absent(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> bool:
        """Content-addressed put: skip when the key exists (same key = same bytes).

        A key this process stored or found present within ``known_ttl_s`` is not asked about
        again (a repeat costs no S3 call; the HEAD is ~5 ms of boto3 here). Nothing in ocrstream
        deletes images; where something else does (a bucket rule, by hand), set ``known_keys`` to 0:
        the memory counts from this process's last look, so a deleted image would be trusted (and a
        cache miss for it end in ``missing_object``) until the entry ages out.

        Returns:
            True if the object was written, False if it was already there.
        """
        if self._known is not None and key in self._known:
            return False
        written = not await self.exists(key)
        if written:
            await self.put(key, data, content_type)
        if self._known is not None:
            self._known[key] = True
        return written

    async def get(self, key: str, bucket: str | None = None, max_bytes: int | None = None) -> bytes:
        """Read a whole object.

        Raises:
            OcrError: ``missing_object`` if it does not exist; ``input_too_large`` if it is
                larger than ``max_bytes``.
        """

        def _get() -> bytes:
            resp = self.client.get_object(Bucket=bucket or self.bucket, Key=key)
            if max_bytes is not None and resp["ContentLength"] > max_bytes:
                resp["Body"].close()
                raise OcrError(
                    ErrorCode.INPUT_TOO_LARGE, f"object is {resp['ContentLength']} bytes, limit {max_bytes}"
                )
            return resp["Body"].read()

        try:
            return await self._call("get", _get)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                raise OcrError(ErrorCode.MISSING_OBJECT, f"no object s3://{bucket or self.bucket}/{key}") from exc
            raise

    async def get_uri(self, uri: str, max_bytes: int | None = None) -> bytes:
        """Read the object at an ``s3://bucket/key`` URI (see :meth:`get`)."""
        bucket, key = parse_s3_uri(uri)
        return await self.get(key, bucket=bucket, max_bytes=max_bytes)

    async def delete(self, key: str) -> None:
        """Delete an object (no error if missing)."""
        await self._call("delete", self.client.delete_object, Bucket=self.bucket, Key=key)

    # -- large uploads: multipart to a staging key, then a server-side copy --------------------
    def staging_key(self) -> str:
        """A new, unique staging key: ``<staging_prefix><32 hex digits>``."""
        return f"{self.cfg.staging_prefix}{uuid.uuid4().hex}"

    async def start_multipart(self, key: str) -> "MultipartUpload":
        """Begin an S3 multipart upload to ``key`` (CreateMultipartUpload).

        The caller must end it with :meth:`MultipartUpload.complete` or
        :meth:`MultipartUpload.abort`: until then S3 keeps (and bills) the uploaded parts.
        """
        resp = await self._call("create_multipart", self.client.create_multipart_upload, Bucket=self.bucket, Key=key)
        return MultipartUpload(self, key, resp["UploadId"])

    async def put_staged_if_absent(self, upload: "MultipartUpload", key: str,
                                   content_type: str = "application/octet-stream") -> bool:
        """Content-addressed store of a finished multipart upload (:meth:`put_if_absent` for bytes
        that were streamed to a staging key).

        If ``key`` is known or present, the upload is aborted (no object is made). Otherwise it is
        completed, copied server-side (CopyObject, one request: objects up to 5 GiB) to ``key``
        with ``content_type``, and the staging object deleted, whether the copy worked or not (a
        delete that fails leaves it to the bucket's staging lifecycle rule,
        :meth:`ensure_staging_lifecycle`).

        Returns:
            True if the object was written, False if it was already there.

        Raises:
            botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: S3 failed; an
                upload that was not completed is still open: the caller aborts it.
        """
        if (self._known is not None and key in self._known) or await self.exists(key):
            await upload.abort()
            written = False
        else:
            await upload.complete()
            try:
                await self._call("copy", self.client.copy_object, Bucket=self.bucket, Key=key,
                                 CopySource={"Bucket": self.bucket, "Key": upload.key},
                                 MetadataDirective="REPLACE", ContentType=content_type)
            finally:
                try:
                    await self.delete(upload.key)
                except Exception as exc:  # noqa: BLE001 - the lifecycle rule removes it within a day
                    log.warning("s3: staging object %s not deleted: %r", upload.key, exc)
            written = True
        if self._known is not None:
            self._known[key] = True
        return written

    async def ensure_staging_lifecycle(self, days: int = 1) -> None:
        """Install (or replace) the bucket lifecycle rule on the staging prefix
        (:func:`staging_rule_id`): incomplete multipart uploads are aborted (AbortIncompleteMultipartUpload) and
        objects expired ``days`` after they were started/written. It cleans up after a door that
        was killed mid-upload; other rules of the bucket are kept. Idempotent (the same rule
        replaces itself). Source: S3 API PutBucketLifecycleConfiguration, which replaces the whole
        configuration, hence the read-modify-write.

        MinIO accepts the rule but keeps only its ``Expiration``; it aborts incomplete multipart
        uploads by itself (``MINIO_API_STALE_UPLOADS_EXPIRY``, 24 h by default).

        Raises:
            botocore.exceptions.ClientError: e.g. ``AccessDenied`` without the permission.
        """
        await self._ensure_expiry_rule(staging_rule_id(self.cfg.staging_prefix), self.cfg.staging_prefix, days)

    async def ensure_upload_lifecycle(self, days: int | None = None) -> None:
        """Install (or replace) the bucket lifecycle rule on the upload prefix
        (:func:`upload_rule_id`, ``S3Settings.upload_prefix``, where ``ocrstream submit`` puts files
        too large to send inline): objects are expired ``days`` (default
        ``S3Settings.upload_expiry_days``) after they were written, whether ingest accepted them
        (it keeps its own copy under ``images/``) or refused them. Same mechanism and caveats as
        :meth:`ensure_staging_lifecycle`.

        Raises:
            botocore.exceptions.ClientError: e.g. ``AccessDenied`` without the permission.
        """
        await self._ensure_expiry_rule(upload_rule_id(self.cfg.upload_prefix), self.cfg.upload_prefix,
                                       days or self.cfg.upload_expiry_days)

    async def _ensure_expiry_rule(self, rule_id: str, prefix: str, days: int) -> None:
        """Put rule ``rule_id`` (expire and abort uploads under ``prefix`` after ``days``) into the
        bucket's lifecycle configuration, keeping its other rules (read-modify-write)."""
        try:
            cur = await self._call("get_lifecycle", self.client.get_bucket_lifecycle_configuration, Bucket=self.bucket)
            rules = [r for r in cur.get("Rules", []) if r.get("ID") != rule_id]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchLifecycleConfiguration":
                raise
            rules = []
        rules.append({"ID": rule_id, "Status": "Enabled", "Filter": {"Prefix": prefix},
                      "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": days}, "Expiration": {"Days": days}})
        await self._call("put_lifecycle", self.client.put_bucket_lifecycle_configuration, Bucket=self.bucket,
                         LifecycleConfiguration={"Rules": rules})


def staging_rule_id(prefix: str) -> str:
    """ID of the bucket lifecycle rule on staging prefix ``prefix``
    (:meth:`ObjectStore.ensure_staging_lifecycle`): ``ocrstream-staging <prefix>``, so deployments
    sharing a bucket with different prefixes keep a rule each."""
    return f"ocrstream-staging {prefix}"


def upload_rule_id(prefix: str) -> str:
    """ID of the bucket lifecycle rule on upload prefix ``prefix`` (:meth:`ObjectStore.ensure_upload_lifecycle`):
    ``ocrstream-uploads <prefix>``."""
    return f"ocrstream-uploads {prefix}"


class MultipartUpload:
    """One S3 multipart upload in progress (from :meth:`ObjectStore.start_multipart`).

    Parts are numbered in the order :meth:`upload_part` is called (1, 2, ...); every part but
    the last must be at least 5 MiB (S3's minimum part size; MinIO enforces it too). ``state``
    is ``open``, ``completed`` or ``aborted``.

    Args:
        store: The store whose client and bucket are used.
        key: The object key the upload makes.
        upload_id: S3's UploadId.
    """

    def __init__(self, store: ObjectStore, key: str, upload_id: str):
        self.store = store
        self.key = key
        self.upload_id = upload_id
        self.state = "open"
        self._parts: list[dict] = []
        self._next = 1

    async def upload_part(self, data: bytes | bytearray) -> None:
        """Upload the next part (UploadPart); its number is taken when this is called.

        Raises:
            RuntimeError: the upload is not open.
            botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: S3 failed.
        """
        if self.state != "open":
            raise RuntimeError(f"multipart upload to {self.key} is {self.state}")
        n, self._next = self._next, self._next + 1
        s = self.store
        resp = await s._call("upload_part", s.client.upload_part, Bucket=s.bucket, Key=self.key,
                             UploadId=self.upload_id, PartNumber=n, Body=data)
        self._parts.append({"PartNumber": n, "ETag": resp["ETag"]})

    async def complete(self) -> None:
        """Join the uploaded parts into the object (CompleteMultipartUpload).

        Raises:
            botocore.exceptions.ClientError: e.g. ``EntityTooSmall`` (a part but the last under 5 MiB).
        """
        s = self.store
        parts = sorted(self._parts, key=lambda p: p["PartNumber"])
        await s._call("complete_multipart", s.client.complete_multipart_upload, Bucket=s.bucket, Key=self.key,
                      UploadId=self.upload_id, MultipartUpload={"Parts": parts})
        self.state = "completed"

    async def abort(self) -> None:
        """Drop the upload and its parts (AbortMultipartUpload); nothing is left in the bucket.
        Call it after any part upload in flight has ended (S3 may keep a part that finishes
        after the abort). A no-op unless the upload is open.

        Raises:
            botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: S3 failed (the
                bucket's lifecycle rule removes the parts later).
        """
        if self.state != "open":
            return
        s = self.store
        try:
            await s._call("abort_multipart", s.client.abort_multipart_upload, Bucket=s.bucket, Key=self.key,
                          UploadId=self.upload_id)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                raise
        self.state = "aborted"
