"""Ingest settings (env prefix ``OCRSTREAM_``, e.g. ``OCRSTREAM_INGEST_MAX_BATCH``)."""

from pydantic import Field

from services.common.settings import CommonSettings


class IngestSettings(CommonSettings):
    """Settings of the ingest stage."""

    ingest_group_id: str = Field(default="ocrstream-ingest", description="consumer group of the ingest stage")
    ingest_max_batch: int = Field(default=32, ge=1, description="records per batch")
    ingest_max_wait_ms: int = Field(
        default=0, ge=0,
        description="longest wait for a batch to fill, ms; 0 = take what has arrived (a backlog still makes full batches)")
    ingest_concurrency: int = Field(default=8, ge=1, description="submissions processed concurrently")
