"""An OCR VLM behind an OpenAI-compatible server (``vllm serve tencent/HunyuanOCR ...``).

HTTP goes through the standard library (``http.client``) in a thread pool (the project has no
async HTTP client dependency, and one request per image with the image inline makes the
connection set-up negligible next to the generation); attempts are driven by tenacity. Each page is
one chat-completions call (:meth:`OpenAiEngine.page`); the infer window keeps up to
``max_concurrency`` of them in flight, so the server's continuous batching always has work.
Requests go straight to the URL: no proxy, no redirects.

Failures, after the attempts (``retries``, jittered exponential backoff, ``Retry-After``
honoured on 429/503):

* the server cannot be reached (connection refused, DNS failure, connect or TLS timeout):
  :class:`~services.infer.engines.base.EngineUnavailable` (retriable: the infer window backs off
  and reads the record again, nothing past it is committed) and :attr:`OpenAiEngine.ready` is
  False until the server answers again;
* the server answered with an error status: that page's :class:`ServerError` (an
  ``engine_error`` result), the other pages are unaffected;
* no answer within one attempt's socket timeout: that page's :class:`AttemptTimeout`.
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import json
import logging
import random
import socket
import ssl
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from schemas.reading import WARNING_TRUNCATED_MAX_TOKENS
from services.common.cache.prompts import SPOTTING_PROMPT
from services.infer.engines import dialects, hunyuan, hunyuan_prompts
from schemas.lanes import Priority
from services.common.errors import OcrstreamError
from services.infer.engines.base import (OCR, EngineOutput, EngineTask, EngineTimeout, EngineUnavailable, OcrEngine,
                                          tasks_of)
from services.infer.engines.slots import PrioritySlots

log = logging.getLogger(__name__)


class ServerError(OcrstreamError):
    """The server answered with an error status (``status`` holds it; ``retry_after`` the
    seconds its ``Retry-After`` header asked for, or None)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.retry_after = retry_after


class Unreachable(OcrstreamError, ConnectionError):
    """No connection to the server could be made (refused, DNS failure, connect/TLS timeout).
    ``took_down`` is set when an earlier attempt for the same image reached the server and lost
    its connection mid-exchange: the server went away while it held that image."""

    retriable = True
    took_down = False


