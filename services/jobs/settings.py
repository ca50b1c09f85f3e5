"""Jobs stage settings (env prefix ``OCRSTREAM_``)."""

from pydantic import Field

from services.common.settings import CommonSettings


class JobsSettings(CommonSettings):
    """Settings of the jobs stage."""

    jobs_group_id: str = Field(default="ocrstream-jobs", description="consumer group of the jobs stage")
    jobs_max_batch: int = Field(default=256, ge=1, description="records per batch (completions and job events)")
    jobs_max_wait_ms: int = Field(
        default=0, ge=0,
        description="longest wait for a batch to fill, ms; 0 = take what has arrived (a backlog still makes full batches)")
