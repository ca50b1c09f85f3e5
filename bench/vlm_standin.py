"""A loopback stand-in for one GPU serving an OCR VLM with continuous batching, as vLLM does.

What it models. One engine loop (:class:`ContinuousBatcher`) with a waiting queue and a running
set of at most ``max_seqs`` sequences (vLLM's ``--max-num-seqs``, default 256). Each engine *step*
first admits waiting requests into free running slots (their prefill: the prompt tokens), then
decodes one token for every running sequence; a sequence is done when it has produced its target
number of tokens, and its HTTP answer goes out at once. A step lasts

    ``base_ms + per_seq_ms * running + per_prompt_token_ms * prompt tokens admitted this step``

(defaults 8 ms, 0.12 ms, 0.01 ms): a fixed cost per forward pass (weights read once per step,
kernel launches, the scheduler), a cost per sequence decoded (its KV cache read) and a prefill
cost per prompt token. At the defaults one sequence decodes at ~123 tokens/s, 256 running
sequences at ~6,600 tokens/s together (38.7 ms a step): 54x the one sequence, which is the point
of batching on a GPU. Steps are slept with asyncio on a virtual timeline: each step's end is due
``step`` after the previous one's, and the sleep is what is left to that time, so timer overshoot
or a busy event loop is made up on the next steps and the modelled throughput does not depend on
timer granularity (a lag over ``max_lag_ms`` is dropped instead and counted in ``/stats`` as
``lag_dropped_ms``: the process could not keep up). Admission order is the request's
``priority`` (lower first, default 0: vLLM's convention with ``--scheduling-policy priority``),
then arrival. Unlike vLLM, a running sequence is never preempted (no KV-cache limit is modelled).

Answer length. Drawn per image from a lognormal seeded by SHA-256 of the decoded image bytes
(the same image always gets the same length, whoever sends it): median ``median_tokens`` 300,
``sigma`` 1.0, rounded and clipped to [``min_tokens`` 8, ``max_tokens`` 4096] (and to the
request's ``max_tokens``; an answer cut by either cap has ``finish_reason`` "length"). Why these:
HunyuanOCR's text spotting writes about one item of ~16 tokens per text line, so a sparse page or
a sign is a few dozen tokens, an ordinary printed page a few hundred, a dense receipt or form
~1-2k tokens; sigma 1.0 puts about 1% of pages under 30 tokens (near-blank), 2.9% over 2,000 (dense)
and 0.4% at the 4,096 cap (vLLM's HunyuanOCR recipe's cap; a runaway loop). The mean is ~490
tokens. The long tail is what costs a micro-batch design: a batch of 16 waits for its slowest
page, ~1,900 tokens on average (median 1,700), four times the mean, so the engine runs 16
sequences for a few hundred steps and far fewer for the rest; a batch of 256 nearly always holds
a 4,096-token page. A continuous-batching client keeps the running set full instead
(HunyuanOCR's own ``batch_infer.py`` keeps 64 requests in flight).

Prompt tokens. Qwen2-VL-style: one token per 28 x 28 px patch (14 px patches merged 2 x 2), the
image's sides rounded to the nearest multiple of 28 (at least one patch each way), plus
``text_tokens`` 20 for the instruction and the chat template: a 480 x 360 page is 17 x 13 + 20 =
241 tokens. The size is read from the PNG/JPEG header (Pillow, pixels not decoded).

Answer text. HunyuanOCR's text-spotting form, one item per line: ``text(x1,y1),(x2,y2)``,
coordinates 0..1000 of the image, lines stacked top to bottom; about ``chars_per_token`` 3
characters per token, ~48 characters a line, so :func:`services.infer.engines.hunyuan.answer_to_output`
reads one segment per line (``tests/unit/test_vlm_standin.py`` checks it).

HTTP (starlette on uvicorn, 127.0.0.1): ``POST /v1/chat/completions`` (non-streaming; the body as
:meth:`services.infer.engines.openai_engine.OpenAiEngine.payload` builds it: the image as a
``data:image/png;base64,...`` or JPEG URL in the last message's content, ``max_tokens``, optional
``priority``), ``GET /v1/models``, ``GET /health`` and ``GET /stats`` (the counters of
:meth:`ContinuousBatcher.stats` as JSON: requests answered, tokens, steps, mean running sequences
per step, i.e. how full the "GPU" was), ``GET /finishes?since=EPOCH_S`` and ``GET /arrivals?since=EPOCH_S``
(when each sequence finished, when each request arrived: for a benchmark's time to 50% or 90% of
its pages, or how long its first page took to reach the engine).

Usage: python -m bench.vlm_standin [--port 8000] [--max-seqs 256] [--base-ms 8] ... (``--help``);
``--port 0`` takes a free port. One line starting ``vlm-standin ready`` is printed when it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hashlib
import heapq
import io
import itertools
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from PIL import Image

READY_PREFIX = "vlm-standin ready"
"""Start of the line printed once the server listens (the benchmarks wait for it)."""

WORDS = ("TOTAL", "CASH", "ITEM", "QTY", "PRICE", "TAX", "DATE", "INVOICE", "No.", "AMOUNT", "PAID", "CHANGE",
         "Receipt", "Store", "Road", "Street", "Tel", "Order", "Table", "Service", "Subtotal", "Discount",
         "Card", "VISA", "Thank", "you", "Please", "come", "again", "kg", "pcs", "Unit", "Code", "Ref")
"""Words the answers are made of (with numbers): no parentheses or commas, so only the
coordinates parse as coordinates."""


@dataclass(frozen=True)
class ModelParams:
    """The stand-in's model: every field is a CLI flag (``--max-seqs``, ``--base-ms``, ...).

    Attributes:
        max_seqs: Running sequences at most (vLLM's ``--max-num-seqs``).
        base_ms: Fixed time of one engine step, ms.
        per_seq_ms: Time per running sequence per step, ms.
        per_prompt_token_ms: Prefill time per prompt token admitted in a step, ms.
        median_tokens: Median answer length, tokens (lognormal).
        sigma: Lognormal sigma of the answer length (of its natural log).
        min_tokens: Shortest answer, tokens.
        max_tokens: Longest answer, tokens (the model's cap; a request's own ``max_tokens`` may be lower).
        patch_px: Image pixels per prompt token along each side.
        text_tokens: Prompt tokens besides the image's.
        chars_per_token: Answer characters per generated token.
        max_lag_ms: How far the virtual step timeline may fall behind real time before the lag
            is dropped (and counted), ms.
    """

    max_seqs: int = 256
    base_ms: float = 8.0
    per_seq_ms: float = 0.12
    per_prompt_token_ms: float = 0.01
    median_tokens: float = 300.0
    sigma: float = 1.0
    min_tokens: int = 8
    max_tokens: int = 4096
    patch_px: int = 28
    text_tokens: int = 20
    chars_per_token: float = 3.0
    max_lag_ms: float = 250.0

    def step_ms(self, running: int, prompt_tokens: int) -> float:
        """Modelled duration of one step with ``running`` sequences, ``prompt_tokens`` of them admitted now, ms."""
        return self.base_ms + self.per_seq_ms * running + self.per_prompt_token_ms * prompt_tokens


# ---------------------------------------------------------------------------- the model's answers

def image_seed(image: bytes) -> int:
    """The image's seed: the first 8 bytes of its SHA-256, as an integer."""
    return int.from_bytes(hashlib.sha256(image).digest()[:8], "big")


def drawn_tokens(seed: int, p: ModelParams) -> float:
    """The answer length the model "wants" for the image of ``seed``, tokens, before any cap (lognormal)."""
    return random.Random(seed).lognormvariate(math.log(p.median_tokens), p.sigma)


def answer_tokens(seed: int, p: ModelParams, request_max: int | None = None) -> tuple[int, str]:
    """``(tokens, finish_reason)`` of the answer for the image of ``seed``: the drawn length rounded
    and clipped to [``min_tokens``, ``max_tokens``] and to ``request_max``; "length" when a cap cut it."""
    cap = p.max_tokens if request_max is None else max(1, min(p.max_tokens, request_max))
    want = max(p.min_tokens, round(drawn_tokens(seed, p)))
    return (cap, "length") if want > cap else (want, "stop")


def image_size(image: bytes) -> tuple[int, int]:
    """``(width, height)`` of a PNG/JPEG (any format Pillow knows) from its header, pixels not decoded.

    Raises:
        ValueError: not an image Pillow can open.
    """
    try:
        with Image.open(io.BytesIO(image)) as img:
            return img.size
    except Exception as exc:  # noqa: BLE001 - Pillow raises several kinds
        raise ValueError(f"not a readable image: {exc}") from exc


def prompt_tokens(width: int, height: int, p: ModelParams) -> int:
    """Prompt tokens of a ``width`` x ``height`` px image: one per ``patch_px`` square (each side
    rounded to the nearest multiple, at least one), plus ``text_tokens``."""
    return max(1, round(width / p.patch_px)) * max(1, round(height / p.patch_px)) + p.text_tokens


def spotting_answer(seed: int, tokens: int, p: ModelParams) -> tuple[str, int]:
    """A text-spotting answer of about ``tokens * chars_per_token`` characters: ``(text, lines)``.

    One item ``text(x1,y1),(x2,y2)`` per line, 0..1000 coordinates stacked top to bottom, every
    box at least 2 units high and wide, every line's text distinct (it starts with its number).
    """
    rng = random.Random(seed ^ 0x5EED)
    total = max(1, round(tokens * p.chars_per_token))
    n = max(1, round(total / 48))
    per_line = total / n
    out = []
    for i in range(n):
        y1 = 20 + (960 * i) // n
        y2 = y1 + max(2, (960 // n) * 4 // 5)
        x1 = rng.randrange(20, 200)
        coords_len = len(f"({x1},{y1}),(999,{y2})")
        budget = max(2, round(per_line) - coords_len)
        words = [f"{i + 1}"]
        while sum(len(w) + 1 for w in words) < budget:
            number = f"{rng.randrange(1, 9999)}.{rng.randrange(100):02d}"
            words.append(rng.choice(WORDS) if rng.random() < 0.7 else number)
        text = " ".join(words)[:budget].rstrip() or f"{i + 1}"
        x2 = min(990, x1 + max(2, 12 * len(text)))
        out.append(f"{text}({x1},{y1}),({x2},{y2})")
    return "\n".join(out), n


# ---------------------------------------------------------------------------- the engine loop

@dataclass
class _Seq:
    prompt_tokens: int
    target: int
    priority: int
    arrival: int
    future: asyncio.Future
    produced: int = 0


@dataclass
class Counters:
    """What :class:`ContinuousBatcher` has done since it started (cumulative).

    Attributes:
        requests: Sequences finished (answers produced).
        tokens: Tokens generated (decoded), all sequences.
        prompt_tokens: Prompt tokens prefilled.
        steps: Engine steps run.
        seq_steps: Running sequences summed over steps (``/ steps`` = mean running per step).
        seq_step_ms: Running sequences times step time, summed, ms (``/ busy_ms`` = time-weighted mean).
        busy_ms: Modelled time of all steps, ms (the "GPU" busy time).
        running_peak: Most sequences running at once.
        waiting_peak: Most requests waiting at once.
        length_cut: Answers cut at a ``max_tokens`` cap (``finish_reason`` "length").
        lag_dropped_ms: Time the step timeline fell behind by more than ``max_lag_ms`` and gave up, ms.
    """

    requests: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    seq_steps: int = 0
    seq_step_ms: float = 0.0
    busy_ms: float = 0.0
    running_peak: int = 0
    waiting_peak: int = 0
    length_cut: int = 0
    lag_dropped_ms: float = 0.0


class ContinuousBatcher:
    """One GPU's engine loop with continuous batching (see the module docstring for the model).

    :meth:`generate` queues one request and returns when its sequence is done; the loop runs as
    a task of the event loop of the first call and stops by :meth:`close`.

    Args:
        params: The model.
    """

    def __init__(self, params: ModelParams | None = None):
        self.p = params or ModelParams()
        self.counters = Counters()
        self.admitted: list[tuple[int, int]] = []  # (priority, arrival) of the last admissions, oldest first
        self.finished_at: list[float] = []  # epoch seconds of the last sequences' ends, oldest first
        self.arrived_at: list[float] = []  # epoch seconds of the last requests' arrivals, oldest first
        self._waiting: list[tuple[int, int, _Seq]] = []  # heap: (priority, arrival, seq)
        self._running: list[_Seq] = []
        self._arrivals = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._started = time.monotonic()

    @property
    def running(self) -> int:
        """Sequences running now."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._waiting)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="standin-engine")

    async def generate(self, prompt_tokens: int, max_new_tokens: int, priority: int = 0) -> int:
        """Queue one request and wait until its sequence has produced ``max_new_tokens`` tokens.

        Args:
            prompt_tokens: Its prompt length, tokens (prefilled in the step that admits it).
            max_new_tokens: Tokens it produces, at least 1.
            priority: Admission order, lower first; equal priorities in arrival order.

        Returns:
            The tokens produced.
        """
        self._ensure_loop()
        fut = asyncio.get_running_loop().create_future()
        seq = _Seq(prompt_tokens, max(1, max_new_tokens), priority, next(self._arrivals), fut)
        self.arrived_at.append(time.time())
        heapq.heappush(self._waiting, (priority, seq.arrival, seq))
        self.counters.waiting_peak = max(self.counters.waiting_peak, len(self._waiting))
        self._wake.set()
        return await fut  # cancelled: the loop drops it (a client that went away)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        c, p = self.counters, self.p
        due: float | None = None
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
                due = None
            now = loop.time()
            if due is None:
                due = now
            elif now - due > p.max_lag_ms / 1000:
                c.lag_dropped_ms += (now - due) * 1000
                due = now
            prefill = 0
            while self._waiting and len(self._running) < p.max_seqs:
                _, _, seq = heapq.heappop(self._waiting)
                if seq.future.done():
                    continue
                self._running.append(seq)
                prefill += seq.prompt_tokens
                self.admitted.append((seq.priority, seq.arrival))
            if len(self.admitted) > 10_000:
                del self.admitted[:-5_000]
            n = len(self._running)
            step = p.step_ms(n, prefill)
            due += step / 1000
            await asyncio.sleep(max(0.0, due - loop.time()))
            c.steps += 1
            c.seq_steps += n
            c.seq_step_ms += n * step
            c.busy_ms += step
            c.prompt_tokens += prefill
            c.running_peak = max(c.running_peak, n)
            keep = []
            for seq in self._running:
                if seq.future.done():  # cancelled while running: aborted
                    continue
                seq.produced += 1
                c.tokens += 1
                if seq.produced >= seq.target:
                    c.requests += 1
                    self.finished_at.append(time.time())
                    seq.future.set_result(seq.produced)
                else:
                    keep.append(seq)
            self._running = keep
            for times in (self.finished_at, self.arrived_at):
                if len(times) > 200_000:
                    del times[:-100_000]

    def stats(self) -> dict:
        """The counters (:class:`Counters`) plus ``mean_running_per_step``, ``mean_running_time_weighted``,
        ``occupancy`` (mean running per step / ``max_seqs``), ``running``, ``waiting``, ``uptime_s``
        and the model's parameters under ``params``."""
        c = self.counters
        out = asdict(c)
        out["mean_running_per_step"] = c.seq_steps / c.steps if c.steps else 0.0
        out["mean_running_time_weighted"] = c.seq_step_ms / c.busy_ms if c.busy_ms else 0.0
        out["occupancy"] = out["mean_running_per_step"] / self.p.max_seqs
        out["running"] = len(self._running)
        out["waiting"] = len(self._waiting)
        out["uptime_s"] = time.monotonic() - self._started
        out["params"] = asdict(self.p)
        return out

    async def close(self) -> None:
        """Stop the loop; waiting and running requests are cancelled."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for seq in [s for _, _, s in self._waiting] + self._running:
            if not seq.future.done():
                seq.future.cancel()
        self._waiting, self._running = [], []


# ---------------------------------------------------------------------------- HTTP

@dataclass
class Answer:
    """One chat completion's outcome: the text, its tokens, ``finish_reason`` and the prompt's tokens."""

    text: str
    tokens: int
    finish_reason: str
    prompt_tokens: int
    lines: int = field(default=0)


def request_image(body: dict) -> bytes:
    """The image bytes of a chat-completions body: the first ``image_url`` data URL of the last message.

    Raises:
        ValueError: no image, not a base64 ``data:`` URL, or bad base64.
    """
    try:
        content = body["messages"][-1]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError("no messages") from exc
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "")
            head, sep, data = url.partition(",")
            if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
                raise ValueError("the image must be a data:image/...;base64 URL")
            try:
                return base64.b64decode(data, validate=True)
            except binascii.Error as exc:
                raise ValueError(f"bad base64: {exc}") from exc
    raise ValueError("no image_url in the last message")


async def complete(batcher: ContinuousBatcher, body: dict) -> Answer:
    """Answer one chat-completions body (see :func:`request_image`): the image's length and
    prompt, through the engine loop, then the text.

    Raises:
        ValueError: a body without a readable image, or a non-integer ``priority``/``max_tokens``.
    """
    image = request_image(body)
    w, h = image_size(image)
    p = batcher.p
    seed = image_seed(image)
    req_max = body.get("max_tokens")
    tokens, finish = answer_tokens(seed, p, int(req_max) if req_max is not None else None)
    prompt = prompt_tokens(w, h, p)
    await batcher.generate(prompt, tokens, int(body.get("priority", 0) or 0))
    if finish == "length":
        batcher.counters.length_cut += 1
    text, lines = spotting_answer(seed, tokens, p)
    return Answer(text, tokens, finish, prompt, lines)


def build_app(batcher: ContinuousBatcher, model: str = "tencent/HunyuanOCR"):
    """The ASGI app: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``, ``GET /stats`` and
    ``GET /finishes?since=EPOCH_S`` (the epoch seconds at which the sequences finished after ``since``, oldest
    first: the last 100,000 at least) and ``GET /arrivals?since=EPOCH_S`` (the same of the requests' arrivals)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            ans = await complete(batcher, body)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"object": "error", "message": str(exc), "type": "BadRequestError", "code": 400},
                                status_code=400)
        return JSONResponse({
            "id": f"chatcmpl-standin-{batcher.counters.requests}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", model),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ans.text},
                         "finish_reason": ans.finish_reason}],
            "usage": {"prompt_tokens": ans.prompt_tokens, "completion_tokens": ans.tokens,
                      "total_tokens": ans.prompt_tokens + ans.tokens},
        })

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "standin"}]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def stats(_: Request) -> Response:
        return JSONResponse(batcher.stats())

    async def finishes(request: Request) -> Response:
        since = float(request.query_params.get("since", 0))
        return JSONResponse([t for t in batcher.finished_at if t > since])

    async def arrivals(request: Request) -> Response:
        since = float(request.query_params.get("since", 0))
        return JSONResponse([t for t in batcher.arrived_at if t > since])

    return Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/finishes", finishes, methods=["GET"]),
        Route("/arrivals", arrivals, methods=["GET"]),
    ])


