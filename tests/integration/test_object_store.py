"""The object store against the local S3 server: content-addressed puts and the known-keys memory."""

from __future__ import annotations

import asyncio
import hashlib
import os

from services.common.s3 import ObjectStore
from services.common.settings import S3Settings


def _key(tag: str) -> str:
    sha = hashlib.sha256(f"{tag}-{os.getpid()}-{os.urandom(8).hex()}".encode()).hexdigest()
    return f"images/{sha[:2]}/{sha}"


def test_put_if_absent_writes_once_then_remembers_the_key(stack_env):
    async def go():
        store = ObjectStore(S3Settings())
        key = _key("known")
        assert await store.put_if_absent(key, b"first") is True
        assert await store.get(key) == b"first"
        # same key again: not written (and, remembered, S3 is not even asked)
        await store.delete(key)
        assert await store.put_if_absent(key, b"second") is False
        assert not await store.exists(key)  # proof that no HEAD/PUT was made for the repeat

        # a fresh process (empty memory) asks S3 and finds the key missing: writes it
        other = ObjectStore(S3Settings())
        assert await other.put_if_absent(key, b"third") is True
        assert await other.get(key) == b"third"
        assert await other.put_if_absent(key, b"fourth") is False
        assert await other.get(key) == b"third"
        await other.delete(key)

    asyncio.run(go())


def test_known_keys_zero_always_asks_s3(stack_env):
    async def go():
        store = ObjectStore(S3Settings(known_keys=0))
        key = _key("unknown")
        assert await store.put_if_absent(key, b"first") is True
        assert await store.put_if_absent(key, b"again") is False  # present: HEAD says so
        await store.delete(key)
        assert await store.put_if_absent(key, b"second") is True  # gone: written again
        assert await store.get(key) == b"second"
        await store.delete(key)

    asyncio.run(go())
