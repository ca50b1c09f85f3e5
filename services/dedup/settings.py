"""Dedup settings (env prefix ``OCRSTREAM_``)."""

from pydantic import Field

from services.common.settings import CommonSettings


class DedupSettings(CommonSettings):
    """Settings of the dedup stage."""

    dedup_group_id: str = Field(default="ocrstream-dedup", description="consumer group of the dedup stage")
    dedup_max_batch: int = Field(default=64, description="records per batch")
    dedup_max_wait_ms: int = Field(default=5, description="longest wait for a batch to fill, ms")
    cache_enabled: bool = Field(default=True, description="False: every request goes to inference")
    lease_ms: int = Field(default=600_000, description="in-flight lease; a holder silent this long is replaced")
    lru_entries: int = Field(default=10_000, description="in-process LRU in front of Redis: entries")
    lru_bytes: int = Field(default=8 * 1024 * 1024, description="in-process LRU in front of Redis: bytes")
    lru_ttl_s: float = Field(default=60.0, description="in-process LRU: entry age limit, s (bounds how long a purge takes to reach dedup)")