async def serve(params: ModelParams, host: str = "127.0.0.1", port: int = 8000,
                model: str = "tencent/HunyuanOCR") -> None:
    """Serve until SIGINT/SIGTERM; print the :data:`READY_PREFIX` line (with the port) once listening."""
    import uvicorn

    batcher = ContinuousBatcher(params)
    config = uvicorn.Config(build_app(batcher, model), host=host, port=port, log_level="warning",
                            access_log=False, lifespan="off", backlog=4096, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            return
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    print(f"{READY_PREFIX} on http://{host}:{bound}/v1 model={model} {json.dumps(asdict(params))}", flush=True)
    try:
        await task
    finally:
        await batcher.close()


PARAM_HELP = {
    "max_seqs": "running sequences at most (vLLM's --max-num-seqs)",
    "base_ms": "fixed time of one engine step, ms",
    "per_seq_ms": "time per running sequence per step, ms",
    "per_prompt_token_ms": "prefill time per prompt token admitted in a step, ms",
    "median_tokens": "median answer length, tokens (lognormal)",
    "sigma": "lognormal sigma of the answer length",
    "min_tokens": "shortest answer, tokens",
    "max_tokens": "longest answer, tokens (a request's max_tokens may cut it shorter)",
    "patch_px": "image pixels per prompt token along each side",
    "text_tokens": "prompt tokens besides the image's",
    "chars_per_token": "answer characters per generated token",
    "max_lag_ms": "lag of the step timeline behind real time that is dropped (and counted), ms",
}
"""Help of each :class:`ModelParams` flag."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ModelParams]:
    """The CLI: ``--host``, ``--port``, ``--model`` and one flag per :class:`ModelParams` field."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 = a free port (printed on the ready line)")
    ap.add_argument("--model", default="tencent/HunyuanOCR", help="the name /v1/models answers")
    for name, f in ModelParams.__dataclass_fields__.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(f.default), default=f.default,
                        help=f"{PARAM_HELP[name]} (default {f.default})")
    args = ap.parse_args(argv)
    return args, ModelParams(**{k: getattr(args, k) for k in ModelParams.__dataclass_fields__})


def main(argv: list[str] | None = None) -> None:
    """Entry point: parse the flags and serve (uvloop when installed)."""
    args, params = parse_args(argv)
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            runner.run(serve(params, args.host, args.port, args.model))
        except KeyboardInterrupt:
            pass
    sys.exit(0)


if __name__ == "__main__":
    main()
