"""Settings of the HTTP front door (env prefix ``OCRSTREAM_``, e.g. ``OCRSTREAM_HTTP_PORT``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from services.common.cache.keys import CacheKeySettings
from services.common.webhooks.settings import CallbackSettings

if TYPE_CHECKING:
    from services.api.uploads import BodyPace


class ApiSettings(CacheKeySettings, CallbackSettings):
    """Settings of ``python -m services.api`` (the HTTP door; it reads no stage's settings).

    Off-by-default for local use: no API keys, no rate limits, CORS closed, webhooks only to
    hosts on an allow-list. The Helm values turn keys and limits on.
    """

    http_host: str = Field(default="127.0.0.1", description="address the HTTP door listens on")
    http_port: int = Field(default=8080, ge=1, le=65535, description="port of the HTTP door (also serves /metrics, /healthz, /readyz)")
    http_wait_max_s: float = Field(default=60.0, gt=0, description="longest long-poll a GET ?wait= may ask for "
                                   "(more is 400 invalid_request naming it), s")
    http_max_waiters: int = Field(default=10_000, ge=1, description="long-polls held at once per process; more get 503")
    http_batch_max_files: int = Field(default=64, ge=1, description="images per POST /v1/ocr/batch (and request ids per GET /v1/events)")
    http_events_max_s: float = Field(
        default=300.0, gt=0, description="longest a GET /v1/events or GET /v1/jobs/{id}/events stream stays open "
                                         "(its `timeout` defaults to it; more is 400 invalid_request naming it), s")
    http_job_wait_s: float = Field(
        default=10.0, ge=0, le=120,
        description="longest the door waits for a job the jobs stage has not recorded yet (one just created): "
                    "GET /v1/jobs/{id}/events, and with API keys a submission with job_id or a close, s")
    http_events_keepalive_s: float = Field(
        default=15.0, gt=0, description="silence on a GET /v1/events stream before a keep-alive comment line, s")
    http_batch_concurrency: int = Field(
        default=8, ge=1, description="images of one POST /v1/ocr/batch checked, stored and sent at once")
    http_batch_max_bytes: int = Field(default=128 * 1024 * 1024, ge=1, description="body bytes per POST /v1/ocr/batch")
    http_accepted_ttl_s: int = Field(default=7 * 86_400, ge=1, description="how long an accepted request id is remembered as pending, s")
    http_upload_budget_bytes: int = Field(
        default=512 * 1024 * 1024, ge=0,
        description="request bodies held in memory at once, charged as their bytes arrive (never as declared), "
                    "bytes; a body that would pass it gets 503 overloaded, before it is read when what it will hold "
                    "does not fit now (0 = unbounded). Small bodies are charged to http_small_upload_budget_bytes")
    http_small_body_bytes: int = Field(
        default=1024 * 1024, ge=0,
        description="a body declaring a Content-Length up to this many bytes is small: charged to the small-body "
                    "budget (while it has room) and taking no per-client or per-key upload slot, so small uploads "
                    "and cached images are answered while large uploads hold the upload budget, bytes")
    http_small_upload_budget_bytes: int = Field(
        default=64 * 1024 * 1024, ge=0,
        description="small bodies held in memory at once, on top of http_upload_budget_bytes, bytes; a small body "
                    "that does not fit is charged to the upload budget like a large one (0 = no separate budget)")
    http_uploads_per_client: int = Field(
        default=8, ge=0,
        description="uploads charged to the upload budget (bodies over http_small_body_bytes, or chunked) in "
                    "progress at once per client address; past it 429 too_many_uploads (0 = no limit). Behind a "
                    "proxy, list it in http_forwarded_allow_ips, else every client is the proxy's address")
    http_uploads_per_key: int = Field(
        default=16, ge=0,
        description="uploads charged to the upload budget in progress at once per API key (keys required); past "
                    "it 429 too_many_uploads (0 = no limit)")
    http_forwarded_allow_ips: list[str] = Field(
        default_factory=lambda: ["127.0.0.1", "::1"],
        description="proxies (addresses or CIDR networks, '*' = any) whose X-Forwarded-For names the client "
                    "(uvicorn's forwarded_allow_ips); the client address is what http_uploads_per_client counts")
    http_stream_part_bytes: int = Field(
        default=8 * 1024 * 1024, ge=5 * 1024 * 1024, le=5 * 1024**3,
        description="an upload (raw body or multipart file part) reaching this size is streamed to S3 as a "
                    "multipart upload with parts of this size while it is read (at most ~2 parts held per "
                    "upload); smaller ones stay in memory, bytes (S3: at least 5 MiB)")
    http_body_timeout_s: float = Field(
        default=120.0, gt=0,
        description="a request body must arrive within this many seconds of waiting for it, else 408 request_timeout "
                    "(slow clients)")
    http_body_idle_timeout_s: float = Field(
        default=30.0, gt=0,
        description="longest wait for the next bytes of a request body (nginx's client_body_timeout), s; else 408 "
                    "request_timeout")
    http_body_min_rate_bytes_per_s: float = Field(
        default=4096.0, ge=0,
        description="a request body must average at least this rate after http_body_min_rate_grace_s (the door's "
                    "own waits left out), bytes/s; else 408 request_timeout (0 = no minimum)")
    http_body_min_rate_grace_s: float = Field(
        default=10.0, ge=0, description="seconds of a request body before its minimum rate applies")
    http_hit_linger_ms: int = Field(
        default=20, ge=0,
        description="producer batching delay for cache hits published on ocr.results (the caller already has "
                    "its answer; only the DB row, completion and webhook wait), ms")
    http_result_lru_entries: int = Field(default=4_096, ge=0, description="result documents kept in memory for cached answers")
    http_result_lru_bytes: int = Field(
        default=8 * 1024 * 1024, ge=0,
        description="bound on their JSON size, bytes (in memory ~8x: services/common/cache/outputs.py); 0 = entries only",
    )
    http_fast_path: bool = Field(
        default=True,
        description="POST /v1/ocr skips FastAPI's routing layers (same endpoint, same answers; 5-13 % less door "
                    "CPU per cached request: bench/README.md); false only to measure it (bench/http_bench.py --routed)")
    http_split_documents: bool = Field(
        default=True,
        description="a PDF or multi-page TIFF posted to the door is checked against the document limits (413 "
                    "document_too_many_pages, document_too_large), stored, and handed to ingest on "
                    "ocr.submit to be split into pages (docs/documents.md); false: one request of at most "
                    "limits.max_pages pages, straight to ocr.requests")
    http_max_head_bytes: int = Field(
        default=16 * 1024, ge=1024,
        description="request target and header lines of one request, bytes; past it 431 and the connection "
                    "is closed (a browser's cookies and a GET /v1/events of 64 ids fit well within the default)")
    http_max_headers: int = Field(
        default=100, ge=8, description="header lines of one request; past it 431 and the connection is closed")
    http_cors_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS; empty = closed")

    auth_required: bool = Field(default=False, description="require an API key (X-API-Key or Bearer) on /v1/ routes")
    rate_limit_per_s: float = Field(default=0.0, ge=0, description="default per-key request rate, tokens/s; 0 = unlimited")
    rate_limit_burst: int = Field(default=20, ge=1, description="default per-key token bucket size, requests")
    quota_per_day: int = Field(default=0, ge=0, description="default per-key submissions per UTC day; 0 = none")
    auth_cache_s: float = Field(
        default=5.0, ge=0, description="how long a key lookup is reused in-process, s (a revoked key works at most this long); 0 = none"
    )
    rate_limit_read_first_bytes: int = Field(
        default=1024 * 1024, ge=0,
        description="a raw-body POST /v1/ocr with a Content-Length up to this many bytes (and no request_id or "
                    "callback_url) is read before its key's rate limit is taken, so the limit and the cache lookup "
                    "share one Redis call; larger or chunked bodies are limited before a byte is read; 0 = always first",
    )

    webhook_enabled: bool = Field(default=True, description="accept callback_url (false: a callback_url is refused "
                                                          "with 400; deliveries are the webhooks stage's)")

    def body_pace(self) -> "BodyPace":
        """How fast request bodies must arrive (:class:`~services.api.uploads.BodyPace`)."""
        from services.api.uploads import BodyPace

        return BodyPace(total_s=self.http_body_timeout_s, idle_s=self.http_body_idle_timeout_s,
                        min_rate=self.http_body_min_rate_bytes_per_s, grace_s=self.http_body_min_rate_grace_s)
