"""Settings shared by every stage, read from ``OCRSTREAM_*`` environment variables.

Nested sections use a double underscore: ``OCRSTREAM_KAFKA__BOOTSTRAP_SERVERS``,
``OCRSTREAM_S3__BUCKET``. Defaults work against the local stack of ``deploy/local/up.sh``.
Each stage subclasses :class:`CommonSettings` with its own fields; settings are built once
at start-up and passed explicitly (never read from ``os.environ`` deep in the code).
"""

from __future__ import annotations

import os
import re
from typing import Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from schemas.topics import Topics


class KafkaSettings(BaseModel):
    """Kafka connection, producer and consumer-group settings (aiokafka)."""

    bootstrap_servers: str = Field(default="127.0.0.1:9092", description="comma-separated host:port list")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(default="PLAINTEXT", description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(default=None, description="PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
    sasl_username: str | None = Field(default=None, description="SASL user")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password (from a Secret)")
    ssl_cafile: str | None = Field(default=None, description="CA bundle (PEM) to verify the brokers")
    ssl_certfile: str | None = Field(default=None, description="client certificate (PEM) for mTLS")
    ssl_keyfile: str | None = Field(default=None, description="client key (PEM) for mTLS")
    partitions: int = Field(default=4, ge=1, description="partitions per topic created by `ocrstream init`")
    replication_factor: int = Field(default=1, ge=1, description="replication factor of topics created by `ocrstream init`")
    acks: Literal["all", "1", "0"] = Field(default="all", description="producer acks; `all` with idempotence never loses an acknowledged message")
    enable_idempotence: bool = Field(default=True, description="idempotent producer (no duplicates from producer retries)")
    linger_ms: int = Field(
        default=0, ge=0,
        description="producer batching delay, ms; 0 = send at once (messages sent while a request is in flight still batch)")
    max_request_size: int = Field(
        default=8_388_608, ge=1,
        description="largest message produced, bytes (a result of ~15,000 text lines with their segments); "
                    "`ocrstream init` creates topics with this max.message.bytes (brokers default to 1 MiB)")
    session_timeout_ms: int = Field(default=30_000, ge=1, description="consumer group session timeout, ms")
    heartbeat_interval_ms: int = Field(default=3_000, ge=1, description="consumer heartbeat interval, ms")
    max_poll_interval_ms: int = Field(default=300_000, ge=1, description="max time between polls, ms (the runner keeps polling while a batch runs)")
    request_timeout_ms: int = Field(default=30_000, ge=1, description="Kafka request timeout, ms")


class S3Settings(BaseModel):
    """S3-compatible object store holding images (by content hash) and result documents."""

    endpoint_url: str | None = Field(default="http://127.0.0.1:9000", description="S3 endpoint; unset for AWS")
    access_key: str = Field(default="ocrstream", description="access key id")
    secret_key: SecretStr = Field(default=SecretStr("ocrstream-secret"), description="secret access key")
    region: str = Field(default="us-east-1", description="region")
    bucket: str = Field(default="ocrstream", description="bucket for images/ and results/")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="connect timeout, s")
    read_timeout_s: float = Field(default=30.0, gt=0, description="read timeout, s")
    max_pool_connections: int = Field(default=32, ge=1, description="HTTP connections per process")
    known_keys: int = Field(
        default=65_536, ge=0,
        description="image keys this process stored or saw present, remembered so a repeat skips the HEAD; "
                    "0 = always ask S3 (use 0 where images are deleted: bucket rules, by hand)")
    known_ttl_s: float = Field(
        default=600.0, gt=0,
        description="how long a remembered key is trusted without asking S3 again, s (counted from when this process "
                    "last asked, not from the object's creation)")
    staging_prefix: str = Field(
        default="staging/", min_length=1, max_length=200,
        description="key prefix of large HTTP uploads while they stream in (multipart uploads, then one object "
                    "until it is copied to images/); `ocrstream init` expires what is left there after 1 day")
    upload_prefix: str = Field(
        default="uploads/", min_length=1, max_length=200,
        description="key prefix where `ocrstream submit` puts files too large to send inline (ingest copies what it "
                    "accepts to images/); the default entry of OCRSTREAM_S3_ALLOWED_PREFIXES")
    upload_expiry_days: int = Field(
        default=1, ge=1,
        description="days after which `ocrstream init`'s lifecycle rule deletes objects under upload_prefix, "
                    "accepted or refused (accepted images are kept under images/)")

    @field_validator("endpoint_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None:
            u = urlsplit(v)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError("must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:9000")
            u.port  # noqa: B018 - raises ValueError for a port outside 0-65535
        return v


class RedisSettings(BaseModel):
    """Redis holding the result cache, in-flight leases and waiters."""

    url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL (rediss:// for TLS)")
    password: SecretStr | None = Field(default=None, description="Redis password")
    timeout_ms: int = Field(default=100, ge=1, description="time budget of every Redis call, ms")
    breaker_failures: int = Field(
        default=3, ge=1,
        description="consecutive failed or slow Redis calls that open the circuit breaker: calls then fail at once "
                    "(a cache miss) instead of each waiting out timeout_ms")
    breaker_open_ms: int = Field(
        default=1000, ge=1,
        description="how long the breaker stays open, ms; then one call tries Redis again (success closes it)")
    key_prefix: str = Field(default="ocr", description="prefix of every key ocrstream writes")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        u = urlsplit(v)
        if u.scheme not in ("redis", "rediss", "unix") or (u.scheme != "unix" and not u.hostname) \
                or (u.scheme == "unix" and not u.path):
            raise ValueError("must be a redis://, rediss:// or unix:// URL, e.g. redis://127.0.0.1:6379/0")
        u.port  # noqa: B018 - raises ValueError for a port outside 0-65535
        return v


class MySQLSettings(BaseModel):
    """MariaDB/MySQL holding the requests and results tables."""

    host: str = Field(default="127.0.0.1", description="MariaDB/MySQL host")
    port: int = Field(default=3306, ge=1, le=65535, description="port")
    user: str = Field(default="ocrstream", description="user")
    password: SecretStr = Field(default=SecretStr("ocrstream"), description="password")
    database: str = Field(default="ocrstream", description="database")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="connect timeout, s")
    row_max_bytes: int = Field(
        default=1_048_576, ge=65_536,
        description="bound on requests.document_json and results.text, bytes of UTF-8 (keep it well under the "
                    "server's max_allowed_packet, 16 MiB by default: SQL escaping may double it); over it the row "
                    "keeps the summary: lines left out, text cut, the whole document in S3 at result_uri")


class TelemetrySettings(BaseModel):
    """Logging, metrics and tracing."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.upper() if isinstance(v, str) else v
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="port for /metrics, /healthz, /readyz; unset or 0 = off")
    traces_exporter: Literal["none", "console", "otlp", "file"] = Field(
        default="none",
        description="none (ids propagate, nothing recorded), console, otlp (extra `otlp`) or file (JSON lines)",
    )
    otlp_endpoint: str | None = Field(default=None, description="OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces")
    traces_file: str | None = Field(default=None, description="JSON-lines span file for the `file` exporter (appended to by every process)")
    probe_interval_s: float = Field(default=5.0, gt=0, description="seconds between readiness checks of Kafka and the stores")


class Limits(BaseModel):
    """Limits that protect the service; each is enforced at the earliest stage that can."""

    max_image_bytes: int = Field(default=50 * 1024 * 1024, ge=1, description="bytes per upload (ingest)")
    max_pixels: int = Field(default=100_000_000, ge=1, description="width x height per page, from the header")
    max_pages: int = Field(default=20, ge=1, description="pages/frames per multi-page input read as one request "
                           "(GIF, WebP, APNG; a PDF or TIFF when documents are not split)")
    max_document_pages: int = Field(
        default=3000, ge=1, description="pages of a PDF or multi-page TIFF split into pages at ingest (Textract's "
        "3,000), counted before any page is rendered: document_too_many_pages")
    max_document_pixels: int = Field(
        default=12_000_000_000, ge=1, description="pixels of all pages of such a document together (3,000 A4 pages "
        "at 200 dpi), read from the headers before any page is rendered: document_too_large")
    infer_timeout_s: float = Field(default=300.0, gt=0, description="seconds of inference per request (image), all its pages and tiles together")
    inline_max_bytes: int = Field(default=700 * 1024, ge=0, description="largest image sent inline on ocr.submit")


class DecodeSettings(BaseModel):
    """Decoder processes: every image is sniffed, decoded and rendered in one of them, under hard
    bounds (:mod:`services.common.images.decoding`), so no input can wedge or exhaust a stage."""

    workers: int = Field(default=2, ge=1, le=64, description="decoder processes per stage process (each decodes one image at a time)")
    memory_mb: int = Field(
        default=2048, ge=0,
        description="address-space limit of each decoder process, MiB (RLIMIT_AS; about 150 MiB of it is the "
                    "interpreter and its libraries); over it the image ends image_too_complex. 0 = no limit")
    page_timeout_s: float = Field(
        default=30.0, gt=0,
        description="wall-clock limit of one page's decode or render, and of the format check, s; over it the "
                    "decoder is killed and the request ends decode_timeout")
    timeout_s: float = Field(
        default=120.0, gt=0,
        description="wall-clock limit of decoding all pages of one request, s (decode_timeout)")
    start_timeout_s: float = Field(
        default=60.0, gt=0, description="how long a new decoder process may take to start (imports), s")


class CommonSettings(BaseSettings):
    """Settings every stage has. Env prefix ``OCRSTREAM_``, nested delimiter ``__``."""

    model_config = SettingsConfigDict(
        env_prefix="OCRSTREAM_", env_nested_delimiter="__", extra="ignore", frozen=True,
        allow_inf_nan=False,  # a time or size of "nan" or "inf" is a mistake, never a setting
    )

    kafka: KafkaSettings = KafkaSettings()
    s3: S3Settings = S3Settings()
    redis: RedisSettings = RedisSettings()
    mysql: MySQLSettings = MySQLSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    topics: Topics = Topics()
    limits: Limits = Limits()
    decode: DecodeSettings = DecodeSettings()
    max_attempts: int = Field(default=3, ge=1, description="attempts before a message goes to ocr.dlq")
    poison_after_deaths: int = Field(
        default=2, ge=0,
        description="a record in progress when its stage died (killed, out of memory, crashed, or stopped without "
                    "finishing it) this many times goes to ocr.dlq unhandled and its request ends with stage_crash; "
                    "counted across restarts in the consumer group's commit metadata (one more commit per batch); "
                    "0 = off")
    shutdown_timeout_s: float = Field(default=20.0, gt=0, description="SIGTERM drain bound; below k8s grace period")
    retry_max_backoff_s: float = Field(default=10.0, gt=0, description="cap of the backoff while a store is down")

S = TypeVar("S", bound=BaseSettings)

_SECRET = re.compile(r"password|secret|token|key", re.I)
_URL_CREDENTIALS = re.compile(r"[^/@\s'\"]+@")  # a URL's userinfo, however malformed the rest


def load_settings(cls: type[S]) -> S:
    """``cls()`` read from the environment, with bad values reported as one line per field.

    Returns:
        The settings object.

    Raises:
        SystemExit: (status 1) when a variable does not parse; the message names each variable
            as it is spelled in the environment, e.g.
            ``OCRSTREAM_MAX_BATCH='abc': Input should be a valid integer, ...``
            (values of password/secret/token/key fields are not echoed). A list, dict or
            section value that is not JSON (pydantic-settings' ``SettingsError``) names every
            variable of that field, e.g. ``OCRSTREAM_HTTP_CORS_ORIGINS='*': not valid JSON ...``.
    """
    prefix = cls.model_config.get("env_prefix") or ""
    delim = cls.model_config.get("env_nested_delimiter") or "__"
    try:
        return cls()
    except SettingsError as exc:
        raise SystemExit("ocrstream: invalid settings in the environment:\n  "
                         + "\n  ".join(_unparsed(exc, prefix, delim))) from None
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            name, value, inner = _located(err["loc"], err.get("input"), prefix, delim)
            lines.append(f"{name}{_shown(name, value)}: {inner + ': ' if inner else ''}{err['msg']}")
        raise SystemExit("ocrstream: invalid settings in the environment:\n  " + "\n  ".join(lines)) from None


def _located(loc: tuple, value: object, prefix: str, delim: str) -> tuple[str, object, str]:
    """``(variable, its value as set, where inside it)`` for an error at ``loc``: the longest variable
    set in the environment that holds it (``OCRSTREAM_CACHE_TTL_BY_TASK`` for an item of its
    JSON, ``OCRSTREAM_MYSQL__PORT`` for that nested field), else the name the field would have."""
    env = {n.upper(): n for n in os.environ}
    parts = [str(p) for p in loc]
    for i in range(len(parts), 0, -1):
        var = env.get((prefix + delim.join(parts[:i])).upper())
        if var is not None:
            return var, os.environ[var], ".".join(parts[i:])
    return (prefix + delim.join(parts)).upper(), value, ""


def _unparsed(exc: SettingsError, prefix: str, delim: str) -> list[str]:
    """The lines for the field a ``SettingsError`` names (its message is ``error parsing value
    for field "F" from source "S"``, pydantic-settings 2.x): its variable if set, else its nested
    ``F__*`` ones, as spelled in the environment."""
    m = re.search(r'field "([^"]+)"', str(exc))
    field = (prefix + m.group(1)).upper() if m else None
    cause = exc.__cause__
    reason = f"not valid JSON ({cause})" if cause is not None else str(exc)
    exact = [n for n in os.environ if field and n.upper() == field]  # the whole field's JSON, if set
    names = exact or sorted(n for n in os.environ if field and n.upper().startswith(field + delim.upper()))
    if not names:
        return [f"{field or prefix + '*'}: {reason}"]
    return [f"{n}{_shown(n, os.environ[n])}: {reason}" for n in names]


def _shown(name: str, value: object) -> str:
    """``='value'`` for an error line, or nothing when the variable's name or its value (a JSON
    section such as ``OCRSTREAM_MYSQL='{"password": ...}'``) mentions a password, secret, token or key.
    Credentials in a URL (``redis://user:pass@host``, RFC 3986 §3.2.1) are shown as ``***``."""
    text = _URL_CREDENTIALS.sub("***@", repr(value))
    return "" if _SECRET.search(name) or _SECRET.search(text) else f"={text}"
