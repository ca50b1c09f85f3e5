"""The loopback VLM stand-in (bench/vlm_standin.py): its answers parse as HunyuanOCR's, lengths
follow the image, continuous batching gives throughput, priority orders admission."""

import asyncio
import io
import time

import httpx
import numpy as np
from PIL import Image

from bench.vlm_standin import (ContinuousBatcher, ModelParams, answer_tokens, build_app, image_seed, image_size,
                               prompt_tokens, request_image, spotting_answer)
from services.infer.engines import hunyuan
from services.infer.engines.openai_engine import OpenAiEngine

FAST = ModelParams(base_ms=1.0, per_seq_ms=0.01, per_prompt_token_ms=0.0, median_tokens=20, min_tokens=2,
                   max_tokens=64)


def page(i: int, size: tuple[int, int] = (480, 360)) -> np.ndarray:
    """An RGB page with a stamp drawn from ``i`` (distinct pages, distinct bytes)."""
    img = np.full((size[1], size[0], 3), 255, dtype=np.uint8)
    img[20:40, 20:20 + (i % 400) + 10] = 0
    img[60 + i % 200, 30:300] = (i * 37) % 256
    return img


def payload(engine: OpenAiEngine, i: int) -> dict:
    return engine.payload(page(i))


def test_every_answer_parses_into_its_lines():
    p = ModelParams()
    for tokens in (8, 40, 300, 1500, 4096):
        text, lines = spotting_answer(tokens * 7919, tokens, p)
        out = hunyuan.answer_to_output(text, (480, 360), (480, 360), (), time.perf_counter())
        assert len(out.segments) == lines, tokens
        assert out.warnings == ()
        assert 2.5 <= len(text) / tokens <= 3.5  # ~3 characters a token


def test_lengths_follow_the_image_and_are_long_tailed():
    p = ModelParams()
    data = [bytes([i % 256, i // 256]) * 3 for i in range(4000)]
    toks = sorted(answer_tokens(image_seed(d), p)[0] for d in data)
    assert 200 <= toks[len(toks) // 2] <= 450  # median a few hundred
    assert toks[0] >= p.min_tokens and toks[-1] <= p.max_tokens
    assert toks[int(0.99 * len(toks))] > 1500  # dense pages: thousands
    assert answer_tokens(image_seed(data[5]), p) == answer_tokens(image_seed(data[5]), p)
    assert answer_tokens(image_seed(data[5]), p, request_max=3) == (3, "length")


def test_prompt_tokens_from_the_header():
    buf = io.BytesIO()
    Image.new("RGB", (480, 360), "white").save(buf, "PNG")
    assert image_size(buf.getvalue()) == (480, 360)
    assert prompt_tokens(480, 360, ModelParams()) == 17 * 13 + 20


async def test_answers_over_http_parse_and_repeat():
    batcher = ContinuousBatcher(FAST)
    engine = OpenAiEngine("http://standin/v1", max_tokens=64)
    transport = httpx.ASGITransport(app=build_app(batcher))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://standin") as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "tencent/HunyuanOCR"
            bodies = [payload(engine, i) for i in (1, 2, 1)]
            answers = [(await client.post("/v1/chat/completions", json=b)).json() for b in bodies]
            for body, ans in zip(bodies, answers):
                text = ans["choices"][0]["message"]["content"]
                tokens = ans["usage"]["completion_tokens"]
                seed = image_seed(request_image(body))
                assert (tokens, ans["choices"][0]["finish_reason"]) == answer_tokens(seed, FAST, 64)
                out = hunyuan.answer_to_output(text, (480, 360), (480, 360), (), time.perf_counter())
                assert len(out.segments) == spotting_answer(seed, tokens, FAST)[1]
            assert answers[0]["choices"] == answers[2]["choices"]  # the same image: the same answer
            stats = (await client.get("/stats")).json()
            assert stats["requests"] == 3 and stats["tokens"] == sum(a["usage"]["completion_tokens"] for a in answers)
            bad = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert bad.status_code == 400
    finally:
        await batcher.close()
        await engine.close()


async def test_concurrent_requests_share_steps():
    """64 sequences of 30 tokens admitted together take 30 steps, not 64 x 30, and far less
    than 64 x the time of one (a wide bound: the point is the batching, not the timer)."""
    batcher = ContinuousBatcher(FAST)
    try:
        t0 = time.perf_counter()
        await batcher.generate(5, 30)
        one = time.perf_counter() - t0
        steps0 = batcher.counters.steps
        t0 = time.perf_counter()
        assert await asyncio.gather(*(batcher.generate(5, 30) for _ in range(64))) == [30] * 64
        many = time.perf_counter() - t0
        assert batcher.counters.steps - steps0 == 30
        assert batcher.stats()["running_peak"] == 64
        assert many < 16 * one
    finally:
        await batcher.close()


async def test_max_seqs_bounds_the_running_set():
    batcher = ContinuousBatcher(ModelParams(max_seqs=4, base_ms=0.5, per_seq_ms=0.0, per_prompt_token_ms=0.0))
    try:
        await asyncio.gather(*(batcher.generate(1, 5) for _ in range(10)))
        s = batcher.stats()
        assert s["running_peak"] == 4 and s["requests"] == 10 and s["tokens"] == 50
        assert s["steps"] == 15  # 4 + 4 + 2 sequences, 5 steps each round
        assert s["occupancy"] <= 1.0
    finally:
        await batcher.close()


async def test_priority_zero_is_admitted_before_priority_one():
    """One slot: while it is busy, a priority-1 request arrives, then a priority-0 one; the
    priority-0 one gets the slot first."""
    batcher = ContinuousBatcher(ModelParams(max_seqs=1, base_ms=1.0, per_seq_ms=0.0, per_prompt_token_ms=0.0))
    try:
        first = asyncio.create_task(batcher.generate(1, 50, priority=1))
        while batcher.running == 0:
            await asyncio.sleep(0)
        bulk = asyncio.create_task(batcher.generate(1, 2, priority=1))
        interactive = asyncio.create_task(batcher.generate(1, 2, priority=0))
        await asyncio.gather(first, bulk, interactive)
        assert batcher.admitted == [(1, 0), (0, 2), (1, 1)]  # (priority, arrival)
    finally:
        await batcher.close()
