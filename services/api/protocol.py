"""The HTTP door's protocol: request options and response bodies (pydantic), with the OpenAPI text
that documents them. The routes (:mod:`services.api.router`) take their spec from here; the error
answers of each route are built from the one error table, :data:`schemas.errors.ERRORS`.
"""

from __future__ import annotations

from typing import Literal

import orjson
from pydantic import BaseModel, Field, PrivateAttr, StrictInt, ValidationError, field_validator

from schemas.errors import ERRORS, ErrorCode, HttpErrorCode
from schemas.events import ResultDocument
from schemas.lanes import Priority
from schemas.ids import REQUEST_ID_MAX_LENGTH, REQUEST_ID_PATTERN, is_page_request_id
from schemas.jobs import JOB_EXPECTED_MAX
from schemas.tasks import (TASKS, TaskError, TaskParams, UnsupportedTask, engines_for, parse_fields,
                          unsupported_task_message)
from services.api.errors import ApiError
from services.common.cache.keys import CacheKeySettings

Status = Literal["pending", "ok", "error", "partial"]
#: Most bytes of a submission's ``metadata`` (keys and values together).
METADATA_MAX_BYTES = 16_384

# -- request ------------------------------------------------------------------------------------


class SubmitOptions(BaseModel):
    """Options of one submission (query string for a raw body, form fields for multipart);
    the same constraints as ``SubmitEvent``. The field descriptions are the OpenAPI parameters'
    (:func:`submit_parameters`)."""

    # the rule of both doors (schemas/ids.py): not only dots, "." and ".." are not path segments a client can GET
    request_id: str | None = Field(
        default=None, min_length=1, max_length=REQUEST_ID_MAX_LENGTH, pattern=REQUEST_ID_PATTERN,
        description="your own id for the request: resubmitting it with the same image answers its state "
                    "instead of sending it again; with a different image, 409 `request_id_conflict`")
    task: str = Field(default="ocr", min_length=1, max_length=64,
                      description="what to do with the image (part of the cache key): one of the deployment's tasks "
                                  "(`OCRSTREAM_TASKS`: ocr, doc_parse, table, formula, chart, extract, translate; "
                                  "docs/tasks.md), else 400 `invalid_request`; default `ocr`")
    fields: str | None = Field(
        default=None, max_length=8192,
        description="`task=extract`: the field names to extract, comma-separated (`invoice number,date,total`), "
                    "a JSON list (`[\"invoice number\", \"date\"]`), or the parameter repeated once per field; 1 to "
                    "50 names of at most 100 characters (part of the cache key, in any order), else 400 "
                    "`invalid_request`")
    to: str | None = Field(
        default=None, max_length=16,
        description="`task=translate`: the target language, an ISO 639-1 code (en, zh, ja, ko, fr, de, es, it, pt, "
                    "ru, ar, vi, th; part of the cache key), else 400 `invalid_request`; `target_lang` is the same "
                    "parameter")
    source: str = Field(default="http", min_length=1, max_length=64,
                        description="where the image comes from (picks the cache TTL); default `http`")
    filename: str | None = Field(default=None, max_length=512, description="the image's file name, kept with the result")
    callback_url: str | None = Field(
        default=None, max_length=2048,
        description="webhook URL for the completion (its host must be on the allow-list; refused, 400 "
                    "`invalid_request`, when the server's webhooks are disabled)")
    metadata: dict[str, str] = Field(default_factory=dict,
                                     description="JSON object of strings, kept with the result (16 KiB at most)")
    job_id: str | None = Field(
        default=None, min_length=1, max_length=REQUEST_ID_MAX_LENGTH, pattern=REQUEST_ID_PATTERN,
        description="the job the image joins (`POST /v1/jobs` made it; docs/jobs.md): it counts in the job's "
                    "progress and report")
    priority: Priority | None = Field(
        default=None,
        description="the lane the image is read in: `interactive` (read before bulk work, with engine slots of its "
                    "own) or `bulk`; default `interactive` for one image, `bulk` in a job or a batch (a document's "
                    "pages are always `bulk`; docs/delivery.md)")
    _task_params: TaskParams | None = PrivateAttr(default=None)

    @field_validator("request_id")
    @classmethod
    def _not_a_page_id(cls, v: str | None) -> str | None:
        if v is not None and is_page_request_id(v):  # schemas/ids.py: ocrstream gives a document's pages those
            raise ValueError("has the form of a document page's id (<document id>:p<page>), which ocrstream gives "
                             "the pages it splits; choose an id that does not end in ':p' and digits")
        return v

    @property
    def task_params(self) -> TaskParams | None:
        """The task's parameters, checked and normalised (:meth:`CacheKeySettings.check_task`);
        None for a task without any."""
        return self._task_params

    @classmethod
    def parse(cls, fields: dict[str, str], settings: CacheKeySettings) -> "SubmitOptions":
        """From query/form fields; ``metadata`` is a JSON object of strings; ``task`` must be one
        of ``settings.tasks`` and its parameters valid (``fields``: comma-separated or a JSON list,
        see :func:`field_values`; ``to`` or ``target_lang``), kept normalised in :attr:`task_params`.

        Raises:
            ApiError: 400 ``invalid_request`` naming the bad field, or saying why the task's
                parameters are refused; 422 ``unsupported_task`` for a task the deployment's
                engine cannot do (naming the engines that can).
        """
        fields = dict(fields)
        if fields.get("target_lang") and not fields.get("to"):
            fields["to"] = fields["target_lang"]
        elif fields.get("target_lang") and fields["target_lang"] != fields["to"]:
            raise ApiError(ErrorCode.INVALID_REQUEST, "to and target_lang name two languages: give one")
        data: dict = {k: v for k, v in fields.items() if k in cls.model_fields and v != ""}
        if "metadata" in data:
            try:
                data["metadata"] = orjson.loads(data["metadata"])
            except orjson.JSONDecodeError:
                raise ApiError(ErrorCode.INVALID_REQUEST, "metadata must be a JSON object of strings") from None
        try:
            opts = cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(ErrorCode.INVALID_REQUEST, f"{where}: {first['msg']}") from None
        if sum(len(k) + len(v) for k, v in opts.metadata.items()) > METADATA_MAX_BYTES:
            raise ApiError(ErrorCode.INVALID_REQUEST, "metadata is limited to 16 KiB")
        params: dict = {}
        if opts.fields is not None:
            params["fields"] = field_values(opts.fields)
        if opts.to is not None:
            params["target_lang"] = opts.to
        try:
            opts._task_params = settings.check_task(opts.task, params or None, engine=True)
        except TaskError as exc:
            raise ApiError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        except UnsupportedTask as exc:
            raise ApiError(ErrorCode.UNSUPPORTED_TASK, str(exc)) from None
        return opts