class AttemptTimeout(EngineTimeout):
    """One HTTP attempt got no answer within its socket timeout (``openai_timeout_s``, or what
    was left of the image's inference timeout when that was shorter)."""


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delay-seconds or an HTTP-date (RFC 9110
    section 10.2.3); None when absent or unreadable; never negative."""
    if not value or not value.strip():
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _retryable(exc: BaseException) -> bool:
    """5xx, 429, unreachable and dropped connections are retried; 4xx, bad answers and
    timeouts are not."""
    if isinstance(exc, ServerError):
        return exc.status >= 500 or exc.status == 429
    if isinstance(exc, (AttemptTimeout, socket.timeout, TimeoutError)):
        return False
    return isinstance(exc, (ConnectionError, http.client.HTTPException))


class OpenAiEngine(OcrEngine):
    """Chat-completions client for an OCR VLM server.

    Args:
        base_url: API root, e.g. ``http://127.0.0.1:8000/v1`` (``http`` or ``https``).
        model: Model name the server serves.
        api_key: Bearer token, if the server wants one.
        prompt: The instruction (default: HunyuanOCR's text-spotting prompt).
        max_tokens: Generation cap per image, in tokens.
        request_timeout_s: Socket timeout in seconds of one HTTP attempt, from sending the
            request to the end of the answer (also capped by what is left of the image's own
            timeout). When it fires the image gets :class:`AttemptTimeout`; it is not retried.
        connect_timeout_s: Time limit in seconds to open the connection (TCP and TLS); when it
            fires the server counts as unreachable.
        retries: Attempts per image (1 = no retry; the name is the setting's,
            ``openai_retries``). 5xx, 429, unreachable server and dropped connections are
            retried.
        backoff_s: First backoff in seconds; doubles per attempt, at most ``backoff_max_s``;
            each wait is drawn uniformly from half to all of that (jitter).
        retry_after_max_s: Cap in seconds on a 429/503 answer's ``Retry-After``, which
            replaces the backoff for that wait. No attempt starts that could not end before the
            image's timeout.
        max_concurrency: Cap on the requests in flight, all pages together (the server's
            concurrency: the infer window is sized from it); also the HTTP thread count.
        ready_timeout_s: How long :meth:`start` waits for the server to answer, in seconds.
        ready_poll_s: Seconds between those checks.
        probe_timeout_s: Socket timeout in seconds of one readiness check (``/health``, then
            ``/v1/models``).
        warmup_timeout_s: Time limit in seconds of the warm-up image in :meth:`start`.
        image_format: ``png`` (lossless) or ``jpeg`` for the inline image.
        repetition_penalty: Sent as vLLM's ``repetition_penalty`` extra (1.0 = off, as vLLM's
            HunyuanOCR recipe, which also sends ``top_k`` 1 with temperature 0).
        max_side: Longest image side in pixels handed to the server (the infer stage
            downscales or tiles larger pages); default
            :data:`~services.infer.engines.hunyuan_prompts.VLM_MAX_SIDE`.
        extra_body: More request fields (merged last).
        send_priority: Send each request's lane as vLLM's ``priority`` field (0 interactive, 1
            bulk). Only for a server started with ``--scheduling-policy priority``: vLLM refuses
            a non-zero priority otherwise.
        dialect: Prompts, sampling and parsers of the tasks other than ``ocr``
            (:mod:`services.infer.engines.dialects`: ``auto``, ``hunyuan``, ``generic``). Task
            ``ocr`` always sends ``prompt`` with the sampling above; another task sends the
            dialect's instruction and sampling, ``max_tokens`` the smaller of the dialect's for
            the task and this engine's.

    An answer cut at ``max_tokens`` (``finish_reason`` "length") carries the warning
    ``truncated_max_tokens``; one whose text ends in a runaway loop (trimmed by the parser)
    carries ``truncated_repetition``; a non-empty one with no readable entry carries
    ``unparsed_output`` (see :func:`~services.infer.engines.hunyuan.answer_to_output`).

    Readiness: :attr:`ready` is True once :meth:`start` succeeded and while the server is
    reachable. It turns False when a call finds the server unreachable, or when
    :meth:`health` (polled by the infer stage for ``/readyz``) gets no answer, and True again
    at the next answer of either.
    """

    name = "openai"
    tasks = tasks_of("openai")
    max_side = hunyuan_prompts.VLM_MAX_SIDE

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str = "tencent/HunyuanOCR",
        *,
        api_key: str | None = None,
        prompt: str = SPOTTING_PROMPT,
        max_tokens: int = 4096,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        retry_after_max_s: float = 30.0,
        max_concurrency: int = 32,
        ready_timeout_s: float = 900.0,
        ready_poll_s: float = 2.0,
        probe_timeout_s: float = 2.0,
        warmup_timeout_s: float = 300.0,
        image_format: str = "png",
        repetition_penalty: float = hunyuan_prompts.DEFAULT_REPETITION_PENALTY,
        max_side: int | None = None,
        extra_body: dict[str, Any] | None = None,
        dialect: str = "auto",
        send_priority: bool = False,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.retry_after_max_s = retry_after_max_s
        self.max_concurrency = max(1, max_concurrency)
        self.ready_timeout_s = ready_timeout_s
        self.ready_poll_s = ready_poll_s
        self.probe_timeout_s = probe_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self.image_format = image_format
        self.repetition_penalty = repetition_penalty
        if max_side:
            self.max_side = max_side
        self.extra_body = dict(extra_body or {})
        self.dialect = dialects.dialect(dialect, model)
        self.send_priority = send_priority
        self._started = False
        self._reachable = True
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="openai-ocr")
        self._slots = PrioritySlots(self.max_concurrency)  # HTTP requests in flight, interactive pages first
        # readiness checks never queue behind long generations
        self._probe_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openai-probe")

    @property
    def ready(self) -> bool:  # type: ignore[override]
        """Started, and the server answered the last call or check."""
        return self._started and self._reachable

    @ready.setter
    def ready(self, value: bool) -> None:
        self._started = bool(value)

    @classmethod
    def from_settings(cls, s) -> OpenAiEngine:
        """Build from :class:`~services.infer.settings.InferSettings`."""
        if s.engine.model != s.openai_model:  # this engine runs whatever engine.engine says
            log.warning("openai: engine.model=%r (the cache key) differs from openai_model=%r (what is asked)",
                        s.engine.model, s.openai_model)
        key = s.openai_api_key.get_secret_value() if s.openai_api_key is not None else None
        return cls(
            s.openai_base_url, s.openai_model, api_key=key, prompt=s.openai_prompt,
            max_tokens=s.openai_max_tokens, request_timeout_s=s.openai_timeout_s,
            connect_timeout_s=s.openai_connect_timeout_s, retries=s.openai_retries,
            backoff_s=s.openai_backoff_s, retry_after_max_s=s.openai_retry_after_max_s,
            max_concurrency=s.openai_max_concurrency, ready_timeout_s=s.openai_ready_timeout_s,
            image_format=s.openai_image_format,
            repetition_penalty=s.openai_repetition_penalty, max_side=s.engine_max_side, extra_body=s.openai_extra_body,
            dialect=s.vlm_dialect, send_priority=s.openai_send_priority,
        )

    # ------------------------------------------------------------------ HTTP (in threads)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _request(self, method: str, url: str, body: bytes | None, timeout: float) -> Any:
        """One HTTP exchange; the answer's JSON (or text, or None when empty).

        Raises:
            Unreachable: no connection within ``min(connect_timeout_s, timeout)`` s.
            AttemptTimeout: no (complete) answer within ``timeout`` s.
            ServerError: an answer with status >= 400.
            ConnectionError, http.client.HTTPException: the connection broke mid-exchange.
        """
        u = urllib.parse.urlsplit(url)
        connect_timeout = max(0.05, min(self.connect_timeout_s, timeout))
        if u.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                u.hostname, u.port, timeout=connect_timeout, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=connect_timeout)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            try:
                conn.connect()
            except OSError as exc:  # refused, DNS (socket.gaierror), connect/TLS timeout
                raise Unreachable(f"cannot connect to {u.scheme}://{u.netloc}: {exc or type(exc).__name__}") from exc
            conn.sock.settimeout(timeout)
            try:
                conn.request(method, path, body=body, headers=self._headers())
                resp = conn.getresponse()
                data = resp.read()
            except (socket.timeout, TimeoutError) as exc:
                raise AttemptTimeout(
                    f"no answer from {u.scheme}://{u.netloc} within the {timeout:g} s socket timeout of one attempt"
                ) from exc
        finally:
            conn.close()
        if resp.status >= 400:
            detail = data[:300].decode("utf-8", "replace")
            raise ServerError(resp.status, detail or (resp.reason or ""),
                              retry_after=parse_retry_after(resp.getheader("Retry-After")))
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
                self._request("GET", url, None, timeout=self.probe_timeout_s)
                return url
            except Exception:
                continue
        return None

    def _mark(self, reachable: bool, why: object = None) -> None:
        if reachable != self._reachable and self._started:
            if reachable:
                log.info("openai: %s answers again: ready", self.base_url)
            else:
                log.warning("openai: %s unreachable (%s): not ready", self.base_url, why)
        self._reachable = reachable

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Wait until the server answers ``/health`` or ``/v1/models``, then a warm-up image.

        Raises:
            RuntimeError: the server did not answer within ``ready_timeout_s``, or the warm-up
                image failed (its error chained).
        """
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            url = await loop.run_in_executor(self._probe_pool, self._probe)
            if url:
                log.info("openai: %s answers", url)
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"OCR server at {self.base_url} not ready after {self.ready_timeout_s:g} s")
            await asyncio.sleep(self.ready_poll_s)
        warm = np.full((96, 384, 3), 255, dtype=np.uint8)
        warm[40:56, 24:340] = 0
        try:
            await self.page(warm, OCR, timeout_s=self.warmup_timeout_s)
        except Exception as exc:
            raise RuntimeError(f"openai warm-up failed: {exc!r}") from exc
        self._reachable = True
        self._started = True

    async def health(self) -> bool:
        """True when started and the server answers ``/health`` or ``/v1/models`` now; also
        sets :attr:`ready` (False while it does not answer)."""
        if not self._started:
            return False
        url = await asyncio.get_running_loop().run_in_executor(self._probe_pool, self._probe)
        self._mark(url is not None, "no answer to " + " or ".join(self._health_urls()))
        return url is not None

    async def close(self) -> None:
        """Stop the HTTP threads (requests in flight finish in the background)."""
        self._started = False
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ inference

    def payload(self, image: np.ndarray, task: EngineTask = OCR, lane: Priority = "bulk") -> dict[str, Any]:
        """The chat-completions request body for one image and ``task`` (see the class's
        ``dialect``); with ``send_priority``, ``priority`` 0 for an interactive page and 1 for a
        bulk one (vLLM's request priority, lower first: ``vllm serve --scheduling-policy priority``)."""
        if task.name == "ocr":
            prompt, max_tokens, top_p = self.prompt, self.max_tokens, 1.0
            extras: dict[str, Any] = {"top_k": hunyuan_prompts.DEFAULT_TOP_K, "repetition_penalty": self.repetition_penalty}
            temperature = 0.0
        else:
            sp = self.dialect.sampling(task)
            prompt, max_tokens, top_p, temperature = sp.prompt, min(sp.max_tokens, self.max_tokens), sp.top_p, sp.temperature
            extras = {k: v for k, v in (("top_k", sp.top_k), ("repetition_penalty", sp.repetition_penalty)) if v is not None}
        body: dict[str, Any] = {
            "model": self.model,
            "messages": hunyuan_prompts.build_messages(image, prompt, self.image_format),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            **extras,
            "skip_special_tokens": True,
            "stream": False,
        }
        if self.send_priority:
            body["priority"] = 0 if lane == "interactive" else 1
        body.update(self.extra_body)
        return body

    def _delay(self, attempt: int, exc: BaseException) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): a 429/503's
        ``Retry-After`` (at most ``retry_after_max_s``), else the jittered exponential backoff."""
        if isinstance(exc, ServerError) and exc.status in (429, 503) and exc.retry_after is not None:
            return min(self.retry_after_max_s, exc.retry_after)
        base = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)

    async def _call(self, image: np.ndarray, deadline: float, task: EngineTask = OCR,
                    lane: Priority = "bulk") -> tuple[str, tuple[str, ...]]:
        """One chat-completions call, attempted up to ``retries`` times (see :func:`_retryable`);
        returns the answer text and its warnings (``truncated_max_tokens`` when
        ``finish_reason`` is "length"). Raises the last attempt's error."""
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self._pool, lambda: json.dumps(self.payload(image, task, lane)).encode())
        url = f"{self.base_url}/chat/completions"

        dropped = False  # a connection carrying this image broke mid-exchange (the server went away under it)

        async def attempt() -> Any:
            nonlocal dropped
            timeout = max(0.1, min(self.request_timeout_s, deadline - time.monotonic()))
            try:
                return await loop.run_in_executor(self._pool, self._request, "POST", url, body, timeout)
            except AttemptTimeout:
                if timeout < self.request_timeout_s:  # the socket timeout was what was left of the image's
                    raise asyncio.TimeoutError() from None
                raise
            except Exception as exc:
                if not isinstance(exc, Unreachable):
                    self._mark(True)  # it answered (or accepted the connection): it is up
                    if isinstance(exc, (ConnectionError, http.client.HTTPException)):
                        dropped = True
                elif dropped:
                    exc.took_down = True  # it was reached, dropped this image, and is gone now
                raise

        def out_of_attempts(state: RetryCallState) -> bool:  # or no time left for another one
            return state.attempt_number >= self.retries or time.monotonic() + (state.upcoming_sleep or 0.0) >= deadline

        retrying = AsyncRetrying(
            retry=retry_if_exception(_retryable),
            wait=lambda state: self._delay(state.attempt_number, state.outcome.exception()),
            stop=out_of_attempts,
            before_sleep=lambda state: log.debug("openai: attempt %d/%d failed (%r); again in %.2f s",
                                                 state.attempt_number, self.retries, state.outcome.exception(),
                                                 state.upcoming_sleep),
            reraise=True,
        )
        answer = await retrying(attempt)
        self._mark(True)
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] or ""
        except (TypeError, KeyError, IndexError) as exc:
            raise ValueError(f"unexpected answer from {url}: {str(answer)[:200]}") from exc
        if choice.get("finish_reason") == "length":
            log.info("openai: answer cut at max_tokens=%d; parsing what came", self.max_tokens)
            return text, (WARNING_TRUNCATED_MAX_TOKENS,)
        return text, ()

    @property
    def slots(self) -> int:
        """``max_concurrency``: the requests in flight the server is sized for."""
        return self.max_concurrency

    @property
    def busy(self) -> int:
        """Requests in flight now."""
        return self._slots.busy

    async def page(self, image: np.ndarray, task: EngineTask, timeout_s: float,
                   lane: Priority = "bulk") -> EngineOutput:
        """See :meth:`OcrEngine.page`: one chat-completions request. At most ``max_concurrency``
        are in flight; a waiting interactive page gets the next free one before any bulk page,
        and with ``send_priority`` the request carries vLLM's ``priority`` (0 interactive, 1
        bulk). The timeout starts when the page gets its slot; a timed-out request's HTTP thread
        ends at its socket timeout (at most what was left of ``timeout_s``) and its answer is
        discarded.

        Raises:
            UnsupportedTask: a task not in :attr:`tasks`.
            EngineTimeout: past ``timeout_s`` (:class:`AttemptTimeout`: one attempt's socket timeout).
            EngineUnavailable: the server is unreachable after the attempts (:attr:`ready` turns False).
            ServerError: the server answered with an error status.
        """
        if not self.supports(task):
            raise self.unsupported(task)
        h, w = image.shape[:2]
        padded = hunyuan_prompts.pad_for_vlm(image)
        ph, pw = padded.shape[:2]
        async with self._slots.hold(lane):
            started = time.perf_counter()
            try:
                text, warnings = await asyncio.wait_for(
                    self._call(padded, time.monotonic() + timeout_s, task, lane), timeout_s)
            except asyncio.TimeoutError:
                raise EngineTimeout(f"inference took longer than {timeout_s:g} s") from None
            except Unreachable as exc:
                self._mark(False, exc)
                raise EngineUnavailable(f"OCR server at {self.base_url} unreachable: {exc}",
                                        took_down=getattr(exc, "took_down", False)) from exc
        if task.name != "ocr":
            out = dialects.task_output(self.dialect, task, text, warnings, started)
        else:
            out = hunyuan.answer_to_output(text, (pw, ph), (w, h), warnings, started)
        if isinstance(out, BaseException):  # the parsers return the page's failure: unparsable_output, engine_error
            raise out
        return out
