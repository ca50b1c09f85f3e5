"""Dedup settings (env prefix ``OCRSTREAM_``)."""

from pydantic import BaseModel, Field

from services.common.cache.neardup import VerifyParams
from services.common.cache.keys import CacheKeySettings


class NearDupSettings(BaseModel):
    """Near-duplicate lookup (off by default): a re-encoded or rescaled copy of an image already
    done is answered from that image's result, boxes rescaled. Candidates come from a
    perceptual hash; each is verified window by window (``services/common/cache/neardup.py``), so
    two documents of one template that differ in one digit never match."""

    enabled: bool = Field(default=False, description="look up near duplicates on an exact miss (fetches and decodes the image in dedup)")
    max_hamming: int = Field(default=8, ge=0, le=16, description="pHash bits (of 64) a candidate may differ in")
    max_candidates: int = Field(default=3, ge=1, description="candidates verified per request, closest hash first")
    bucket_size: int = Field(default=64, ge=1, description="newest images kept per LSH bucket (8 buckets per image)")
    index_ttl_s: int = Field(default=86_400, ge=1, description="an LSH bucket expires this long after its last write, s")
    max_image_bytes: int = Field(default=20 * 1024 * 1024, ge=0, description="larger images are not looked up (bytes)")
    block_px: int = Field(default=8, ge=2, description="verification window side, px of the compared page")
    max_block_diff: float = Field(default=12.0, gt=0, description="largest L4-mean grey difference (0-255) of any window")
    blur_radius: float = Field(default=1.0, ge=0, description="Gaussian blur (px) before comparing")
    max_aspect_diff: float = Field(default=0.01, ge=0, description="largest relative error of the shorter side predicted by the other image's aspect ratio (1 px always allowed)")
    max_scale_ratio: float = Field(default=1.5, ge=1, description="largest width ratio of the two images")
    min_compare_side: int = Field(default=256, ge=1, description="pages whose longer side is shorter are never matched, px")

    def verify_params(self) -> VerifyParams:
        """The verification thresholds as :class:`VerifyParams`."""
        return VerifyParams(
            block_px=self.block_px, max_block_diff=self.max_block_diff, blur_radius=self.blur_radius,
            max_aspect_diff=self.max_aspect_diff, max_scale_ratio=self.max_scale_ratio,
            min_compare_side=self.min_compare_side,
        )


class DedupSettings(CacheKeySettings):
    """Settings of the dedup stage."""

    dedup_group_id: str = Field(default="ocrstream-dedup", description="consumer group of the dedup stage")
    dedup_max_batch: int = Field(default=64, ge=1, description="records per batch")
    dedup_max_wait_ms: int = Field(
        default=0, ge=0,
        description="longest wait for a batch to fill, ms; 0 = take what has arrived (a backlog still makes full batches)")
    lru_entries: int = Field(default=10_000, ge=0, description="in-process LRU in front of Redis: entries")
    lru_bytes: int = Field(default=8 * 1024 * 1024, ge=0, description="in-process LRU in front of Redis: bytes")
    lru_ttl_s: float = Field(default=60.0, gt=0, allow_inf_nan=False, description="in-process LRU: entry age limit, s (bounds how long a purge takes to reach dedup)")
    max_waiters: int = Field(
        default=1000, ge=0,
        description="copies of one image waiting on its computation held in memory (per cache key); a copy past it "
                    "waits in the changelog only and is read back when the key settles (never computed again)")
    settled_window_s: float = Field(
        default=600.0, ge=0, allow_inf_nan=False,
        description="a cache key settled this long ago is still answered from dedup's state (no Redis or S3 call; "
                    "also when Redis is down), s")
    settled_max_keys: int = Field(
        default=100_000, ge=0,
        description="settled keys kept per partition for that window; past it the oldest goes first")
    s3_tier_timeout_ms: int = Field(
        default=500, ge=1,
        description="time budget of the S3 tier lookup (HEAD of the stored result document) on a Redis miss, ms; "
                    "past it the request goes to inference")
    fence_refresh_s: float = Field(
        default=5.0, gt=0, allow_inf_nan=False,
        description="how often dedup re-reads a generation's purge fence in S3, s (bounds how long a "
                    "`cache purge` takes to reach the S3 tier and the settled window)")
    restore_timeout_s: float = Field(
        default=120.0, gt=0, allow_inf_nan=False,
        description="bound on restoring the state of newly assigned partitions from the changelog, s (retried)")
    near_dup: NearDupSettings = NearDupSettings()
