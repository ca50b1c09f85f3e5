"""An OCR VLM behind an OpenAI-compatible server (``vllm serve tencent/HunyuanOCR ...``).

HTTP goes through the standard library (``urllib.request``) in a thread pool: the project has
no async HTTP client dependency, and one request per image with the image inline makes the
connection set-up negligible next to the generation. Each image is one chat-completions call;
all images of a batch are in flight at once (up to ``max_concurrency``), so the server's
continuous batching sees the whole micro-batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from schemas.events import WARNING_TRUNCATED_MAX_TOKENS
from services.infer.engines import hunyuan
from services.infer.engines.base import EngineOutput, EngineTimeout, OcrEngine

log = logging.getLogger(__name__)


class ServerError(Exception):
    """The server answered with an error status (``status`` holds it)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _retryable(exc: BaseException) -> bool:
    """5xx, 429 and connection failures are retried; 4xx, bad answers and timeouts are not."""
    if isinstance(exc, ServerError):
        return exc.status >= 500 or exc.status == 429
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return False
    if isinstance(exc, urllib.error.URLError):
        return not isinstance(exc.reason, (socket.timeout, TimeoutError))
    return isinstance(exc, (ConnectionError, http_client_errors()))


def http_client_errors() -> tuple[type[BaseException], ...]:
    import http.client

    return (http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine)


