"""The HTTP door's routes (FastAPI): thin functions over the serving modules.

Routes (all JSON; errors are ``{"error": {"code", "message"}}``, codes in ``docs/errors.md``; a ``/v1``
route answers a query parameter it does not take with 400 ``invalid_request``, :mod:`.queries`):

* ``POST /v1/ocr`` — one image, as the raw body (options in the query string) or as
  ``multipart/form-data`` (a file part plus option fields): :mod:`.serving_submit`.
* ``POST /v1/ocr/batch`` — many images in one multipart body; one item per file.
* ``GET /v1/ocr/{request_id}?wait=S`` — the request's state; with ``wait`` the call returns as
  soon as the completion arrives on ``ocr.completed`` (or after S seconds, still pending):
  :mod:`.serving_read`.
* ``GET /v1/tasks`` — the deployment's engine and tasks (what runs here, and why the others do not).
* ``GET /v1/events?id=A&id=B...`` — server-sent events (``text/event-stream``): one event per id
  with its state now, then one ``completed`` per request as it finishes, then ``end``
  (:mod:`.events`). Batch answers link to it.
* ``POST /v1/jobs``, ``POST /v1/jobs/{job_id}/close``, ``GET /v1/jobs/{job_id}`` (progress),
  ``GET /v1/jobs/{job_id}/events`` (server-sent events until complete), ``GET /v1/jobs/{job_id}/report``:
  :mod:`.serving_jobs` (``docs/jobs.md``).
* ``GET /healthz``, ``GET /readyz``, ``GET /metrics``; ``GET /`` the web page; ``GET /docs`` (Swagger UI) and
  ``GET /redoc`` (ReDoc), their assets served by the door (:mod:`.docs_pages`).

The spec (``/openapi.json``, ``schemas/openapi.json``) is built from :mod:`.protocol`.
"""

# no ``from __future__ import annotations``: the bounds of a route's parameters come from the settings,
# in annotations made where the route is defined (_seconds), which FastAPI must see evaluated
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

import orjson
from fastapi import FastAPI, Path as PathParam, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.errors import HttpErrorCode
from schemas.jobs import JobProgress
from services.api import protocol as p
from services.api.bodies import read_json_body
from services.api.clients import Clients
from services.api.docs_pages import add_docs_pages
from services.api.errors import ApiError, api_error_handler, http_error_handler, internal_error_handler, \
    validation_error_handler
from services.api.sse import ID_PATTERN, MEDIA_TYPE
from services.api.queries import KnownQueryRoute, query_names, unknown_query_error
from services.api.serving_jobs import JobService
from services.api.serving_read import ReadService
from services.api.serving_submit import SubmitService, json_response
from services.api.settings import ApiSettings
from services.common.settings import load_settings

STATIC = Path(__file__).parent / "static"
#: The web page talks to its own origin only: no CDN, no external fonts (works offline).
_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
             "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
#: ``GET /v1/events``' ``id`` parameter (their number is checked by the serving module: a setting bounds it).
_EventIds = Annotated[list[Annotated[str, StringConstraints(pattern=ID_PATTERN)]], Query(
    alias="id", min_length=1, description=p.EVENT_IDS_TEXT)]


def _seconds(most: float, setting: str, what: str):
    """A query parameter of seconds from 0 to ``most`` (a finite number; the setting ``setting``
    bounds it): out of range, 400 ``invalid_request`` naming the bound
    (:func:`~services.api.errors.validation_error_handler`), never taken as it came."""
    return Annotated[float, Query(ge=0, le=most, allow_inf_nan=False, description=(
        f"{what}: 0 to {most:g} (`{setting}`); more, or not a finite number, is 400 `invalid_request`"))]


