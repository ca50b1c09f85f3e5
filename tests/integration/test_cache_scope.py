"""Cache scope (``OCRSTREAM_CACHE_SCOPE``) on the real stack: with ``global`` one API key's image
answers another key's upload from the cache; with ``key`` each key has a cache of its own (the
door's lookup and dedup's claim alike), requests without a key share the global scope, single
flight still holds within a scope, and ``cache purge`` removes every scope's entries."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid

import httpx
import pytest

from schemas.keys import parse_cache_key
from tests.conftest import text_image
from tests.integration.conftest import API_ENV
from tests.integration.test_http_auth import cli
from tests.stack import API, REPO, namespaced_pipeline

pytestmark = pytest.mark.stack

PNG = {"Content-Type": "image/png"}
KEYED = {**API_ENV, "OCRSTREAM_AUTH_REQUIRED": "true", "OCRSTREAM_AUTH_CACHE_S": "0",
         "OCRSTREAM_WEBHOOK_ENABLED": "false"}


def _keys(n: int) -> list[tuple[str, str]]:
    """``n`` new unlimited keys: (key_id, token)."""
    out = []
    for _ in range(n):
        made = cli("keys", "create", "--name", f"scope-{uuid.uuid4().hex[:8]}", "--rate", "0")
        assert made.returncode == 0, made.stderr
        fields = dict(re.findall(r"^(\w+):\s+(\S+)$", made.stdout, re.M))
        out.append((fields["key_id"], fields["api_key"]))
    return out


def _post(c: httpx.Client, token: str, img: bytes) -> httpx.Response:
    return c.post("/v1/ocr", content=img, headers={**PNG, "X-API-Key": token})


def _done(c: httpx.Client, token: str, r: httpx.Response) -> dict:
    got = c.get(f"/v1/ocr/{r.json()['request_id']}", params={"wait": 90}, headers={"X-API-Key": token}).json()
    assert got["status"] == "ok", got
    return got["result"]


def test_with_the_global_scope_another_keys_image_is_answered_from_the_cache(pipeline):
    door = pipeline.start(API, extra_env={**KEYED, "OCRSTREAM_CACHE_SCOPE": "global"})
    (_, a), (_, b) = _keys(2)
    text = "SHARED 4417"  # fixed text the engine reads; the namespace is new each run
    img = text_image([text])
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{door.port}", timeout=120) as c:
            first = _post(c, a, img)
            assert first.status_code == 202, first.text
            assert _done(c, a, first)["text"] == text
            other = _post(c, b, img)  # what the global scope reveals: B learns A sent this image
            assert other.status_code == 200 and other.json()["cache_hit"] is True, other.text
            assert other.json()["result"]["text"] == text
    finally:
        pipeline.stop(door)


@pytest.fixture(scope="module")
def scoped(stack_env, tmp_path_factory):
    """A pipeline of its own with ``OCRSTREAM_CACHE_SCOPE=key`` for every stage, and a keyed door."""
    with namespaced_pipeline(tmp_path_factory.mktemp("cache-scope-logs"), {"OCRSTREAM_CACHE_SCOPE": "key"},
                             partitions=2) as p:
        door = p.start(API, extra_env=KEYED)  # the pipeline's env already scopes by key
        p.url = f"http://127.0.0.1:{door.port}"
        yield p


def test_with_the_key_scope_another_keys_image_is_computed_again_in_its_own_scope(scoped):
    p = scoped
    (ida, a), (idb, b) = _keys(2)
    text = "TENANT 5283"
    img = text_image([text])
    with httpx.Client(base_url=p.url, timeout=120) as c:
        first = _post(c, a, img)
        assert first.status_code == 202, first.text
        doc_a = _done(c, a, first)
        assert doc_a["text"] == text and not doc_a["cache_hit"]
        assert parse_cache_key(doc_a["cache_key"])[1] == f"k{ida}"
        assert _post(c, a, img).status_code == 200  # A's own scope: cached
        calls = p.engine_calls()
        other = _post(c, b, img)  # B learns nothing: a miss, sent to the engine again
        assert other.status_code == 202, other.text
        doc_b = _done(c, b, other)
        assert doc_b["text"] == text and not doc_b["cache_hit"]
        assert p.engine_calls() == calls + 1
        gid, scope, sha = parse_cache_key(doc_b["cache_key"])
        assert (scope, sha) == (f"k{idb}", doc_a["content_sha256"]) and doc_b["result_uri"] != doc_a["result_uri"]
        again = _post(c, b, img)
        assert again.status_code == 200 and again.json()["cache_hit"] is True  # now cached in B's scope

        # a request without a key (the Kafka door) is in the global scope: neither A's nor B's
        [kafka_doc] = asyncio.run(p.run([(img, "scope.png")]))
        assert not kafka_doc.cache_hit and parse_cache_key(kafka_doc.cache_key) == (gid, None, sha)
        assert p.engine_calls() == calls + 2

        # single flight still holds within a scope: two copies of a new image sent together, one inference
        twin = text_image([f"TWIN {uuid.uuid4().hex[:6].upper()}"])
        calls = p.engine_calls()
        pair = [_post(c, b, twin) for _ in range(2)]
        assert [r.status_code for r in pair] == [202, 202], [r.text for r in pair]
        docs = [_done(c, b, r) for r in pair]
        assert docs[0]["cache_key"] == docs[1]["cache_key"] and p.engine_calls() == calls + 1

        # cache purge of the generation removes every scope's entries
        out = subprocess.run([sys.executable, "-m", "services.cli", "cache", "purge", "--generation", gid], cwd=REPO,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr[-2000:]
        # A's and B's entries of the first image, the global one, B's twin
        assert "deleted 4 cache entries of 1 generation" in out.stdout, out.stdout
        assert _post(c, a, img).status_code == 202 and _post(c, b, img).status_code == 202
