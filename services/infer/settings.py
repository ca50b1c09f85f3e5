"""Infer settings (env prefix ``OCRSTREAM_``)."""

from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from services.common.cache.keys import CacheKeySettings


class InferSettings(CacheKeySettings):
    """Settings of the infer stage and its engine.

    The engine settings that change results (``engine_kind``, ``engine_max_side``, the VLM
    prompts) are in :class:`CacheKeySettings`: dedup and the HTTP door put them in the cache key.
    """

    infer_group_id: str = Field(default="ocrstream-infer", description="consumer group of the infer stage")
    max_in_flight: int | None = Field(
        default=None, ge=1,
        description="the window: records being fetched, decoded or on the engine at once, each result produced the "
                    "moment its page is done; unset = the engine's slots + a decoded-ahead margin + the interactive "
                    "reserve (rapidocr: workers + 2 + 1; openai: openai_max_concurrency x 1.25; vllm: 2 x "
                    "vllm_max_num_seqs x 1.25; docs/delivery.md)")
    interactive_reserve: int | None = Field(
        default=None, ge=0,
        description="window slots only interactive requests may take, so one starts at once however much bulk work "
                    "waits; each lane holds at most max_in_flight minus this; unset = an eighth of the engine's "
                    "slots, at least 1")
    infer_max_poll_interval_ms: int = Field(default=300_000, ge=1, description="the consumer's max.poll.interval.ms (the window polls without pause)")
    fetch_concurrency: int = Field(default=8, ge=1, description="S3 gets in flight")
    pixel_budget_mb: int = Field(
        default=1024, ge=0,
        description="decoded pixels this process holds at once, MiB (RGB, 3 bytes a pixel; every page of the window "
                    "together); a page that does not fit waits for room (interactive pages first), an image larger "
                    "than all of it runs alone. 0 = no bound")
    engine_crash_limit: int = Field(
        default=2, ge=0,
        description="times the engine's server may go away while reading one image alone (a connection carrying it "
                    "dropped, the retry refused) until that image ends with engine_crash instead of being retried; 0 = retried forever")
    # RapidOCR (CPU) engine
    rapidocr_threads: int = Field(default=1, ge=1, description="ONNX Runtime intra-op threads per image (bench/engine_tuning.py)")
    rapidocr_workers: int = Field(default=2, ge=1, description="pages read at once per process (2 per 2 cores: bench/infer_bench.py)")
    rapidocr_interactive_workers: int = Field(default=1, ge=0, description="threads only interactive pages use, on top of rapidocr_workers: one starts at once instead of waiting for a bulk page to end (0: they take the next free worker first)")
    rapidocr_bulk_nice: int = Field(default=10, ge=0, le=19, description="niceness of the worker threads (Linux): interactive pages and the pipeline's other stages get the cores first, bulk pages the rest (0: unchanged)")
    tile_max_aspect: float = Field(default=3.0, ge=1, description="pages longer than engine_max_side and longer/shorter above this are sliced into tiles")
    device: str = Field(default="cuda:0", description="GPU engines: the one device this process uses")
    # vLLM (in-process, GPU) engine; model default HunyuanOCR. Keep engine.model equal to vllm_model.
    vllm_model: str = Field(default="tencent/HunyuanOCR", description="HF id or local path vLLM loads (no download if cached/local)")
    vllm_revision: str | None = Field(default=None, description="HF revision of vllm_model")
    vllm_dtype: str = Field(default="auto", description="weights/activations dtype as vLLM names it (auto = the model's own, e.g. bfloat16)")
    vllm_gpu_memory_utilization: float = Field(default=0.90, gt=0, le=1, description="fraction (0..1] of the GPU's memory vLLM may take (weights + KV cache)")
    vllm_max_num_seqs: int = Field(default=64, ge=1, description="requests decoded together (the window keeps twice this submitted)")
    vllm_scheduling_policy: Literal["priority", "fcfs"] = Field(default="priority", description="vLLM's scheduling_policy: priority admits interactive pages before bulk ones; fcfs in arrival order")
    vllm_max_model_len: int = Field(default=16384, ge=1, description="prompt (a 2K page is ~4,100 image tokens) + output")
    vllm_max_num_batched_tokens: int = Field(default=32768, ge=1, description="well above one page's tokens, so pages overlap")
    vllm_max_tokens: int = Field(default=4096, ge=1, description="generation cap per image")
    vllm_repetition_penalty: float = Field(default=1.0, gt=0, description="1.0 = off, as vLLM's HunyuanOCR recipe (greedy, top_k 1)")
    vllm_repeat_stop: bool = Field(default=True, description="abort a request whose output ends in a loop (result flagged truncated_repetition)")
    vllm_trust_remote_code: bool = Field(default=True, description="let vLLM/transformers run the model repository's own Python code")
    vllm_enforce_eager: bool = Field(default=False, description="no CUDA graphs (faster start, slower decode)")
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict, description="extra vLLM AsyncEngineArgs (JSON)")
    vllm_sampling_args: dict[str, Any] = Field(default_factory=dict, description="extra vLLM SamplingParams (JSON)")
    vllm_warmup_timeout_s: float = Field(default=600.0, gt=0, description="seconds the warm-up image may take at start-up")
    # OpenAI-compatible server engine (e.g. `vllm serve tencent/HunyuanOCR --no-enable-prefix-caching --mm-processor-cache-gb 0`)
    openai_base_url: str = Field(default="http://127.0.0.1:8000/v1", description="API root of the server (http or https, ending in /v1; no proxy, no redirects)")
    openai_api_key: SecretStr | None = Field(default=None, description="bearer token sent to the server; unset = none")
    openai_model: str = Field(default="tencent/HunyuanOCR", description="model name sent in each request (keep engine.model equal)")
    openai_max_tokens: int = Field(default=4096, ge=1, description="generation cap per image, in tokens")
    openai_timeout_s: float = Field(default=300.0, gt=0, description="seconds one HTTP attempt may wait for its answer (capped by what is left of infer_timeout_s); fires as a timeout result, not retried")
    openai_connect_timeout_s: float = Field(default=10.0, gt=0, description="seconds to open a connection; past it the server counts as unreachable")
    openai_retries: int = Field(default=3, ge=1, description="attempts per image, the first included (1 = no retry), on 5xx, 429, unreachable server, dropped connection")
    openai_backoff_s: float = Field(default=0.5, ge=0, description="seconds before the first retry, doubling (at most 8 s), each wait drawn from half to all of it")
    openai_retry_after_max_s: float = Field(default=30.0, ge=0, description="cap in seconds on a 429/503's Retry-After, which replaces the backoff")
    openai_max_concurrency: int = Field(default=32, ge=1, description="requests in flight to the server (one per page or tile): the server's concurrency, from which the window is sized")
    openai_send_priority: bool = Field(default=False, description="send each page's lane as vLLM's request priority (0 interactive, 1 bulk); only for a server started with --scheduling-policy priority")
    openai_ready_timeout_s: float = Field(default=900.0, gt=0, description="seconds to wait for the server at start-up")
    openai_image_format: Literal["png", "jpeg"] = Field(default="png", description="encoding of the inline image (png lossless, jpeg quality 95)")
    openai_repetition_penalty: float = Field(default=1.0, gt=0, description="1.0 = off, as vLLM's HunyuanOCR recipe")
    openai_extra_body: dict[str, Any] = Field(default_factory=dict, description="extra request fields (JSON)")

    @model_validator(mode="after")
    def _reserve_below_window(self) -> "InferSettings":
        if self.max_in_flight is not None and self.interactive_reserve is not None \
                and self.interactive_reserve >= self.max_in_flight:
            raise ValueError(f"interactive_reserve ({self.interactive_reserve}) must be below max_in_flight "
                             f"({self.max_in_flight}): each lane holds at most max_in_flight - interactive_reserve")
        return self

    def window(self, engine_slots: int) -> tuple[int, int]:
        """``(max_in_flight, interactive_reserve)`` for an engine of ``engine_slots`` slots
        (:attr:`OcrEngine.slots`): the settings where set, else the slots plus a decoded-ahead
        margin (an eighth of them, at least 2: no slot waits for S3 or decoding) plus the
        interactive reserve (an eighth of them, at least 1, and below ``max_in_flight``).

        Raises:
            ValueError: a reserve that leaves a lane no slot (each lane holds at most
                ``max_in_flight - interactive_reserve``).
        """
        reserve = self.interactive_reserve
        if self.max_in_flight:
            size = self.max_in_flight
            if reserve is None:
                reserve = min(max(1, engine_slots // 8), size - 1)
        else:
            if reserve is None:
                reserve = max(1, engine_slots // 8)
            size = engine_slots + max(2, engine_slots // 8) + reserve
        if size - reserve < 1:
            raise ValueError(f"interactive_reserve {reserve} leaves no slot of max_in_flight {size} to a lane")
        return size, reserve
