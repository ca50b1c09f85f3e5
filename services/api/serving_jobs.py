"""Jobs over HTTP: create and close a job (events on ``ocr.jobs``), read its progress, follow it as
server-sent events and download its report, all read from MariaDB (``docs/jobs.md``).

The jobs stage owns the jobs tables; the door only publishes control events and reads. With API
keys on, a job created by a key is visible to that key only, and only that key may add requests
to it or close it (another key gets 404 ``not_found``, as for requests, after the same wait as for
a job that does not exist: :func:`job_for_key`); a job without an owner (created on Kafka, or
with keys off) stays open to every key.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from schemas.errors import ErrorCode, HttpErrorCode
from schemas.jobs import JobEvent, JobProgress
from schemas.tasks import TaskError, TaskParams, UnsupportedTask
from services.api.clients import Clients
from services.api.errors import ApiError
from services.api.sse import EventStream, KEEPALIVE, encode
from services.api.protocol import JobClose, JobCreate, JobCreated
from services.api.serving_keys import Principal
from services.api.serving_webhooks import validate_callback_url
from services.common.codec import dumps
from services.common.jobs.report import write_rows
from services.common.jobs.store import REPORT_SQL, JobRow, JobStore

#: Seconds between two reads of a followed job's progress (``GET /v1/jobs/{id}/events``).
EVENTS_POLL_S = 0.5
#: Seconds between two reads of a job a keyed caller waits for (:func:`job_for_key`).
JOB_POLL_S = 0.1
_MEDIA = {"csv": "text/csv", "jsonl": "application/x-ndjson"}


async def _job_row(jobs: JobStore, job_id: str) -> JobRow | None:
    try:
        return await jobs.job(job_id)
    except Exception as exc:  # noqa: BLE001 - MariaDB down
        raise ApiError(HttpErrorCode.UNAVAILABLE, f"MariaDB did not answer: {exc!r}") from None


async def job_for_key(jobs: JobStore, job_id: str, principal: Principal, wait_s: float) -> JobRow:
    """The job a keyed caller (``principal.key_id`` set) adds a request to or closes: its row, once
    the jobs stage has recorded its create event (a job just created over HTTP is on its way:
    waited for, polled every :data:`JOB_POLL_S`), when it is the caller's or has no owner.

    Args:
        wait_s: Longest wait for the job to be recorded as the caller's, seconds
            (``OCRSTREAM_HTTP_JOB_WAIT_S``). Another key's job is answered after the same wait
            as an unknown one, so the answer does not tell whether it exists.

    Raises:
        ApiError: 404 ``not_found`` (no such job after ``wait_s``, or another key's), 503
            ``unavailable`` (MariaDB did not answer).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        job = await _job_row(jobs, job_id)
        # created (a create event recorded), not only seen on a completion: its owner is known
        if job is not None and job.created_at_ms is not None and job.api_key_id in (None, principal.key_id):
            return job
        if loop.time() >= deadline:
            raise ApiError(HttpErrorCode.NOT_FOUND, f"no job {job_id!r} of this API key (POST /v1/jobs creates one)")
        await asyncio.sleep(min(JOB_POLL_S, max(0.0, deadline - loop.time())))


async def check_job_of(clients: Clients, job_id: str | None, principal: Principal) -> None:
    """A submission's ``job_id`` checked against its API key (:func:`job_for_key`); nothing to
    check without a job or with keys off (anyone may add to any job then, as before).

    Raises:
        ApiError: as :func:`job_for_key`.
    """
    if job_id is not None and principal.key_id is not None:
        await job_for_key(JobStore(clients.db), job_id, principal, clients.s.http_job_wait_s)


def job_task_params(settings, body: JobCreate) -> TaskParams | None:
    """A job's task parameters from ``POST /v1/jobs``' body (``fields``, ``to`` as ``target_lang``),
    checked as a submission's are (:meth:`CacheKeySettings.check_task`); None without a task.

    Raises:
        ApiError: 400 ``invalid_request``: ``fields`` or ``to`` without a ``task`` (not dropped:
            the caller expects them used), or the task or a parameter refused (the reason); 422
            ``unsupported_task``: a task the deployment's engine cannot do.
    """
    if body.fields is not None and not body.task:
        raise ApiError(ErrorCode.INVALID_REQUEST, "fields: a job's fields need its task (task=extract)")
    if body.to is not None and not body.task:
        raise ApiError(ErrorCode.INVALID_REQUEST, "to: a job's target language needs its task (task=translate)")
    if not body.task:
        return None
    given = {k: v for k, v in (("fields", body.fields), ("target_lang", body.to)) if v is not None}
    try:
        return settings.check_task(body.task, given or None, engine=True)
    except TaskError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    except UnsupportedTask as exc:
        raise ApiError(ErrorCode.UNSUPPORTED_TASK, str(exc)) from None


class JobService:
    """The job routes' logic over the door's clients (Kafka producer, MariaDB)."""

    def __init__(self, clients: Clients):
        self.c = clients
        self.jobs = JobStore(clients.db)

    def links(self, job_id: str) -> dict[str, str]:
        """The job's routes."""
        base = f"/v1/jobs/{job_id}"
        return {"self": base, "events": f"{base}/events", "report": f"{base}/report?format=csv", "close": f"{base}/close"}

    async def _publish(self, ev: JobEvent) -> None:
        try:
            await self.c.producer.send_and_wait(self.c.s.topics.jobs, dumps(ev), key=ev.job_id.encode())
        except Exception as exc:  # noqa: BLE001 - not acknowledged: not done
            raise ApiError(HttpErrorCode.UNAVAILABLE, f"Kafka did not acknowledge the job event: {exc!r}") from None

    async def create(self, body: JobCreate, principal: Principal) -> JobCreated:
        """Publish the job's create event; returns its id and links.

        Raises:
            ApiError: 400 ``invalid_request`` (a task the deployment does not list, bad fields,
                ``fields`` without a ``task``), 503 ``unavailable`` (Kafka did not acknowledge).
        """
        params = job_task_params(self.c.s, body)
        if body.webhook_url:  # URL checks, webhooks enabled here, a secret to sign with: as for callback_url
            await validate_callback_url(body.webhook_url, self.c.s, principal.key_id,
                                        enabled=self.c.s.webhook_enabled)
        job_id = body.job_id or uuid.uuid4().hex
        await self._publish(JobEvent(action="create", job_id=job_id, name=body.name, task=body.task, task_params=params,
                                     webhook_url=body.webhook_url, api_key_id=principal.key_id))
        return JobCreated(job_id=job_id, links=self.links(job_id))

    async def close(self, job_id: str, body: JobClose, principal: Principal) -> JobCreated:
        """Publish the job's close event (the first close counts: closing a closed job again
        changes nothing and is answered as the first was).

        Raises:
            ApiError: 404 ``not_found`` (another key's job; with keys on also a job not recorded
                within ``OCRSTREAM_HTTP_JOB_WAIT_S``: :func:`job_for_key`), 409
                ``job_expected_too_small`` (an open job with more final requests than
                ``expected``), 503 ``unavailable``.
        """
        if principal.key_id is not None:
            job = await job_for_key(self.jobs, job_id, principal, self.c.s.http_job_wait_s)
        else:
            job = await self._owned(job_id, principal, missing_ok=True)
        if job is not None and job.expected is None:
            try:
                final = await self.jobs.final_count(job_id)
            except Exception as exc:  # noqa: BLE001 - MariaDB down
                raise ApiError(HttpErrorCode.UNAVAILABLE, f"MariaDB did not answer: {exc!r}") from None
            if final > body.expected:
                raise ApiError(HttpErrorCode.JOB_EXPECTED_TOO_SMALL,
                               f"job {job_id!r} already has {final} final requests, more than expected "
                               f"{body.expected}: close it with at least {final}")
        await self._publish(JobEvent(action="close", job_id=job_id, expected=body.expected))
        return JobCreated(job_id=job_id, links=self.links(job_id))

    async def _owned(self, job_id: str, principal: Principal, missing_ok: bool = False) -> JobRow | None:
        """The job's row, checked against the caller's key.

        Raises:
            ApiError: 404 ``not_found``: no such job (unless ``missing_ok``: the stage may not
                have recorded the create event yet), or another key's.
        """
        job = await _job_row(self.jobs, job_id)
        if job is None and missing_ok:
            return None
        if job is None or (principal.key_id is not None and job.api_key_id not in (None, principal.key_id)):
            raise ApiError(HttpErrorCode.NOT_FOUND, f"no job {job_id!r}")
        return job

    async def _visible(self, job_id: str, principal: Principal) -> bool:
        """Whether the job is known and the caller may see it (:meth:`_owned`).

        Raises:
            ApiError: 503 ``unavailable`` (MariaDB did not answer).
        """
        try:
            return await self._owned(job_id, principal) is not None
        except ApiError as exc:
            if exc.code != HttpErrorCode.NOT_FOUND.value:
                raise
            return False

    async def progress(self, job_id: str, principal: Principal) -> JobProgress:
        """The job's progress (404 when unknown)."""
        await self._owned(job_id, principal)
        prog = await self.jobs.progress(job_id)
        assert prog is not None  # the row was just read
        return prog

    async def events(self, job_id: str, principal: Principal, max_s: float) -> EventStream:
        """Server-sent events: ``progress`` (the counts, JSON) now and whenever they change, then
        ``completed`` (the final counts) and the stream ends; at most ``max_s`` seconds. A job
        just created whose create event the jobs stage has not recorded yet is waited for
        (keep-alives) for ``OCRSTREAM_HTTP_JOB_WAIT_S`` at most; a job still unknown then ends the
        stream with an ``error`` event (``not_found``). Another key's job is streamed exactly as
        an unknown one (the same wait, the same event), so the answer does not tell it exists."""
        await self._visible(job_id, principal)  # MariaDB down: 503 before the stream starts

        async def gen() -> AsyncIterator[bytes]:
            last, loop = None, asyncio.get_running_loop()
            deadline = loop.time() + max_s
            unknown_until = loop.time() + self.c.s.http_job_wait_s
            while loop.time() < deadline and not self.c.closing.is_set():
                prog = await self.jobs.progress(job_id)
                if prog is not None and last is None and not await self._visible(job_id, principal):
                    prog = None  # first seen, and another key's: as if unknown
                if prog is None and loop.time() >= unknown_until:
                    yield encode("error", {"code": "not_found", "message": f"no job {job_id}"})
                    return
                if prog is not None and prog.state == "completed":
                    yield encode("completed", prog.model_dump(mode="json"))
                    return
                if prog is not None and prog != last:
                    yield encode("progress", prog.model_dump(mode="json"))
                    last = prog
                else:
                    yield KEEPALIVE
                await asyncio.sleep(EVENTS_POLL_S)

        return EventStream(gen(), on_close=lambda: None)

    async def report(self, job_id: str, fmt: str, principal: Principal) -> FileResponse:
        """The job's report (``csv`` or ``jsonl``) of the requests final so far, streamed from
        MariaDB into a temporary file (deleted once sent), one row per request."""
        job = await self._owned(job_id, principal)
        tmp = tempfile.NamedTemporaryFile("w", suffix=f".{fmt}", newline="", encoding="utf-8", delete=False)
        with tmp:
            await self.c.db.stream("job_report", REPORT_SQL, (job_id,),
                                   lambda rows: write_rows(rows, job.fields(), {fmt: tmp}))
        return FileResponse(tmp.name, media_type=_MEDIA[fmt], filename=f"{job_id}.{fmt}",
                            background=BackgroundTask(os.unlink, tmp.name))
