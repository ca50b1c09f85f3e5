"""Submitting images as an upstream producer and collecting their completions."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace

from schemas.errors import ErrorCode
from schemas.events import SubmitEvent
from schemas.lanes import Priority
from schemas.jobs import JobEvent
from schemas.tasks import TaskParams
from services.common.errors import OcrError
from services.common.codec import dumps

from services.common.kafka import make_producer
from services.common.s3 import ObjectStore
from services.common.settings import CommonSettings
from services.common.telemetry import Telemetry

@dataclass(frozen=True)
class Submission:
    """One submitted file: its path and the request id it was given."""

    path: Path
    request_id: str


def collect_files(paths: list[Path]) -> list[Path]:
    """Files named directly, plus every regular file found under named folders (each folder's
    sorted by path).

    A folder's files are taken whatever their names: formats are recognised from the bytes, so
    a ``.heic``-named JPEG is read and a file that is no image ends with its own
    ``unsupported_format`` result like any other. Names starting with ``.`` (hidden files and
    folders: ``.DS_Store``, ``.git``) are skipped. Symbolic links to files are followed (the
    file they point to is submitted under the link's name); links to folders are not entered
    (no loops, nothing outside the folder by surprise); broken links, FIFOs and devices are
    skipped.

    Raises:
        FileNotFoundError: a named path does not exist.
    """
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out.extend(_folder_files(p))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return out


def _folder_files(folder: Path) -> list[Path]:
    """Every regular file under ``folder`` (:func:`collect_files`' rules), sorted."""
    found = []
    for at, dirs, names in os.walk(folder, followlinks=False):  # links to folders are listed, not entered
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(Path(at) / n for n in names if not n.startswith(".") and (Path(at) / n).is_file())
    return sorted(found)


def _trace_headers(request_id: str) -> list[tuple[str, bytes]] | None:
    """``traceparent`` of a new ``ocr.request`` root span when this process has a tracer
    provider configured; None otherwise (ingest then starts the request's trace)."""
    with trace.get_tracer("ocrstream.cli").start_as_current_span(
        "ocr.request", kind=trace.SpanKind.PRODUCER, attributes={"ocrstream.request_id": request_id}
    ):
        return Telemetry.inject() or None


class Submitter:
    """Publishes files to ``ocr.submit``: small ones inline, larger ones through S3 (claim check)
    under ``S3Settings.upload_prefix`` (``uploads/<sha256>``), the prefix ingest reads references
    from by default; a file over ``limits.max_image_bytes`` is refused before anything is sent or
    uploaded (:meth:`check_size`)."""

    def __init__(self, settings: CommonSettings):
        self.s = settings
        self.producer = make_producer(settings.kafka, client_id="ocrstream-cli")
        self.store = ObjectStore(settings.s3)

    async def start(self) -> None:
        """Connect the producer."""
        await self.producer.start()

    async def stop(self) -> None:
        """Flush and disconnect."""
        await self.producer.stop()

    def check_size(self, size: int, name: str | None = None) -> None:
        """Refuse an image of ``size`` bytes that ingest would refuse (``limits.max_image_bytes``).

        Raises:
            OcrError: ``input_too_large``, naming the file, its size and the limit.
        """
        limit = self.s.limits.max_image_bytes
        if size > limit:
            raise OcrError(ErrorCode.INPUT_TOO_LARGE, f"{name or 'the image'} is {size} bytes, over the limit of "
                           f"{limit} (OCRSTREAM_LIMITS__MAX_IMAGE_BYTES): not submitted, nothing uploaded")

    async def _event(self, data: bytes, filename: str | None, task: str, source: str, rid: str,
                     task_params: TaskParams | None = None, job_id: str | None = None,
                     priority: Priority | None = None) -> SubmitEvent:
        self.check_size(len(data), filename)
        if len(data) <= self.s.limits.inline_max_bytes:
            return SubmitEvent(request_id=rid, image_b64=base64.b64encode(data).decode(), filename=filename,
                               task=task, task_params=task_params, source=source, job_id=job_id, priority=priority)
        # written again even when present: a rewrite restarts the object's time under the upload
        # prefix's lifecycle rule (S3Settings.upload_expiry_days), so it is not expired before ingest reads it
        key = f"{self.s.s3.upload_prefix}{hashlib.sha256(data).hexdigest()}"
        await self.store.put(key, data)
        return SubmitEvent(request_id=rid, image_uri=self.store.uri(key), filename=filename, task=task,
                           task_params=task_params, source=source, job_id=job_id, priority=priority)

    async def submit_bytes(self, data: bytes, *, filename: str | None, task: str = "ocr", source: str = "cli",
                           request_id: str | None = None, task_params: TaskParams | None = None) -> str:
        """Publish one image and wait for the broker's ack; returns its request id (a new UUID unless given).
        ``task_params``: the task's parameters (``extract``'s fields, ``translate``'s target
        language), sent as given: ingest checks them.

        Raises:
            OcrError: ``input_too_large`` (:meth:`check_size`): nothing sent or uploaded.
        """
        rid = request_id or uuid.uuid4().hex
        ev = await self._event(data, filename, task, source, rid, task_params)
        await self.producer.send_and_wait(self.s.topics.submit, dumps(ev), key=rid.encode(), headers=_trace_headers(rid))
        return rid

    async def submit_many(self, items: list[tuple[bytes, str | None]], task: str = "ocr", source: str = "cli",
                          task_params: TaskParams | None = None, job_id: str | None = None,
                          priority: Priority | None = None) -> list[str]:
        """Publish ``(bytes, filename)`` items without waiting for each ack in turn (all acked on return),
        each with ``task`` and its parameters ``task_params`` (and ``job_id``: the job they join;
        ``priority``: their lane, None = ingest's default: :func:`schemas.events.request_priority`).

        Returns:
            The request ids, in order.

        Raises:
            OcrError: ``input_too_large`` for an item over the byte limit: checked for every item
                before any is sent or uploaded.
        """
        for data, filename in items:
            self.check_size(len(data), filename)
        ids, acks = [], []
        for data, filename in items:
            rid = uuid.uuid4().hex
            ev = await self._event(data, filename, task, source, rid, task_params, job_id, priority)
            acks.append(await self.producer.send(self.s.topics.submit, dumps(ev), key=rid.encode(),
                                                 headers=_trace_headers(rid)))
            ids.append(rid)
        await asyncio.gather(*acks)
        return ids

    async def submit_files(self, files: list[Path], task: str = "ocr", source: str = "cli",
                           task_params: TaskParams | None = None, job_id: str | None = None,
                           priority: Priority | None = None) -> list[Submission]:
        """Publish every file (read one at a time), in job ``job_id`` when given, in lane
        ``priority`` (None: ingest's default); returns one :class:`Submission` each."""
        items = [(await asyncio.to_thread(f.read_bytes), f.name) for f in files]
        ids = await self.submit_many(items, task=task, source=source, task_params=task_params, job_id=job_id,
                                     priority=priority)
        return [Submission(f, rid) for f, rid in zip(files, ids)]

    async def job_event(self, event: JobEvent) -> None:
        """Publish a job control event on ``ocr.jobs`` (keyed by its job id) and wait for the ack."""
        await self.producer.send_and_wait(self.s.topics.jobs, dumps(event), key=event.job_id.encode())
