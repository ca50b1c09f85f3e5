"""Kafka topic names used between the stages, and who produces and consumes each
(:data:`TOPOLOGY`, drawn as a table in docs/architecture.md by :func:`topology_markdown`)."""

from dataclasses import dataclass

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
    """Results from infer, cache hits from dedup and the HTTP door, rejections from ingest and the
    runner's DLQ path (keys: :data:`TOPOLOGY`). Read by sink."""
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
    downstream systems and the webhooks stage (a job's ``webhook_url``)."""

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


@dataclass(frozen=True)
class TopicUse:
    """One topic's place in the pipeline.

    Attributes:
        field: The :class:`Topics` field naming the topic (``OCRSTREAM_TOPICS__<FIELD>``).
        key: What its records are keyed by (the partitioning key).
        producers: Who writes it: a stage folder under ``services/`` (``api`` is the HTTP door,
            ``cli`` the ``ocrstream`` command, ``common`` the runner's DLQ path and the completion
            watcher that the door and the CLI share), or ``upstream`` (systems outside ocrstream).
        consumers: Who reads it, named the same way, or ``downstream`` / ``operators``.
    """

    field: str
    key: str
    producers: tuple[str, ...]
    consumers: tuple[str, ...]


#: Every topic, in flow order: its key, producers and consumers. tests/unit/test_topology.py checks
#: it against each handler's ``consumes()`` and the topics each stage's code names.
TOPOLOGY: tuple[TopicUse, ...] = (
    TopicUse("submit", "request id", ("upstream", "api", "cli"), ("ingest",)),
    TopicUse("requests", "content SHA-256", ("ingest", "api", "sink"), ("dedup",)),
    TopicUse("infer_interactive", "content SHA-256", ("dedup",), ("infer",)),
    TopicUse("infer", "content SHA-256", ("dedup",), ("infer",)),
    TopicUse("results", "content SHA-256 (infer, dedup, api cache hits); request id (ingest, common)",
             ("infer", "dedup", "ingest", "api", "common"), ("sink",)),
    TopicUse("completed", "request id", ("sink",), ("jobs", "webhooks", "api", "common", "downstream")),
    TopicUse("dlq", "request id, else topic-partition-offset", ("common", "jobs", "webhooks"), ("operators",)),
    TopicUse("dedup_changelog", "a holder, waiter or settled record of a cache key", ("dedup",), ("dedup",)),
    TopicUse("jobs", "job id", ("upstream", "api", "cli"), ("jobs",)),
    TopicUse("job_completed", "job id", ("jobs",), ("webhooks", "downstream")),
)


def topology_markdown(topics: Topics | None = None) -> str:
    """The :data:`TOPOLOGY` table as Markdown (one row a topic), with default topic names."""
    t = topics or Topics()
    rows = ["| Topic | Key | Producers | Consumers |", "|---|---|---|---|"]
    for use in TOPOLOGY:
        rows.append(f"| `{getattr(t, use.field)}` | {use.key} | {', '.join(use.producers)} | "
                    f"{', '.join(use.consumers)} |")
    return "\n".join(rows) + "\n"
