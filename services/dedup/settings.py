"""Dedup settings (env prefix ``OCRSTREAM_``)."""

from pydantic import Field

from services.common.settings import CommonSettings


class DedupSettings(CommonSettings):
    """Settings of the dedup stage."""

    dedup_group_id: str = "ocrstream-dedup"
    dedup_max_batch: int = 64
    dedup_max_wait_ms: int = 5
    cache_enabled: bool = Field(default=True, description="False: every request goes to inference")
    lease_ms: int = Field(default=600_000, description="in-flight lease; a holder silent this long is replaced")
    lru_entries: int = Field(default=10_000, description="in-process LRU in front of Redis: entries")
    lru_bytes: int = Field(default=8 * 1024 * 1024, description="in-process LRU in front of Redis: bytes")
