"""Settings shared by every stage, read from ``OCRSTREAM_*`` environment variables.

Nested sections use a double underscore: ``OCRSTREAM_KAFKA__BOOTSTRAP_SERVERS``,
``OCRSTREAM_S3__BUCKET``. Defaults work against the local stack of ``deploy/local/up.sh``.
Each stage subclasses :class:`CommonSettings` with its own fields; settings are built once
at start-up and passed explicitly (never read from ``os.environ`` deep in the code).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.keys import CacheGeneration
from schemas.topics import Topics


class KafkaSettings(BaseModel):
    """Kafka connection, producer and consumer-group settings (aiokafka)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    partitions: int = Field(default=4, ge=1, description="partitions per topic created by `ocrstream init`")
    replication_factor: int = Field(default=1, ge=1)
    acks: Literal["all", "1", "0"] = "all"
    enable_idempotence: bool = True
    linger_ms: int = 2
    max_request_size: int = Field(default=1_048_576, description="bytes; the broker's default message limit")
    session_timeout_ms: int = 30_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    request_timeout_ms: int = 30_000


class S3Settings(BaseModel):
    """S3-compatible object store holding images (by content hash) and result documents."""

    endpoint_url: str | None = "http://127.0.0.1:9000"
    access_key: str = "ocrstream"
    secret_key: SecretStr = SecretStr("ocrstream-secret")
    region: str = "us-east-1"
    bucket: str = "ocrstream"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_pool_connections: int = 32


class RedisSettings(BaseModel):
    """Redis holding the result cache, in-flight leases and waiters."""

    url: str = "redis://127.0.0.1:6379/0"
    password: SecretStr | None = None
    timeout_ms: int = Field(default=100, ge=1, description="time budget of every Redis call")
    key_prefix: str = "ocr"


class MySQLSettings(BaseModel):
    """MariaDB/MySQL holding the requests and results tables."""

    host: str = "127.0.0.1"
    port: int = 3306
    user: str = "ocrstream"
    password: SecretStr = SecretStr("ocrstream")
    database: str = "ocrstream"
    connect_timeout_s: float = 5.0


class TelemetrySettings(BaseModel):
    """Logging, metrics and tracing."""

    log_level: str = "INFO"
    metrics_port: int | None = Field(default=None, description="port for /metrics, /healthz, /readyz; None = off")
    traces_exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str | None = None


class EngineIdentity(BaseModel):
    """Which engine and model produce results; part of every cache key.

    dedup and infer must agree on these: they decide the cache generation.
    """

    engine: Literal["rapidocr", "vllm", "openai"] = "rapidocr"
    model: str = "PP-OCRv4-ch"
    model_revision: str = "rapidocr-onnxruntime-1.4.4"
    preprocess_version: int = Field(default=1, description="bump when decoding/preprocessing changes results")

    def generation(self, task: str) -> CacheGeneration:
        """The cache generation for ``task`` under this engine identity."""
        return CacheGeneration(
            engine=self.engine,
            model=self.model,
            model_revision=self.model_revision,
            task=task,
            preprocess_version=self.preprocess_version,
        )


class Limits(BaseModel):
    """Limits that protect the service; each is enforced at the earliest stage that can."""

    max_image_bytes: int = Field(default=50 * 1024 * 1024, description="bytes per upload (ingest)")
    max_pixels: int = Field(default=100_000_000, description="width x height per page, from the header")
    max_pages: int = Field(default=20, description="pages/frames per multi-page input")
    infer_timeout_s: float = Field(default=300.0, description="per-image inference time")
    inline_max_bytes: int = Field(default=700 * 1024, description="largest image sent inline on ocr.submit")


class CommonSettings(BaseSettings):
    """Settings every stage has. Env prefix ``OCRSTREAM_``, nested delimiter ``__``."""

    model_config = SettingsConfigDict(
        env_prefix="OCRSTREAM_", env_nested_delimiter="__", extra="ignore", frozen=True
    )

    kafka: KafkaSettings = KafkaSettings()
    s3: S3Settings = S3Settings()
    redis: RedisSettings = RedisSettings()
    mysql: MySQLSettings = MySQLSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    topics: Topics = Topics()
    engine: EngineIdentity = EngineIdentity()
    limits: Limits = Limits()
    max_attempts: int = Field(default=3, ge=1, description="attempts before a message goes to ocr.dlq")
    shutdown_timeout_s: float = Field(default=20.0, description="SIGTERM drain bound; below k8s grace period")
    retry_max_backoff_s: float = Field(default=10.0, description="cap of the backoff while a store is down")
