"""Key builders: S3 object keys and cache keys derived from the content hash.

The cache key covers everything that changes a result: engine, model id, model revision,
task (prompt), the preprocessing version and engine options that change output (such as the
CPU engine's detector limit). Changing any one gives a new *generation*,
so old entries are never served after an upgrade and can be purged by generation.
"""

from __future__ import annotations

import hashlib

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


def cache_key(content_sha256: str, generation: CacheGeneration) -> str:
    """Cache key of one image under one generation: ``<gen_id>:<sha256>`` (77 characters)."""
    return f"{generation.gen_id}:{content_sha256}"


def split_cache_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`cache_key`: returns ``(gen_id, content_sha256)``.

    Raises:
        ValueError: if ``key`` is not of the form ``<gen_id>:<sha256>``.
    """
    gen_id, sep, sha = key.partition(":")
    if not sep or len(sha) != 64:
        raise ValueError(f"not a cache key: {key!r}")
    return gen_id, sha


def image_object_key(content_sha256: str) -> str:
    """S3 key of an image stored by content: ``images/<sha[:2]>/<sha>``."""
    return f"images/{content_sha256[:2]}/{content_sha256}"


def result_object_key(cache_key_: str) -> str:
    """S3 key of the result document for a cache key: ``results/<sha256>/<gen_id>.json``."""
    gen_id, sha = split_cache_key(cache_key_)
    return f"results/{sha}/{gen_id}.json"


def request_output_key(request_id: str) -> str:
    """S3 key of the OCR output of one request that is stored under no cache key (a result of
    another cache generation, too large for its database row): ``results/requests/<sha256 of the
    request id>.json`` (a hash: any request id makes a valid key)."""
    return f"results/requests/{hashlib.sha256(request_id.encode()).hexdigest()}.json"
