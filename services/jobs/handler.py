"""Jobs logic: each job's final requests counted once in MariaDB; one completion event per job."""

from __future__ import annotations

import logging

from pydantic import BaseModel

from schemas.errors import ErrorCode
from schemas.events import CompletedEvent, ResultDocument
from schemas.jobs import JobCompletedEvent, JobEvent, job_completion_event_id
from services.common.db import Database
from services.common.dlq import poison_messages
from services.common.errors import OcrError
from services.common.codec import dumps
from services.common.handler import Handler, Outgoing, Record
from services.common.jobs.report import write_job_report
from services.common.jobs.store import JobStore, is_page
from services.common.s3 import ObjectStore
from services.jobs.settings import JobsSettings

log = logging.getLogger(__name__)


class JobsHandler(Handler):
    """Per batch of ``ocr.jobs`` and ``ocr.completed`` records:

    1. the control events (create, close) and the final requests that carry a ``job_id`` (not
       the pages of a document: jobs count documents) are written to MariaDB in one
       transaction; a request already counted in its job is not counted again;
    2. for every job the batch touched that is closed and has as many final requests as its
       close event expects, and has no completion stored yet: its report is written to S3
       (:func:`~services.common.jobs.report.write_job_report`), then its
       ``ocr.job_completed.v1`` event, built from MariaDB state only, is stored in its ``jobs``
       row;
    3. every touched job whose stored completion is not marked sent is produced on
       ``ocr.job-completed`` (the stored bytes), and marked sent once Kafka acknowledged it
       (:meth:`after_produce`), before the batch's offsets are committed.

    A crash anywhere replays the batch: step 1 changes nothing, step 2 finds the stored event (or
    builds the same one from the same rows), step 3 re-sends the identical bytes. So a job's
    completion is produced once in the normal case and byte-identical when repeated (two jobs
    processes touching the same job in the same instant may both send it; consumers deduplicate
    on ``event_id``).
    """

    def __init__(self, settings: JobsSettings, store: ObjectStore, db: Database, jobs: JobStore | None = None,
                 report=write_job_report):
        """Args:
            settings: The stage's settings (topics).
            store, db: S3 (the reports) and MariaDB (the jobs tables).
            jobs: The jobs tables (default: a :class:`JobStore` over ``db``).
            report: ``async (db, store, job) -> (JobSummary, part -> URI)``, the report writer
                (default :func:`~services.common.jobs.report.write_job_report`).
        """
        self.s = settings
        self.store = store
        self.db = db
        self.jobs = jobs or JobStore(db)
        self._report = report
        self._sending: list[str] = []

    def consumes(self) -> dict[str, type[BaseModel]]:
        """``ocr.jobs`` -> :class:`JobEvent`, ``ocr.completed`` -> :class:`CompletedEvent`."""
        return {self.s.topics.jobs: JobEvent, self.s.topics.completed: CompletedEvent}

    async def handle(self, records: list[Record]) -> list[Outgoing]:
        """See :meth:`Handler.handle` and the class docstring."""
        events: list[JobEvent] = []
        docs: list[ResultDocument] = []
        for rec in records:
            with rec.traced():
                if isinstance(rec.value, JobEvent):
                    events.append(rec.value)
                elif isinstance(rec.value, CompletedEvent):
                    doc = rec.value.result
                    if doc.job_id is not None and not is_page(doc):
                        docs.append(doc)
        touched = sorted({e.job_id for e in events} | {d.job_id for d in docs})
        if not touched:
            return []
        await self.jobs.record(events, docs)
        out, self._sending = [], []
        for job_id in touched:
            raw = await self._completion(job_id)
            if raw is not None:
                out.append(Outgoing(self.s.topics.job_completed, job_id, raw))
                self._sending.append(job_id)
        return out

    async def _completion(self, job_id: str) -> bytes | None:
        """The job's completion event to produce now (stored first when it is new), or None."""
        job = await self.jobs.job(job_id)
        if job is None or job.expected is None or job.completion_sent:
            return None
        if job.completion_json is None:
            if await self.jobs.final_count(job_id) < job.expected:
                return None
            summary, uris = await self._report(self.db, self.store, job)
            progress = await self.jobs.progress(job_id)
            done_at = progress.last_completed_at_ms or job.closed_at_ms or 0
            progress = progress.model_copy(update={"state": "completed", "completed_at_ms": done_at, "eta_s": 0.0})
            ev = JobCompletedEvent(event_id=job_completion_event_id(job_id), job_id=job_id, name=job.name,
                                   webhook_url=job.webhook_url, api_key_id=job.api_key_id, progress=progress,
                                   summary=summary, report=uris, completed_at_ms=done_at)
            stored = await self.jobs.store_completion(job_id, dumps(ev), done_at)
            log.info("job %s completed: %d requests (%s), report %s", job_id, progress.done,
                     ", ".join(f"{k} {v}" for k, v in summary.by_status.items()), uris.get("csv"))
            return stored.encode()
        return job.completion_json.encode()

    async def after_produce(self) -> None:
        """Mark the completions just acknowledged as sent (see :meth:`Handler.after_produce`)."""
        if self._sending:
            await self.jobs.mark_sent(self._sending)
            self._sending = []

    async def undecodable(self, record: Record, exc: Exception) -> list[Outgoing]:
        """A job event or completion that does not parse: to the DLQ at once (``invalid_request``),
        not retried (the same bytes fail the same way); it counts in no job."""
        return self.poison(record, OcrError(ErrorCode.INVALID_REQUEST, f"jobs: not a valid event: {exc}"[:1000]), 1)

    def poison(self, record: Record, exc: BaseException, attempts: int) -> list[Outgoing]:
        """The DLQ event only: a job event or completion that cannot be counted ends no request."""
        return [m for m in poison_messages(stage="jobs", topics=self.s.topics, record=record, exc=exc,
                                           attempts=attempts) if m.topic == self.s.topics.dlq]

    async def dependencies_ok(self) -> bool | None:
        """MariaDB and S3 both answer a ping."""
        try:
            return bool(await self.db.ping()) and bool(await self.store.ping())
        except Exception:  # noqa: BLE001 - not answering is the answer
            return False