class SubmitFastPath:
    """Pure ASGI middleware that sends ``POST /v1/ocr`` straight to its endpoint.

    The endpoint is the same function FastAPI routes to (and documents in the spec); this only
    skips the layers between: route matching, FastAPI's request/response wrapper and parameter
    solving, the exception and exit-stack middlewares: 5-13 % of the door's CPU per cached request
    (two runs of ``python -m bench.http_bench --routed``, bench/README.md: raw body 1.09 vs 1.20 and
    0.79 vs 0.87 ms, multipart 1.02 vs 1.07 and 1.05 vs 1.21 ms). Off with ``http_fast_path`` false
    (only to measure it).
    :class:`~services.api.errors.ApiError` is answered here in the one error shape; any
    other exception goes on to Starlette's server-error middleware (500 ``internal_error``,
    :func:`~services.api.errors.internal_error_handler`), as it would from the route.

    Args:
        app: The rest of the stack.
        endpoint: ``async (Request) -> Response`` for ``POST /v1/ocr``.
        known: The query parameters the route takes (:func:`~services.api.queries.query_names`):
            any other is refused as the route refuses it.
    """

    def __init__(self, app, endpoint, known: tuple[str, ...]):
        self.app = app
        self.endpoint = endpoint
        self.known = known

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/ocr" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            # the route's own check (KnownQueryRoute), which this path skips
            if (err := unknown_query_error(request.query_params, self.known, "POST /v1/ocr")) is not None:
                raise err
            response = await self.endpoint(request)
        except ApiError as err:
            response = err.response()
        await response(scope, receive, send)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's spec without the 422 ``HTTPValidationError`` answers it adds to every route with
    parameters: parameter errors are answered 400 ``invalid_request`` in the one error shape
    (:func:`~services.api.errors.validation_error_handler`). Built once, then cached."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                           routes=app.routes, tags=app.openapi_tags, openapi_version=app.openapi_version)
        for item in spec.get("paths", {}).values():
            for op in item.values():
                resp = op.get("responses", {}).get("422")
                if resp and "HTTPValidationError" in orjson.dumps(resp).decode():
                    del op["responses"]["422"]
        for name in ("HTTPValidationError", "ValidationError"):
            spec.get("components", {}).get("schemas", {}).pop(name, None)
        for model in (p.JobCreate, p.JobClose):  # bodies read by the endpoint itself (services/api/bodies.py)
            spec.setdefault("components", {}).setdefault("schemas", {})[model.__name__] = model.model_json_schema(
                ref_template="#/components/schemas/{model}")
        app.openapi_schema = spec
    return app.openapi_schema


def _submit_routes(app: FastAPI, clients: Clients, submits: SubmitService) -> None:
    @app.post("/v1/ocr", response_model=p.OcrResponse, status_code=202, tags=["ocr"], summary="Submit one image",
              response_description="accepted: the request id, status `pending` and where to read the result",
              responses={200: {"model": p.OcrResponse, "description": "cached: the finished result, status `ok`"},
                         **p.error_responses(*p.SUBMIT_ERRORS)},
              openapi_extra={"parameters": p.submit_parameters(), "requestBody": p.submit_body()})
    async def submit(request: Request) -> Response:
        """Submit one image: 200 with the result when cached, else 202 with the request id.

        A PDF or multi-page TIFF is split into one request per page by the pipeline; the request
        id's result is the assembled document (`document_id`, `page_count`, `failed_pages`, the
        pages' text in order; docs/documents.md). Over the document limits: 413."""
        return await submits.handle(request)

    if clients.s.http_fast_path:  # the hot route skips the routing layers (added first: CORS, when on, wraps it)
        route = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/v1/ocr")
        app.add_middleware(SubmitFastPath, endpoint=submit, known=query_names(route))

    @app.post("/v1/ocr/batch", response_model=p.BatchResponse, status_code=202, tags=["ocr"],
              summary="Submit many images in one multipart body",
              response_description="at least one item is pending: one item per file, in upload order",
              responses={200: {"model": p.BatchResponse, "description": "every item finished (cached or rejected)"},
                         **p.error_responses(*p.BATCH_ERRORS)},
              openapi_extra={"parameters": p.submit_parameters(request_id=False), "requestBody": p.batch_body()})
    async def submit_batch(request: Request) -> Response:
        """Submit many images in one multipart body (every file part; options shared by all, from the
        query string or form fields as for ``POST /v1/ocr``; a form field wins). A ``request_id``
        is refused: each item gets its own. The batch costs one rate-limit token and one
        submission per image, all or none, charged once its files are read. A PDF or multi-page
        TIFF item is split as by ``POST /v1/ocr``; one over the document limits is an item with
        its 413 code."""
        return await submits.handle_batch(request)


