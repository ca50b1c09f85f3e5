"""Sink settings (env prefix ``OCRSTREAM_``)."""

from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from services.common.cache.keys import CacheKeySettings


class SinkSettings(CacheKeySettings):
    """Settings of the sink stage."""

    sink_group_id: str = Field(default="ocrstream-sink", description="consumer group of the sink stage")
    sink_max_batch: int = Field(default=64, ge=1, description="records per batch")
    sink_max_wait_ms: int = Field(
        default=0, ge=0,
        description="longest wait for a batch to fill, ms; 0 = take what has arrived (a backlog still makes full batches)")
    cache_ttl_s: int = Field(default=86_400, ge=1, description="cache entry TTL, s (static documents: ~24 h); at least 1")
    cache_ttl_by_source: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: {"screenshot": 600},
        description='TTL overrides per request source, s, JSON, e.g. {"screenshot": 600}',
    )
    cache_ttl_by_task: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict, description="TTL overrides per task, s, JSON")
    output_lru_entries: int = Field(
        default=16_384, ge=0,
        description="result documents kept in memory for cache hits (a hit outside it reads S3, ~4 ms: bench/cache_bench.py)",
    )
    output_lru_bytes: int = Field(
        default=8 * 1024 * 1024, ge=0,
        description="bound on their JSON size, bytes (in memory ~8x: services/common/cache/outputs.py); 0 = entries only",
    )

    max_page_error_rate: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="a document whose failed pages / pages is above this ends error (document_pages_failed); "
                    "at or below it, with a failed page, partial; 0 = no rate: any failed page makes it partial "
                    "(every page failed: error). docs/documents.md")

    @field_validator("cache_ttl_by_task")
    @classmethod
    def _ttl_tasks_listed(cls, ttls: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        tasks = info.data.get("tasks")  # validated before (a CacheKeySettings field); absent if it failed
        unknown = sorted(set(ttls) - set(tasks)) if tasks else []
        if unknown:
            raise ValueError(f"names {', '.join(map(repr, unknown))}, not among the tasks ({', '.join(tasks)}): "
                             "no request can carry it")
        return ttls

    def ttl_for(self, source: str, task: str) -> int:
        """Cache TTL in seconds: the source's override, else the task's, else ``cache_ttl_s``.

        When both a source and a task override apply, the source's wins, longer or shorter: the
        source says how fast the content itself changes (a screenshot of a live page), the task
        only what is read from it.
        """
        return self.cache_ttl_by_source.get(source, self.cache_ttl_by_task.get(task, self.cache_ttl_s))