def field_values(raw: str) -> list[str]:
    """The field names of an HTTP ``fields`` value: a JSON list of strings when it starts with
    ``[`` (what a repeated parameter becomes, :func:`repeated_fields`), else comma-separated
    (:func:`schemas.tasks.parse_fields`).

    Raises:
        ApiError: 400 ``invalid_request``: a ``[`` value that is not a JSON list of strings.
    """
    if not raw.lstrip().startswith("["):
        return list(parse_fields(raw))
    try:
        names = orjson.loads(raw)
    except orjson.JSONDecodeError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ApiError(ErrorCode.INVALID_REQUEST, "fields: a JSON list of strings, or names separated by commas")
    return names


def query_options(query) -> dict[str, str]:
    """The options of a query string (Starlette's ``QueryParams``): the last value of each, but
    a repeated ``fields`` as one JSON list (:func:`repeated_fields`)."""
    out = dict(query)
    if "fields" in out:
        out["fields"] = repeated_fields(query.getlist("fields"))
    return out


def repeated_fields(values: list[str]) -> str | None:
    """One ``fields`` value from the values of a repeated ``fields`` parameter (query string or
    form): None for none, the value itself for one, else a JSON list of them (one name each)."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return orjson.dumps(values).decode()


# -- responses ----------------------------------------------------------------------------------


class ApiErrorDetail(BaseModel):
    """An error: a stable ``code`` (an image error code of the pipeline, or one of the HTTP door's
    own such as ``rate_limited``: ``docs/errors.md``) and a human-readable ``message``."""

    code: str
    message: str


class Links(BaseModel):
    """Where to read the request's state: ``self`` (now) and ``wait`` (long-poll)."""

    self: str
    wait: str


class OcrResponse(BaseModel):
    """The state of one request.

    ``status`` is ``pending`` until the result is stored, then the result's own ``ok`` or
    ``error``; ``result`` is the full :class:`ResultDocument` once finished, else null.
    """

    request_id: str
    status: Status
    cache_hit: bool = False
    result: ResultDocument | None = None
    error: ApiErrorDetail | None = None
    links: Links


