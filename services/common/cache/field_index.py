"""The index of cached field extractions, in S3: which field sets of an image are stored, so a
request for some of them is answered from an extraction that holds them all (``design/
ARCHITECTURE.md``: "Field extraction is cached apart from the whole-page result, so a query for
some fields of an image reuses an extraction that already holds them").

Each ``extract`` result the sink stores under its cache key gets one small entry (written after
the result document) at :func:`schemas.keys.field_index_key`:
``fieldsets/<sha256>/<family>[.<scope>]/<field count>-<gen_id>.json`` holding
``{"cache_key": ..., "fields": [sorted names]}``. The *family* (:func:`schemas.keys.field_family_id`)
is the generation without its field list (same engine, model, revision, dialect, preprocessing),
so one LIST of an image's family prefix finds every extraction of it in that cache scope, and
the count in each name skips those with too few fields before any GET.

Why S3 and not Redis: Redis is a cache that may be flushed or down; the entries live next to
the documents they point at, so losing Redis costs no subset answer (``docs/single-flight.md``).
An entry is one PUT per computed extraction and a lookup one LIST (plus a GET per candidate)
on an ``extract`` miss, which is followed by a VLM call of seconds otherwise.

Pure helpers (:func:`entry_body`, :func:`candidates`, :func:`holds`) and the I/O calls
(:func:`record_extraction`, :func:`forget_extraction`, :func:`find_extractions`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import orjson

from schemas.keys import (
    CacheGeneration, field_family_id, field_index_key, field_index_prefix, parse_cache_key,
)
from services.common.s3 import ObjectStore

MAX_READ = 8
"""Index entries read (GET, concurrently) per lookup at most: the smallest candidates first."""


def entry_body(cache_key: str, fields: Iterable[str]) -> bytes:
    """The JSON of an index entry: ``{"cache_key": <key>, "fields": [<names sorted, once>]}``."""
    return orjson.dumps({"cache_key": cache_key, "fields": sorted(set(fields))})


def candidates(listing: Iterable[tuple[str, int]], need: int, exclude_gen_id: str) -> list[str]:
    """The index entries of a LIST (``(key, last modified ms)``) that may hold ``need`` fields:
    those whose name counts at least ``need`` fields, other than ``exclude_gen_id``'s own (the
    request's key, already missed), smallest count first, then newest; names not of the form
    ``<count>-<gen_id>.json`` are skipped."""
    found: list[tuple[int, int, str]] = []
    for key, modified in listing:
        name = key.rsplit("/", 1)[-1]
        count, dash, rest = name.partition("-")
        if not dash or not count.isdigit() or not rest.endswith(".json"):
            continue
        if int(count) < need or rest[:-len(".json")] == exclude_gen_id:
            continue
        found.append((int(count), -modified, key))
    return [k for _, _, k in sorted(found)]


def holds(raw: bytes, fields: Iterable[str], content_sha256: str, scope: str | None) -> str | None:
    """The cache key an index entry ``raw`` points at when its extraction holds every one of
    ``fields`` and its key is of this image in this scope; None otherwise (an unreadable entry too)."""
    try:
        data = orjson.loads(raw)
        key, stored = data["cache_key"], data["fields"]
        _, key_scope, sha = parse_cache_key(key)
    except (ValueError, KeyError, TypeError):
        return None
    if sha != content_sha256 or key_scope != scope or not isinstance(stored, list):
        return None
    return key if set(fields) <= set(stored) else None


async def record_extraction(store: ObjectStore, cache_key: str, gen: CacheGeneration, fields: Iterable[str]) -> str:
    """Write the index entry of the extraction of ``fields`` stored under ``cache_key`` (generation
    ``gen``); returns its S3 key. Call it after the result document is written.

    Raises:
        ClientError: S3 refused the PUT.
        ValueError: ``cache_key`` is not a cache key.
    """
    names = sorted(set(fields))
    okey = field_index_key(cache_key, field_family_id(gen), len(names))
    await store.put(okey, entry_body(cache_key, names), "application/json")
    return okey


async def forget_extraction(store: ObjectStore, cache_key: str, gen: CacheGeneration, fields: Iterable[str]) -> str:
    """Delete the index entry of the extraction of ``fields`` under ``cache_key`` (generation
    ``gen``), if any: call it when an answer cut short is stored under that key, over an earlier
    whole one whose entry would now point at the cut answer. Returns its S3 key.

    Raises:
        ClientError: S3 refused the DELETE (a missing entry is no error).
        ValueError: ``cache_key`` is not a cache key.
    """
    okey = field_index_key(cache_key, field_family_id(gen), len(set(fields)))
    await store.delete(okey)
    return okey


async def find_extractions(store: ObjectStore, cache_key: str, gen: CacheGeneration,
                           fields: Iterable[str]) -> list[str]:
    """The cache keys of the stored extractions of ``cache_key``'s image, in its scope and
    ``gen``'s family, that hold every one of ``fields``: fewest fields first, then newest. One
    LIST, then at most :data:`MAX_READ` GETs in parallel. The documents themselves are not
    checked here (the caller HEADs the one it uses, against its purge fence).

    Raises:
        ClientError, OcrError: S3 trouble (the caller treats any as a miss).
    """
    gen_id, scope, sha = parse_cache_key(cache_key)
    names = set(fields)
    listing = await store.list_keys(field_index_prefix(sha, field_family_id(gen), scope))
    keys = candidates(listing, len(names), gen_id)[:MAX_READ]
    bodies = await asyncio.gather(*(store.get(k) for k in keys), return_exceptions=True)
    out = []
    for body in bodies:
        if isinstance(body, bytes) and (k := holds(body, names, sha, scope)) is not None:
            out.append(k)
    return out