class OpenAiEngine(OcrEngine):
    """Chat-completions client for an OCR VLM server.

    Args:
        base_url: API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: Model name the server serves.
        api_key: Bearer token, if the server wants one.
        prompt: The instruction (default: HunyuanOCR's text-spotting prompt).
        max_tokens: Generation cap per image.
        request_timeout_s: Socket timeout of one HTTP attempt (also capped by what is left of
            the image's own timeout).
        retries: Attempts per image on 5xx/429/connection errors, with exponential backoff.
        backoff_s: First backoff; doubles per attempt, at most ``backoff_max_s``.
        max_concurrency: Requests in flight per process.
        ready_timeout_s: How long :meth:`start` waits for the server to answer.
        image_format: ``png`` (lossless) or ``jpeg`` for the inline image.
        repetition_penalty: Sent as vLLM's ``repetition_penalty`` extra (1.0 = off, as vLLM's
            HunyuanOCR recipe, which also sends ``top_k`` 1 with temperature 0).
        max_side: Longest image side in pixels handed to the server (the infer stage
            downscales or tiles larger pages); default
            :data:`~services.infer.engines.hunyuan.VLM_MAX_SIDE`.
        extra_body: More request fields (merged last).

    An answer cut at ``max_tokens`` (``finish_reason`` "length") carries the warning
    ``truncated_max_tokens``; one whose text ends in a runaway loop (trimmed by the parser)
    carries ``truncated_repetition``.
    """

    name = "openai"
    max_side = hunyuan.VLM_MAX_SIDE

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str = "tencent/HunyuanOCR",
        *,
        api_key: str | None = None,
        prompt: str = hunyuan.SPOTTING_PROMPT,
        max_tokens: int = 4096,
        request_timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_concurrency: int = 32,
        ready_timeout_s: float = 900.0,
        ready_poll_s: float = 2.0,
        warmup_timeout_s: float = 300.0,
        image_format: str = "png",
        repetition_penalty: float = hunyuan.DEFAULT_REPETITION_PENALTY,
        max_side: int | None = None,
        extra_body: dict[str, Any] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.request_timeout_s = request_timeout_s
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_concurrency = max_concurrency
        self.ready_timeout_s = ready_timeout_s
        self.ready_poll_s = ready_poll_s
        self.warmup_timeout_s = warmup_timeout_s
        self.image_format = image_format
        self.repetition_penalty = repetition_penalty
        if max_side:
            self.max_side = max_side
        self.extra_body = dict(extra_body or {})
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="openai-ocr")
        self._slots = asyncio.Semaphore(max_concurrency)

    @classmethod
    def from_settings(cls, s) -> OpenAiEngine:
        """Build from :class:`~services.infer.settings.InferSettings`."""
        if s.engine.model != s.openai_model:  # this engine runs whatever engine.engine says
            log.warning("openai: engine.model=%r (the cache key) differs from openai_model=%r (what is asked)",
                        s.engine.model, s.openai_model)
        key = s.openai_api_key.get_secret_value() if s.openai_api_key is not None else None
        return cls(
            s.openai_base_url, s.openai_model, api_key=key, prompt=s.openai_prompt,
            max_tokens=s.openai_max_tokens, request_timeout_s=s.openai_timeout_s, retries=s.openai_retries,
            backoff_s=s.openai_backoff_s, max_concurrency=s.openai_max_concurrency,
            ready_timeout_s=s.openai_ready_timeout_s, image_format=s.openai_image_format,
            repetition_penalty=s.openai_repetition_penalty, max_side=s.engine_max_side, extra_body=s.openai_extra_body,
        )

    # ------------------------------------------------------------------ HTTP (in threads)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _request(self, method: str, url: str, body: bytes | None, timeout: float) -> Any:
        req = urllib.request.Request(url, data=body, method=method, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                data = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", "replace") if err.fp else ""
            raise ServerError(err.code, detail or str(err.reason)) from None
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return data.decode("utf-8", "replace")

    def _health_urls(self) -> list[str]:
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        return [f"{root}/health", f"{self.base_url}/models"]

    def _probe(self) -> str | None:
        """The first readiness URL that answers 2xx, else None."""
        for url in self._health_urls():
            try:
                self._request("GET", url, None, timeout=5.0)
                return url
            except Exception:
                continue
        return None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Wait until the server answers ``/health`` or ``/v1/models``, then a warm-up image."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            url = await loop.run_in_executor(self._pool, self._probe)
            if url:
                log.info("openai: %s answers", url)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"OCR server at {self.base_url} not ready after {self.ready_timeout_s:g} s")
            await asyncio.sleep(self.ready_poll_s)
        warm = np.full((96, 384, 3), 255, dtype=np.uint8)
        warm[40:56, 24:340] = 0
        (res,) = await self.ocr([warm], timeout_s=self.warmup_timeout_s)
        if isinstance(res, BaseException):
            raise RuntimeError(f"openai warm-up failed: {res!r}") from res
        self.ready = True

    async def health(self) -> bool:
        """True when started and the server still answers."""
        if not self.ready:
            return False
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._probe) is not None

    async def close(self) -> None:
        """Stop the HTTP threads (requests in flight finish in the background)."""
        self.ready = False
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ inference

    def payload(self, image: np.ndarray) -> dict[str, Any]:
        """The chat-completions request body for one image."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": hunyuan.build_messages(image, self.prompt, self.image_format),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": hunyuan.DEFAULT_TOP_K,
            "repetition_penalty": self.repetition_penalty,
            "skip_special_tokens": True,
            "stream": False,
        }
        body.update(self.extra_body)
        return body

    async def _call(self, image: np.ndarray, deadline: float) -> tuple[str, tuple[str, ...]]:
        """One chat-completions call (retried on 5xx/429/connection errors); returns the answer
        text and its warnings (``truncated_max_tokens`` when ``finish_reason`` is "length")."""
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self._pool, lambda: json.dumps(self.payload(image)).encode())
        url = f"{self.base_url}/chat/completions"
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.retries),
            wait=wait_exponential(multiplier=self.backoff_s, max=self.backoff_max_s),
            retry=retry_if_exception(_retryable),
            reraise=True,
        ):
            with attempt:
                timeout = max(0.1, min(self.request_timeout_s, deadline - time.monotonic()))
                answer = await loop.run_in_executor(self._pool, self._request, "POST", url, body, timeout)
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
        except (TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"unexpected answer from {url}: {str(answer)[:200]}") from exc
        if choice.get("finish_reason") == "length":
            log.info("openai: answer cut at max_tokens=%d; parsing what came", self.max_tokens)
            return text, (WARNING_TRUNCATED_MAX_TOKENS,)
        return text, ()

    async def _one(self, image: np.ndarray, timeout_s: float) -> EngineOutput | BaseException:
        h, w = image.shape[:2]
        padded = hunyuan.pad_for_vlm(image)
        ph, pw = padded.shape[:2]
        async with self._slots:
            started = time.perf_counter()
            try:
                text, warnings = await asyncio.wait_for(self._call(padded, time.monotonic() + timeout_s), timeout_s)
            except (asyncio.TimeoutError, socket.timeout):
                return EngineTimeout(f"inference took longer than {timeout_s:g} s")
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, (socket.timeout, TimeoutError)):
                    return EngineTimeout(f"inference took longer than {timeout_s:g} s")
                return exc
            except Exception as exc:
                return exc
        return hunyuan.answer_to_output(text, (pw, ph), (w, h), warnings, started)

    async def ocr(self, images: list[np.ndarray], timeout_s: float) -> list[EngineOutput | BaseException]:
        """See :meth:`OcrEngine.ocr`. A timed-out image's HTTP thread ends at its socket timeout
        (at most what was left of ``timeout_s``) and its answer is discarded."""
        return list(await asyncio.gather(*(self._one(img, timeout_s) for img in images)))
