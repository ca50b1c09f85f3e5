"""Ingest settings (env prefix ``OCRSTREAM_``, e.g. ``OCRSTREAM_INGEST_MAX_BATCH``)."""

from services.common.settings import CommonSettings


class IngestSettings(CommonSettings):
    """Settings of the ingest stage."""

    ingest_group_id: str = "ocrstream-ingest"
    ingest_max_batch: int = 32
    ingest_max_wait_ms: int = 5
    ingest_concurrency: int = 8
