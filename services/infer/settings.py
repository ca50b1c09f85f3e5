"""Infer settings (env prefix ``OCRSTREAM_``)."""

from typing import Literal

from pydantic import Field

from services.common.settings import CommonSettings


class InferSettings(CommonSettings):
    """Settings of the infer stage and its engine."""

    infer_group_id: str = "ocrstream-infer"
    max_batch: int = Field(default=8, ge=1, description="events per micro-batch")
    max_wait_ms: int = Field(default=20, ge=0, description="longest wait for a micro-batch to fill")
    infer_max_poll_interval_ms: int = Field(default=300_000, description="partitions are paused while a batch runs")
    fetch_concurrency: int = Field(default=8, description="S3 gets in flight per batch")
    # RapidOCR (CPU) engine
    rapidocr_threads: int = Field(default=2, description="ONNX Runtime intra-op threads per image")
    rapidocr_workers: int = Field(default=1, description="images in flight per process")
    engine_max_side: int = Field(default=2000, description="longest side (px) handed to the engine; larger is downscaled")
    tile_max_aspect: float = Field(default=3.0, description="pages longer than engine_max_side and longer/shorter above this are sliced into tiles")
    device: str = Field(default="cuda:0", description="GPU engines: the one device this process uses")
    engine_kind: Literal["rapidocr", "vllm", "openai"] | None = Field(
        default=None, description="defaults to engine.engine"
    )