def _read_routes(app: FastAPI, clients: Clients, reads: ReadService) -> None:
    s = clients.s
    stream_timeout = _seconds(s.http_events_max_s, "OCRSTREAM_HTTP_EVENTS_MAX_S",
                              "seconds the stream stays open at most (the default: the bound)")

    @app.get("/v1/events", tags=["ocr"], summary="Watch requests finish (server-sent events)",
             response_class=Response,
             responses={200: {"description": p.EVENTS_TEXT, "content": {MEDIA_TYPE: {"schema": p.EVENT_SCHEMA}}},
                        204: {"description": p.EVENTS_RECONNECT_TEXT}, **p.error_responses(*p.EVENTS_ERRORS)})
    async def events(
        request: Request,
        ids: _EventIds,
        timeout: stream_timeout = s.http_events_max_s,
    ) -> Response:
        """Watch many requests finish on one connection: server-sent events, as specified by the WHATWG HTML
        Living Standard, "Server-sent events" (https://html.spec.whatwg.org/multipage/server-sent-events.html).
        Same access rules as ``GET /v1/ocr/{request_id}``: with API keys on, a key sees its own requests only."""
        principal = await clients.guard.check(request)
        stream = await reads.events_route(ids, timeout, principal, reconnect="last-event-id" in request.headers)
        return stream if stream is not None else Response(status_code=204)

    tasks_body = json_response(p.deployment_tasks(s), 200).body  # fixed for the process: its settings

    @app.get("/v1/tasks", response_model=p.DeploymentTasks, tags=["ocr"], summary="The tasks this deployment runs",
             response_description="every task of the registry: whether it runs here, and why not")
    async def tasks() -> Response:
        """This deployment's engine and every task (docs/tasks.md) with whether it runs here: listed in
        `OCRSTREAM_TASKS` and done by the engine. A submission of any other task is refused at once (400
        `invalid_request`, or 422 `unsupported_task` naming the engines that can). Needs no API key: it tells
        what the deployment does, nothing of anyone's requests (the web page reads it for its task menu)."""
        return Response(tasks_body, media_type="application/json")

    @app.get("/v1/ocr/{request_id}", response_model=p.OcrResponse, tags=["ocr"], summary="Read a request's state",
             response_description="the state: `pending`, or `ok`/`error` with the result document",
             responses=p.error_responses(*p.READ_ERRORS))
    async def read(
        request: Request,
        request_id: Annotated[str, PathParam(max_length=64)],
        wait: _seconds(s.http_wait_max_s, "OCRSTREAM_HTTP_WAIT_MAX_S", "seconds to wait for completion (long-poll)") = 0,
    ) -> Response:
        """The request's state; ``?wait=S`` returns as soon as it completes, or pending after S seconds."""
        principal = await clients.guard.check(request)
        return json_response(await reads.read_route(request_id, wait, principal), 200)


_JobId = Annotated[str, PathParam(min_length=1, max_length=64, pattern=ID_PATTERN)]


def _job_routes(app: FastAPI, clients: Clients, jobs: JobService) -> None:
    s = clients.s
    stream_timeout = _seconds(s.http_events_max_s, "OCRSTREAM_HTTP_EVENTS_MAX_S",
                              "seconds the stream stays open at most (the default: the bound)")

    # the bodies are read after the key is checked, bounded and within the upload budget (services/api/bodies.py)
    @app.post("/v1/jobs", response_model=p.JobCreated, status_code=201, tags=["jobs"], summary="Create a job",
              responses=p.error_responses(*p.JOB_CREATE_ERRORS), openapi_extra={"requestBody": p.json_body("JobCreate")})
    async def create_job(request: Request) -> Response:
        """Create a job (an event on `ocr.jobs`): submit images with `job_id`, then close it with their count."""
        principal = await clients.guard.check(request)
        body = await read_json_body(request, p.JobCreate, clients, principal.key_id)
        return json_response(await jobs.create(body, principal), 201)

    @app.post("/v1/jobs/{job_id}/close", response_model=p.JobCreated, status_code=202, tags=["jobs"],
              summary="Close a job with its request count", responses=p.error_responses(*p.JOB_CLOSE_ERRORS),
              openapi_extra={"requestBody": p.json_body("JobClose")})
    async def close_job(request: Request, job_id: _JobId) -> Response:
        """Say how many images the job has (at least as many as are final already, else 409
        `job_expected_too_small`); it completes once that many are final (the first close counts)."""
        principal = await clients.guard.check(request)
        body = await read_json_body(request, p.JobClose, clients, principal.key_id)
        return json_response(await jobs.close(job_id, body, principal), 202)

    @app.get("/v1/jobs/{job_id}", response_model=JobProgress, tags=["jobs"], summary="Read a job's progress",
             responses=p.error_responses(*p.JOB_ERRORS))
    async def job_progress(request: Request, job_id: _JobId) -> Response:
        """Total, done, ok, failed by error code, cache hits, pages, rate and ETA (MariaDB)."""
        principal = await clients.guard.check(request)
        return json_response(await jobs.progress(job_id, principal), 200)

    @app.get("/v1/jobs/{job_id}/events", tags=["jobs"], summary="Follow a job (server-sent events)",
             response_class=Response,
             responses={200: {"description": "`progress` events (the counts as JSON) whenever they change, then "
                                             "one `completed`; keep-alive comments between",
                              "content": {MEDIA_TYPE: {"schema": p.JOB_EVENT_SCHEMA}}},
                        **p.error_responses(*p.JOB_ERRORS)})
    async def job_events(
        request: Request,
        job_id: _JobId,
        timeout: stream_timeout = s.http_events_max_s,
    ) -> Response:
        """The job's progress as server-sent events until it completes (at most `timeout` seconds)."""
        principal = await clients.guard.check(request)
        return await jobs.events(job_id, principal, min(timeout, s.http_events_max_s))

    @app.get("/v1/jobs/{job_id}/report", tags=["jobs"], summary="Download a job's report", response_class=Response,
             responses={200: {"description": "one row per request final so far",
                              "content": {"text/csv": {"schema": {"type": "string"}},
                                          "application/x-ndjson": {"schema": {"type": "string"}}}},
                        **p.error_responses(*p.JOB_ERRORS)})
    async def job_report(request: Request, job_id: _JobId,
                         format: Annotated[Literal["csv", "jsonl"], Query(description="csv or jsonl")] = "csv",
                         ) -> Response:
        """The job's report: name, status, error code, pages, lines, characters, mean confidence, cache hit,
        per-stage times, a column per `extract` field."""
        principal = await clients.guard.check(request)
        return await jobs.report(job_id, format, principal)