class BatchItem(OcrResponse):
    """One file of a batch upload; a file rejected at upload has ``status`` ``error`` and no links."""

    index: int = Field(ge=0, description="position of the file in the upload")
    filename: str | None = None
    links: Links | None = None  # type: ignore[assignment]


class BatchLinks(BaseModel):
    """Where to follow a whole batch: ``events``, the server-sent event stream
    (``GET /v1/events``) of every item that has a request id; null when no item has one."""

    events: str | None = None


class BatchResponse(BaseModel):
    """One item per uploaded file, in upload order, and links for the whole batch."""

    items: list[BatchItem]
    links: BatchLinks = Field(default_factory=BatchLinks)


_NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"


class JobCreate(BaseModel):
    """``POST /v1/jobs``'s body (JSON; every field optional)."""

    job_id: str | None = Field(default=None, min_length=1, max_length=REQUEST_ID_MAX_LENGTH, pattern=REQUEST_ID_PATTERN,
                               description="your own id for the job (default: a new 32-hex-digit id); creating it "
                                           "again changes nothing")
    name: str | None = Field(default=None, max_length=256, pattern=_NO_CONTROL,
                             description="a label for people (no control characters)")
    task: str | None = Field(default=None, max_length=64, description="the task its images run (report columns)")
    fields: list[str] | None = Field(default=None, max_length=50,
                                     description="`task=extract`: the field names (one report column each)")
    to: str | None = Field(default=None, max_length=16,
                           description="`task=translate`: the target language (en, zh, ja, ko, fr, de, es, it, pt, "
                                       "ru, ar, vi, th)")
    webhook_url: str | None = Field(default=None, max_length=2048,
                                    description="the job's completion event is POSTed there once, signed like a "
                                                "request's webhook (same allow-list and secret rules as `callback_url`)")



class JobClose(BaseModel):
    """``POST /v1/jobs/{job_id}/close``'s body: how many images the job has (the accepted submissions)."""

    expected: StrictInt = Field(ge=0, le=JOB_EXPECTED_MAX,
                                description="the job's request count, a JSON integer (0 to 2147483647; not a "
                                            "string, a boolean or a float): it completes when that many are final")


class JobCreated(BaseModel):
    """``POST /v1/jobs``' answer: the job's id and where to read it."""

    job_id: str
    links: dict[str, str] = Field(description="`self` (progress), `events` (server-sent events), `report`, `close`")


class ApiErrorBody(BaseModel):
    """Body of every 4xx/5xx answer."""

    error: ApiErrorDetail


class Health(BaseModel):
    """``/healthz`` and ``/readyz``: ``ok`` and, when not ready, what is missing."""

    ok: bool
    not_ready: list[str] = Field(default_factory=list)


class TaskInfo(BaseModel):
    """One task of the registry (``docs/tasks.md``) and whether this deployment runs it."""

    name: str = Field(description="the task's name, as `task=` names it")
    summary: str = Field(description="what it answers")
    parameters: list[str] = Field(description="the parameters it needs (`fields`, `target_lang`: `to` over HTTP)")
    engines: list[str] = Field(description="the engines that can do it (docs/engines.md)")
    runs: bool = Field(description="whether this deployment runs it: listed in `OCRSTREAM_TASKS` and done by its "
                                   "engine; a submission of any other is refused")
    reason: str | None = Field(default=None, description="why not, when `runs` is false: the message the refusal "
                                                         "carries (400 `invalid_request` or 422 `unsupported_task`)")


class DeploymentTasks(BaseModel):
    """``GET /v1/tasks``: this deployment's engine and every task of the registry, with whether it runs here."""

    engine: str = Field(description="the engine infer runs (`OCRSTREAM_ENGINE_KIND`, else `OCRSTREAM_ENGINE__ENGINE`)")
    default: str = Field(description="the task of a submission that names none")
    tasks: list[TaskInfo]


def deployment_tasks(settings: CacheKeySettings) -> DeploymentTasks:
    """Every task of :data:`schemas.tasks.TASKS` as ``settings`` runs it: those of
    :attr:`CacheKeySettings.runnable_tasks` run; the others carry the message a submission of them
    is refused with (:meth:`CacheKeySettings.check_task`)."""
    engine, runnable = settings.infer_engine, settings.runnable_tasks
    out = []
    for spec in TASKS.values():
        reason = settings.task_error(spec.name)
        if reason is None and spec.name not in runnable:
            reason = unsupported_task_message(spec.name, engine)
        out.append(TaskInfo(name=spec.name, summary=spec.summary, parameters=list(spec.needs),
                            engines=list(engines_for(spec.name)), runs=reason is None, reason=reason))
    return DeploymentTasks(engine=engine, default="ocr", tasks=out)


