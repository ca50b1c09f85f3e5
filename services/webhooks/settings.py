"""Webhooks stage settings (env prefix ``OCRSTREAM_``)."""

from pydantic import Field

from services.common.webhooks.settings import CallbackSettings


class WebhooksSettings(CallbackSettings):
    """Settings of ``python -m services.webhooks``: its consumer group, and how callbacks are tried."""

    webhook_group_id: str = Field(default="ocrstream-webhooks", description="consumer group of the webhooks stage "
                                  "(also owns its webhook_deliveries rows)")
    webhook_max_batch: int = Field(default=500, ge=1, description="completions per batch")
    webhook_max_wait_ms: int = Field(
        default=0, ge=0,
        description="longest wait for a batch to fill, ms; 0 = take what has arrived (a backlog still makes full batches)")
    webhook_timeout_s: float = Field(default=10.0, gt=0, description="per-attempt timeout of a callback, s")
    webhook_retry_for_s: float = Field(default=3_600.0, gt=0, description="how long a failing callback is retried, s")
    webhook_backoff_base_s: float = Field(
        default=1.0, gt=0, description="delay before the first retry of a callback, doubled per attempt (with jitter), s"
    )
    webhook_backoff_max_s: float = Field(default=300.0, gt=0, description="longest delay between callback attempts, s")
    webhook_concurrency: int = Field(default=16, ge=1, description="callback attempts in flight at once per process")
    webhook_poll_interval_s: float = Field(
        default=1.0, gt=0, description="how often the delivery loop looks for due callbacks, s"
    )
    webhook_retention_days: float = Field(
        default=7.0, ge=0, le=3650,
        description="delivered/failed callbacks (and their attempts) are deleted this long after creation; 0 = kept"
    )
    webhook_purge_interval_s: float = Field(default=3_600.0, gt=0, description="how often old callback rows are deleted, s")
