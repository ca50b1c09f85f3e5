"""Job models: the control events on ``ocr.jobs``, a job's progress and its one completion event.

A *job* is a named group of requests with an id (``job_id``, the request id rule of
:mod:`schemas.ids`). Requests join a job by carrying ``job_id`` on their submission
(``ocr.submit`` or ``POST /v1/ocr``); the job is created and closed by :class:`JobEvent` on
``ocr.jobs`` (keyed by job id). The jobs stage (``services/jobs``) counts each job's final
requests in MariaDB and, once a closed job has as many final requests as its close event
expects, emits one :class:`JobCompletedEvent` on ``ocr.job-completed`` (``docs/jobs.md``).

Jobs count requests (documents), not pages: a completion that names a ``page_number`` (a page
of a document) is not a job's request; the document's own completion is.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.ids import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN
from schemas.tasks import TaskParams

JobId = Annotated[str, Field(min_length=1, max_length=REQUEST_ID_MAX_LENGTH, pattern=REQUEST_ID_PATTERN,
                             description="the job's id: 1 to 64 characters of A-Z a-z 0-9 . _ : - (not only dots)")]
"""A job id: the request id rule (:mod:`schemas.ids`)."""

JOB_EXPECTED_MAX = 2**31 - 1
"""The largest request count a job's close may name: MariaDB's ``INT`` (``jobs.expected``). A larger
``expected`` fails validation (a Kafka close event goes to the DLQ as ``invalid_request``; the
HTTP door answers 400), instead of failing the jobs stage's write over and over."""
EPOCH_MS_MAX = 253_402_300_799_999
"""The latest time a job event may carry, epoch ms: 9999-12-31T23:59:59.999Z (a ``BIGINT`` holds it;
later is no real time)."""

JobState = Literal["open", "closed", "completed"]
"""``open``: created (or first seen on a completion), no close yet; ``closed``: the expected count
is known, not all final yet; ``completed``: closed and every expected request final (the
completion event was emitted)."""


def job_completion_event_id(job_id: str) -> str:
    """Deterministic event id of a job's completion (32 hex digits): a replay is identical."""
    return hashlib.sha256(f"job_completed:{job_id}".encode()).hexdigest()[:32]


class JobEvent(BaseModel):
    """A job control event on ``ocr.jobs`` (keyed by ``job_id``), read by the jobs stage.

    ``create`` names the job (``name``, ``task``, ``task_params``, ``webhook_url``; each optional,
    a later ``create`` of the same id changes nothing already set). ``close`` says how many
    requests the job has (``expected``, at most :data:`JOB_EXPECTED_MAX`); the first close
    counts, a replayed or later one is ignored. ``at_ms`` is an epoch time in ms (0 to
    :data:`EPOCH_MS_MAX`). An event outside these bounds does not validate: the jobs stage sends
    it to the DLQ (``invalid_request``) and reads on. Both are idempotent, and either may come before or after the job's completions.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    schema_: Literal["ocr.job.v1"] = Field(default="ocr.job.v1", alias="schema")
    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    action: Literal["create", "close"]
    job_id: JobId
    name: str | None = Field(default=None, max_length=256, description="create: a label for people")
    task: str | None = Field(default=None, max_length=64, description="create: the task its requests run")
    task_params: TaskParams | None = Field(default=None, description="create: the task's parameters (report columns)")
    webhook_url: str | None = Field(default=None, max_length=2048,
                                    description="create: where the HTTP door POSTs the signed job completion")
    api_key_id: str | None = Field(default=None, max_length=64, description="create: the API key that created it")
    expected: int | None = Field(default=None, ge=0, le=JOB_EXPECTED_MAX,
                                 description="close: how many requests the job has (0 to 2**31-1)")
    at_ms: int = Field(default_factory=lambda: int(time.time() * 1000), ge=0, le=EPOCH_MS_MAX,
                       description="when it was published, epoch ms (0 to year 9999)")

    @model_validator(mode="after")
    def _close_counts(self) -> "JobEvent":
        if self.action == "close" and self.expected is None:
            raise ValueError("a close event needs `expected`, the job's request count")
        return self


class JobProgress(BaseModel):
    """A job's progress as MariaDB holds it (``jobs`` and ``job_requests``).

    Attributes:
        total: The expected request count (None while the job is open).
        done: Final requests (ok + error), each request once however often it completed.
        failed_by_code: Error requests by error code.
        pages: Pages of the final requests (a document's page count, 1 for an image).
        lines, chars: Text lines and characters of the ok requests.
        rate_per_s: ``done`` over the time from the job's creation (else its first completion) to
            its last completion, requests/s; None before two points in time exist.
        eta_s: Seconds to the last expected request at ``rate_per_s``; None when unknown, 0 when done.
    """

    model_config = ConfigDict(frozen=True)

    job_id: str
    name: str | None = None
    task: str | None = None
    state: JobState
    total: int | None = None
    done: int = 0
    ok: int = 0
    failed: int = 0
    failed_by_code: dict[str, int] = Field(default_factory=dict)
    cache_hits: int = 0
    pages: int = 0
    lines: int = 0
    chars: int = 0
    created_at_ms: int | None = None
    closed_at_ms: int | None = None
    first_completed_at_ms: int | None = None
    last_completed_at_ms: int | None = None
    completed_at_ms: int | None = None
    rate_per_s: float | None = None
    eta_s: float | None = None


class JobSummary(BaseModel):
    """The totals of a completed job's report (``reports/<job_id>/summary.json``).

    Attributes:
        requests: Rows of the report (every final request of the job).
        by_status: Requests per status (``ok``, ``error``, ``partial``).
        by_error_code: Error requests per code.
        latency_ms: Submit-to-completion time (``timings_ms.total``) percentiles ``p50``/``p95``/``p99``, ms
            (linear interpolation, numpy's default).
        engine_ms: Sum of ``timings_ms.inference`` over the job's requests, ms (cache hits add none).
        cache_hit_rate: Cache hits over requests, 0..1.
    """

    model_config = ConfigDict(frozen=True)

    requests: int
    by_status: dict[str, int]
    by_error_code: dict[str, int]
    latency_ms: dict[str, float]
    engine_ms: float
    cache_hit_rate: float
    pages: int
    lines: int
    chars: int


class JobCompletedEvent(BaseModel):
    """The one completion of a job on ``ocr.job-completed`` (keyed by ``job_id``).

    Built from MariaDB state only and stored in the job's row before it is produced, so a replay
    re-sends the same bytes: ``event_id`` is derived from the job id, ``completed_at_ms`` is the
    job's last request completion. ``report`` names the S3 objects of the summary report:
    ``csv``, ``jsonl``, ``summary`` (``summary.json``) and ``chart`` (PNG).
    """

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    schema_: Literal["ocr.job_completed.v1"] = Field(default="ocr.job_completed.v1", alias="schema")
    event_id: str
    job_id: str
    name: str | None = None
    webhook_url: str | None = None
    api_key_id: str | None = None
    progress: JobProgress
    summary: JobSummary
    report: dict[str, str] = Field(default_factory=dict, description="report part -> s3:// URI")
    completed_at_ms: int
