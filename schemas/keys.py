"""Key builders: S3 object keys and cache keys derived from the content hash.

The cache key covers everything that changes a result: engine, model id, model revision,
task (prompt), the preprocessing version and engine options that change output (such as the
CPU engine's detector limit). Changing any one gives a new *generation*,
so old entries are never served after an upgrade and can be purged by generation. With
``OCRSTREAM_CACHE_SCOPE=key`` a key also names its tenant (the API key), so one tenant's
entries are never another's (``docs/cache-scope.md``).
"""

from __future__ import annotations

import hashlib
import re

from pydantic import BaseModel, ConfigDict


class CacheGeneration(BaseModel):
    """The parts of a cache key that are not the image: what produced the result."""

    model_config = ConfigDict(frozen=True)

    engine: str
    model: str
    model_revision: str
    task: str
    preprocess_version: int
    options: str = ""
    """Engine options that change results, ``name=value`` joined by ``,``; empty when every
    option has its default (so the default generation's id is what it was before options)."""

    @property
    def gen_id(self) -> str:
        """12 hex digits identifying this generation (SHA-256 of its fields, truncated)."""
        parts = [self.engine, self.model, self.model_revision, self.task, str(self.preprocess_version)]
        if self.options:
            parts.append(self.options)
        raw = "|".join(parts)
        return hashlib.sha256(raw.encode()).hexdigest()[:12]


_SCOPE_RE = re.compile(r"^[A-Za-z0-9_-]{1,20}$")


def cache_key(content_sha256: str, generation: CacheGeneration, scope: str | None = None) -> str:
    """Cache key of one image under one generation: ``<gen_id>:<sha256>`` (77 characters) in
    the global scope, ``<gen_id>:<scope>:<sha256>`` in a tenant's (``OCRSTREAM_CACHE_SCOPE=key``:
    :meth:`services.common.cache.keys.CacheKeySettings.cache_key_of` names the scope). The generation
    stays first (``cache purge`` matches ``<gen_id>:*``) and the SHA-256 last.

    Raises:
        ValueError: ``scope`` is not 1-20 characters of ``[A-Za-z0-9_-]``.
    """
    if scope is None:
        return f"{generation.gen_id}:{content_sha256}"
    if not _SCOPE_RE.match(scope):
        raise ValueError(f"not a cache scope: {scope!r}")
    return f"{generation.gen_id}:{scope}:{content_sha256}"


def parse_cache_key(key: str) -> tuple[str, str | None, str]:
    """Inverse of :func:`cache_key`: ``(gen_id, scope or None, content_sha256)``.

    Raises:
        ValueError: if ``key`` is not of the form ``<gen_id>[:<scope>]:<sha256>``.
    """
    gen_id, sep, rest = key.partition(":")
    scope, _, sha = rest.rpartition(":")
    if not sep or not gen_id or len(sha) != 64 or (scope and not _SCOPE_RE.match(scope)):
        raise ValueError(f"not a cache key: {key!r}")
    return gen_id, scope or None, sha


def split_cache_key(key: str) -> tuple[str, str]:
    """``(gen_id, content_sha256)`` of a cache key, whatever its scope (:func:`parse_cache_key`).

    Raises:
        ValueError: if ``key`` is not of the form ``<gen_id>[:<scope>]:<sha256>``.
    """
    gen_id, _, sha = parse_cache_key(key)
    return gen_id, sha


def image_object_key(content_sha256: str) -> str:
    """S3 key of an image stored by content: ``images/<sha[:2]>/<sha>``."""
    return f"images/{content_sha256[:2]}/{content_sha256}"


def result_object_key(cache_key_: str) -> str:
    """S3 key of the result document for a cache key: ``results/<sha256>/<gen_id>.json``, or
    ``results/<sha256>/<gen_id>.<scope>.json`` for a scoped key (each tenant its own document)."""
    gen_id, scope, sha = parse_cache_key(cache_key_)
    return f"results/{sha}/{gen_id}.json" if scope is None else f"results/{sha}/{gen_id}.{scope}.json"


def request_output_key(request_id: str) -> str:
    """S3 key of the OCR output of one request that is stored under no cache key (a result of
    another cache generation, too large for its database row): ``results/requests/<sha256 of the
    request id>.json`` (a hash: any request id makes a valid key)."""
    return f"results/requests/{hashlib.sha256(request_id.encode()).hexdigest()}.json"


def purge_fence_key(gen_id: str) -> str:
    """S3 key of a generation's purge fence: ``fences/<gen_id>.json`` (``{"purged_at_ms": ...}``),
    written by ``ocrstream cache purge``. A stored result document of that generation last
    modified before the fence is not recalled from S3 (it is computed again, and overwritten)."""
    return f"fences/{gen_id}.json"


def field_family_id(generation: CacheGeneration) -> str:
    """12 hex digits naming every ``extract`` generation that differs from ``generation`` only in
    its field list: the id of the generation whose ``task`` is the bare task name (``extract``
    for ``extract:<12 hex>``), the engine, model, revision, preprocessing and options unchanged.
    An index of cached extractions groups them by it (:func:`field_index_prefix`)."""
    task = generation.task.partition(":")[0]
    return generation.model_copy(update={"task": task}).gen_id


def field_index_prefix(content_sha256: str, family_id: str, scope: str | None = None) -> str:
    """S3 prefix of the index entries of an image's cached extractions of one family
    (:func:`field_family_id`) in one cache scope: ``fieldsets/<sha256>/<family>/`` (global) or
    ``fieldsets/<sha256>/<family>.<scope>/``; one LIST of it finds them all."""
    return f"fieldsets/{content_sha256}/{family_id}/" if scope is None else \
        f"fieldsets/{content_sha256}/{family_id}.{scope}/"


def field_index_key(cache_key_: str, family_id: str, field_count: int) -> str:
    """S3 key of the index entry of the extraction stored under ``cache_key_``:
    ``<field_index_prefix>/<field count>-<gen_id>.json`` (the count in the name lets a reader
    skip, from the LIST alone, every extraction with fewer fields than it needs).

    Raises:
        ValueError: ``cache_key_`` is not a cache key (:func:`parse_cache_key`).
    """
    gen_id, scope, sha = parse_cache_key(cache_key_)
    return f"{field_index_prefix(sha, family_id, scope)}{field_count}-{gen_id}.json"


def document_object_key(document_id: str) -> str:
    """S3 key of a document's assembled result (``ocr.document.v1``): ``documents/<document_id>.json``
    (a request id's characters, ``A-Z a-z 0-9 . _ : -``, are all safe in an S3 key; :mod:`schemas.ids`)."""
    return f"documents/{document_id}.json"
