"""Kafka topic names used between the stages."""

from pydantic import BaseModel, ConfigDict


class Topics(BaseModel):
    """Topic names; every stage reads them from its settings (env ``OCRSTREAM_TOPICS__<FIELD>``).

    Flow: submit -> requests -> infer -> results -> completed; any stage may write to dlq.
    """

    model_config = ConfigDict(frozen=True)

    submit: str = "ocr.submit"
    """Upstream input: images inline (small) or as ``s3://`` URIs. Read by ingest."""
    requests: str = "ocr.requests"
    """Accepted requests, image in S3, keyed by content SHA-256. Read by dedup."""
    infer: str = "ocr.infer"
    """Cache misses that hold the in-flight lease, keyed by content SHA-256. Read by infer."""
    results: str = "ocr.results"
    """Results from infer, cache hits from dedup and rejections from ingest. Read by sink."""
    completed: str = "ocr.completed"
    """One completion per request, keyed by request id. For downstream systems."""
    dlq: str = "ocr.dlq"
    """Messages no stage could process after bounded attempts, with the reason."""

    def all(self) -> list[str]:
        """Every topic name, in flow order."""
        return [self.submit, self.requests, self.infer, self.results, self.completed, self.dlq]
