"""Kafka topic names used between the stages."""

from pydantic import BaseModel, ConfigDict


class Topics(BaseModel):
    """Topic names; every stage reads them from its settings (env ``OCRSTREAM_TOPICS__<FIELD>``).

    Flow: submit -> requests -> infer-interactive or infer -> results -> completed; any stage may
    write to dlq.
    """

    model_config = ConfigDict(frozen=True)

    submit: str = "ocr.submit"
    """Upstream input: images inline (small) or as ``s3://`` URIs. Read by ingest."""
    requests: str = "ocr.requests"
    """Accepted requests, image in S3, and the settlements of computed cache keys (from the sink once
    a result is durable), both keyed by content SHA-256: one log per key (``RequestLogEvent``). Read
    by dedup."""
    infer: str = "ocr.infer"
    """Cache misses of the bulk lane (a job's requests, a document's pages), one per cache key in flight
    (the holder), keyed by content SHA-256. Read by infer."""
    infer_interactive: str = "ocr.infer-interactive"
    """Cache misses of the interactive lane (a single request at either door), as ``infer``. Read by infer
    before ``infer``, with slots of its own (docs/delivery.md, "Two lanes")."""
    results: str = "ocr.results"
    """Results from infer, cache hits from dedup and rejections from ingest. Read by sink."""
    completed: str = "ocr.completed"
    """One completion per request, keyed by request id. For downstream systems."""
    dlq: str = "ocr.dlq"
    """Messages no stage could process after bounded attempts, with the reason."""
    dedup_changelog: str = "ocr.dedup-changelog"
    """Dedup's keyed state (keys in flight, their waiting copies, keys settled a moment ago):
    compacted, partition p holds the state of ``requests`` partition p. Written and read by dedup only."""

    jobs: str = "ocr.jobs"
    """Job control events (``ocr.job.v1``: create, close), keyed by job id. Read by the jobs stage."""
    job_completed: str = "ocr.job-completed"
    """One completion per job (``ocr.job_completed.v1``), keyed by job id, from the jobs stage. For
    downstream systems and the HTTP door's job webhooks."""

    def all(self) -> list[str]:
        """Every topic name, in flow order."""
        return [self.submit, self.requests, self.infer_interactive, self.infer, self.results, self.completed, self.dlq,
                self.dedup_changelog, self.jobs, self.job_completed]

    def compacted(self) -> list[str]:
        """The topics ``ocrstream init`` creates with ``cleanup.policy=compact`` (state changelogs)."""
        return [self.dedup_changelog]

    def copartitioned(self) -> list[str]:
        """Topics that must have the same partition count (dedup's input and its changelog)."""
        return [self.requests, self.dedup_changelog]
