"""Ingest settings (env prefix ``OCRSTREAM_``, e.g. ``OCRSTREAM_INGEST_MAX_BATCH``)."""

from pydantic import Field, field_validator

from services.common.cache.keys import CacheKeySettings


class IngestSettings(CacheKeySettings):
    """Settings of the ingest stage."""

    ingest_group_id: str = Field(default="ocrstream-ingest", description="consumer group of the ingest stage")
    ingest_max_batch: int = Field(default=32, ge=1, description="records per batch")
    ingest_max_wait_ms: int = Field(
        default=0, ge=0,
        description="longest wait for a batch to fill, ms; 0 = take what has arrived (a backlog still makes full batches)")
    ingest_concurrency: int = Field(default=8, ge=1, description="submissions processed concurrently")
    split_documents: bool = Field(
        default=True, description="split a PDF or multi-page TIFF into one request per page (docs/documents.md); "
        "false: one request for all its pages (at most limits.max_pages)")
    split_batch_pages: int = Field(
        default=4, ge=1, description="pages rendered per decoder call while splitting: the most rendered pages "
        "ingest holds at once per document")
    s3_allowed_prefixes: list[str] | None = Field(
        default=None,
        description="where a submission's s3:// image_uri may point: JSON list of \"bucket/prefix\" entries, each a "
                    "literal prefix (\"bucket/\" = the whole bucket; [] = no s3:// references); unset = "
                    "[\"<s3.bucket>/<s3.upload_prefix>\"] (ocrstream/uploads/); any other is image_uri_not_allowed, "
                    "unread")

    @field_validator("s3_allowed_prefixes")
    @classmethod
    def _bucket_and_prefix(cls, entries: list[str] | None) -> list[str] | None:
        for entry in entries or []:
            bucket, slash, _ = entry.partition("/")
            if not bucket or not slash or entry.startswith("s3://"):
                raise ValueError(f"{entry!r}: each entry is \"bucket/prefix\" (no s3://; \"bucket/\" for a "
                                 "whole bucket)")
        return entries

    def allowed_prefixes(self) -> list[str]:
        """The effective allow-list of ``s3://`` references: :attr:`s3_allowed_prefixes`, or
        ``["<bucket>/<upload_prefix>"]`` when unset."""
        if self.s3_allowed_prefixes is not None:
            return list(self.s3_allowed_prefixes)
        return [f"{self.s3.bucket}/{self.s3.upload_prefix}"]