def finished(doc: ResultDocument, links: Links) -> OcrResponse:
    """The answer for a finished request: its result's status, the document, its error if any."""
    err = ApiErrorDetail(code=doc.error.code.value, message=doc.error.message) if doc.error else None
    return OcrResponse(request_id=doc.request_id, status=doc.status, cache_hit=doc.cache_hit, result=doc,
                       error=err, links=links)


# -- OpenAPI text -------------------------------------------------------------------------------

TITLE = "ocrstream"
SUMMARY = "Streaming OCR over Kafka: submit images over HTTP, get results at once, by long-poll or webhook."
DESCRIPTION = ("Submit an image with `POST /v1/ocr` (raw bytes or multipart): a cached image is answered "
               "200 with its result, a new one 202 with its request id; read it with "
               "`GET /v1/ocr/{request_id}?wait=S` (long-poll). Every error answers "
               '`{"error": {"code", "message"}}` with a stable code (`docs/errors.md`).')

_E, _H = ErrorCode, HttpErrorCode
#: The error codes each route can answer (their statuses and meanings: the error table).
SUBMIT_ERRORS = (_E.INVALID_REQUEST, _E.UNSUPPORTED_TASK, _E.EMPTY_INPUT, _H.CALLBACK_NOT_ALLOWED, _H.UNAUTHORIZED, _H.REQUEST_TIMEOUT,
                 _E.REQUEST_ID_CONFLICT, _E.INPUT_TOO_LARGE, _E.IMAGE_TOO_LARGE, _E.TOO_MANY_PAGES,
                 _E.DOCUMENT_TOO_MANY_PAGES, _E.DOCUMENT_TOO_LARGE, _E.UNSUPPORTED_FORMAT, _E.CORRUPT_IMAGE,
                 _E.DECODE_TIMEOUT, _E.IMAGE_TOO_COMPLEX, _H.RATE_LIMITED, _H.QUOTA_EXCEEDED, _H.TOO_MANY_UPLOADS,
                 _H.UNAVAILABLE, _H.OVERLOADED, _H.NOT_FOUND)
BATCH_ERRORS = (_E.INVALID_REQUEST, _E.UNSUPPORTED_TASK, _E.EMPTY_INPUT, _H.UNAUTHORIZED, _H.REQUEST_TIMEOUT, _E.INPUT_TOO_LARGE,
                _E.UNSUPPORTED_FORMAT, _H.RATE_LIMITED, _H.QUOTA_EXCEEDED, _H.TOO_MANY_UPLOADS, _H.UNAVAILABLE,
                _H.OVERLOADED, _H.NOT_FOUND)
READ_ERRORS = (_E.INVALID_REQUEST, _H.UNAUTHORIZED, _H.NOT_FOUND, _H.RATE_LIMITED, _H.UNAVAILABLE, _H.OVERLOADED)
EVENTS_ERRORS = READ_ERRORS
JOB_ERRORS = (_E.INVALID_REQUEST, _H.UNAUTHORIZED, _H.REQUEST_TIMEOUT, _E.INPUT_TOO_LARGE, _H.NOT_FOUND,
              _H.RATE_LIMITED, _H.TOO_MANY_UPLOADS, _H.UNAVAILABLE, _H.OVERLOADED)
JOB_CREATE_ERRORS = (*JOB_ERRORS, _E.UNSUPPORTED_TASK)
JOB_CLOSE_ERRORS = (*JOB_ERRORS, _H.JOB_EXPECTED_TOO_SMALL)