def _ops_routes(app: FastAPI, clients: Clients) -> None:
    @app.get("/healthz", response_model=p.Health, tags=["ops"], summary="Liveness probe",
             response_description="the process answers")
    async def healthz() -> Response:
        """Liveness: the process answers."""
        return json_response(p.Health(ok=True), 200)

    @app.get("/readyz", response_model=p.Health, tags=["ops"], summary="Readiness probe",
             response_description="ready: Kafka connected, S3 reachable",
             responses={503: {"model": p.Health, "description": "not ready: `not_ready` names what is missing"}})
    async def readyz() -> Response:
        """Readiness: Kafka connected, S3 reachable."""
        missing = clients.telemetry.not_ready()
        return json_response(p.Health(ok=not missing, not_ready=missing), 503 if missing else 200)

    @app.get("/metrics", tags=["ops"], response_class=Response, summary="Prometheus metrics",
             responses={200: {"description": "Prometheus text exposition format 0.0.4",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        """Prometheus metrics of this process."""
        return Response(generate_latest(clients.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        """The web page (``static/index.html``); its CSP allows requests to this origin only."""
        page = STATIC / "index.html"
        if not page.exists():
            raise ApiError(HttpErrorCode.NOT_FOUND, "the web page is not installed")
        return FileResponse(page, media_type="text/html", headers={"Content-Security-Policy": _PAGE_CSP})

    # the page's script and style sheet (check_dir=False: a wheel without the page still starts)
    app.mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static")


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """The ASGI app. Clients connect in the lifespan (so building the app is cheap: the OpenAPI
    generator builds it without any client connecting).

    Args:
        settings: Defaults to :class:`ApiSettings` read from the environment.

    Returns:
        The app; ``app.state.clients`` is its :class:`~services.api.clients.Clients`.
    """
    s = settings or load_settings(ApiSettings)
    clients = Clients(s)
    reads = ReadService(clients)
    submits = SubmitService(clients, reads)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await clients.start()
        try:
            yield
        finally:
            await clients.stop()

    # FastAPI's own request/operation spans (on by itself once a tracer provider is set) would
    # double the door's api.submit SERVER span and cost ~3 extra spans per request on the
    # cached path (measured: bench/http_bench.py); the door traces itself.
    app = FastAPI(title=p.TITLE, version="1", summary=p.SUMMARY, description=p.DESCRIPTION, lifespan=lifespan,
                  telemetry={"tracing": False}, docs_url=None, redoc_url=None)
    app.router.route_class = KnownQueryRoute  # every /v1 route refuses query parameters it does not take
    app.state.clients = clients
    app.add_exception_handler(ApiError, api_error_handler)
    # FastAPI's parameter checks and Starlette's 404/405 answer in the one error shape too
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)  # anything else: 500 internal_error, logged
    app.openapi = lambda: _openapi(app)
    _submit_routes(app, clients, submits)
    if s.http_cors_origins:
        # Retry-After exposed: a page on another origin reads it off a 429/503 (Fetch: not a safelisted header)
        app.add_middleware(CORSMiddleware, allow_origins=s.http_cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Content-Type", "X-API-Key", "Authorization"], expose_headers=["Retry-After"])
    _read_routes(app, clients, reads)
    _job_routes(app, clients, JobService(clients))
    _ops_routes(app, clients)
    add_docs_pages(app)  # /docs and /redoc with their assets from the door (FastAPI's load them from a CDN)
    return app