def json_body(model: str) -> dict:
    """An OpenAPI ``requestBody`` of a JSON body whose schema is component ``model`` (a body the
    endpoint reads itself: :mod:`services.api.bodies`)."""
    return {"required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}}


def error_responses(*codes: ErrorCode | HttpErrorCode) -> dict[int | str, dict]:
    """OpenAPI ``responses`` entries for these codes, one per status, all with the ``ApiErrorBody``
    shape; each description lists its codes and their meanings (:data:`schemas.errors.ERRORS`)."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        row = ERRORS[code.value]
        assert row.http_status is not None, code
        by_status.setdefault(row.http_status, []).append(f"`{code.value}`: {row.meaning}")
    return {st: {"model": ApiErrorBody, "description": "\n\n".join(lines)} for st, lines in sorted(by_status.items())}


def submit_parameters(*, request_id: bool = True) -> list[dict]:
    """``POST /v1/ocr``'s query options for a raw body (multipart sends them as form fields
    instead), from :class:`SubmitOptions`' fields (and ``target_lang``, read as ``to``); without
    ``request_id`` for a batch. They are also every query parameter the route takes: any other is
    400 ``invalid_request`` (:mod:`services.api.queries`)."""
    out = []
    for name, field in SubmitOptions.model_fields.items():
        if name == "request_id" and not request_id:
            continue
        limit = next((m.max_length for m in field.metadata if getattr(m, "max_length", None)), None)
        schema = {"type": "string"} | ({"maxLength": limit} if limit else {})
        out.append({"in": "query", "name": name, "required": False, "description": field.description,
                    "schema": schema})
        if name == "to":  # read by SubmitOptions.parse as the same parameter
            out.append({"in": "query", "name": "target_lang", "required": False, "schema": schema,
                        "description": "`task=translate`: the same parameter as `to` (give one, or both equal)"})
    return out


_BINARY = {"type": "string", "format": "binary"}


def submit_body() -> dict:
    """``POST /v1/ocr``'s request body: raw image bytes, or multipart with a ``file`` part and option fields."""
    form = {"type": "object", "required": ["file"],
            "properties": {"file": _BINARY, **{k: {"type": "string"} for k in SubmitOptions.model_fields}}}
    return {"required": True, "content": {"image/*": {"schema": _BINARY}, "application/pdf": {"schema": _BINARY},
                                          "application/octet-stream": {"schema": _BINARY},
                                          "multipart/form-data": {"schema": form}}}


def batch_body() -> dict:
    """``POST /v1/ocr/batch``'s request body: multipart, every ``files`` part an image, options as fields."""
    form = {"type": "object", "required": ["files"],
            "properties": {"files": {"type": "array", "items": _BINARY},
                           **{k: {"type": "string"} for k in SubmitOptions.model_fields if k != "request_id"}}}
    return {"required": True, "content": {"multipart/form-data": {"schema": form}}}


EVENT_IDS_TEXT = ("a request id; repeat the parameter for each request, at most `OCRSTREAM_HTTP_BATCH_MAX_FILES` "
                  "(64) distinct ids (duplicates count once)")
#: ``GET /v1/events``' 200 answer.
EVENTS_TEXT = (
    "`text/event-stream` (WHATWG HTML, server-sent events). First one event per id, in the order asked: "
    "`completed` (already finished), `pending`, or `error` (`not_found`: unknown, or another key's). Then one "
    "`completed` per request as it finishes. `id:` is the request id; `data:` is one line of JSON: for "
    "`completed` and `pending` the body `GET /v1/ocr/{request_id}` answers, for `error` "
    '`{"request_id", "error": {"code", "message"}}`. A `: keep-alive` comment line follows every '
    "`OCRSTREAM_HTTP_EVENTS_KEEPALIVE_S` (15) seconds of silence. Last, `end` once no request is pending or "
    'after `timeout`: `{"reason": "done"|"timeout", "completed": [ids], "pending": [ids], "not_found": [ids]}`; '
    "then the server closes the stream. An `EventSource` reconnects by itself: close it on `end`, or let it "
    "reconnect, which watches the requests still pending and gets 204 once none is."
)
#: One event of the ``GET /v1/events`` stream, as an SSE parser yields it (OpenAPI describes a
#: ``text/event-stream`` body by the schema of each event); comment lines (keep-alives) are no events.
EVENT_SCHEMA = {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string", "enum": ["completed", "pending", "error", "end"]},
                   "id": {"type": "string", "description": "the request id (none on `end`)"},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "description": "one line of JSON (see the answer's description)"}},
}
JOB_EVENT_SCHEMA = {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string", "enum": ["progress", "completed", "error"]},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "description": "one line of JSON: the job's progress (`progress`, `completed`) or "
                                           "`{code, message}` (`error`)"}},
}
EVENTS_RECONNECT_TEXT = ("a reconnect (`Last-Event-ID` sent) after every request has finished: an `EventSource` "
                         "stops reconnecting")
