"""VllmEngine throughput at batch 1, 8 and 32 on generated pages (GPU machine only).

Drives the engine the way the infer stage does: one ``engine.ocr(images, timeout)`` call per
micro-batch, all images of a batch in flight together. Prints images/s per batch size and the
ratios batch 8 / batch 1 and batch 32 / batch 1. With a random-weight model the text is
garbage; ``ignore_eos`` with a small ``max_tokens`` makes every request generate the same
number of tokens, so the numbers measure batching, not luck.

Usage: python bench/gpu/throughput.py --model DIR [--load-format auto|dummy] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Qwen2-VL style literal prompt for the tiny model (one image placeholder, expanded by vLLM).
QWEN_TEMPLATE = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                 "<|vision_start|><|image_pad|><|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n")


def make_pages(n: int, seed: int, w: int = 896, h: int = 1152) -> list[np.ndarray]:
    """``n`` distinct page-like images: white, dark text-like bars in rows, a unique stamp
    (distinct images, so vLLM cannot share vision-encoder work between requests)."""
    rng = np.random.default_rng(seed)
    pages = []
    for i in range(n):
        img = np.full((h, w, 3), 255, dtype=np.uint8)
        y = 40
        while y < h - 40:
            x = 40
            while x < w - 80:
                bw = int(rng.integers(20, 120))
                img[y:y + 14, x:x + bw] = rng.integers(0, 80)
                x += bw + int(rng.integers(8, 24))
            y += int(rng.integers(26, 40))
        img[:8, :64] = np.array([(seed * 7919 + i) % 256, (i * 31) % 256, (i * 131) % 256], dtype=np.uint8)
        pages.append(img)
    return pages


def build_engine(args):
    from services.infer.engines.vllm_engine import VllmEngine

    engine_args = {"load_format": args.load_format, "seed": 0}
    sampling = {"ignore_eos": True}
    try:
        from services.infer.settings import InferSettings

        s = InferSettings(
            engine_kind="vllm", device=args.device, vllm_model=args.model, vllm_max_tokens=args.max_tokens,
            vllm_gpu_memory_utilization=args.gpu_mem, vllm_max_model_len=args.max_model_len,
            vllm_max_num_seqs=args.max_num_seqs, vllm_max_num_batched_tokens=args.max_num_batched_tokens,
            vllm_enforce_eager=args.enforce_eager, vllm_prompt_template=QWEN_TEMPLATE, vllm_repeat_stop=False,
            vllm_engine_args=engine_args, vllm_sampling_args=sampling, vllm_trust_remote_code=False,
            vllm_repetition_penalty=1.0, vllm_dtype="bfloat16",
        )
        print("engine: built from InferSettings (VllmEngine.from_settings)", flush=True)
        return VllmEngine.from_settings(s)
    except ImportError as exc:
        print(f"engine: settings unavailable ({exc}); building VllmEngine directly", flush=True)
        return VllmEngine(
            args.model, device=args.device, dtype="bfloat16", gpu_memory_utilization=args.gpu_mem,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens, trust_remote_code=False,
            enforce_eager=args.enforce_eager, prompt_template=QWEN_TEMPLATE, max_tokens=args.max_tokens,
            repetition_penalty=1.0, repeat_stop=False, engine_args=engine_args, sampling_args=sampling,
        )


async def run(args) -> int:
    from services.infer.engines.base import EngineOutput, EngineTimeout

    eng = build_engine(args)
    t0 = time.perf_counter()
    await eng.start()
    print(f"engine: started and warmed up in {time.perf_counter() - t0:.1f} s (ready={eng.ready})", flush=True)

    # the per-image timeout aborts the request, and the engine keeps working after it
    (res,) = await eng.ocr(make_pages(1, seed=999), timeout_s=0.001)
    print(f"check: timeout -> {type(res).__name__}", flush=True)
    if not isinstance(res, EngineTimeout):
        print("FAIL: a 1 ms timeout did not give EngineTimeout", flush=True)
        return 1
    (res,) = await eng.ocr(make_pages(1, seed=998), timeout_s=60)
    if not isinstance(res, EngineOutput):
        print(f"FAIL: request after an abort failed: {res!r}", flush=True)
        return 1
    print(f"check: after abort OK ({res.inference_ms:.0f} ms, {len(res.segments)} segments)", flush=True)

    results = {}
    for b in args.batches:
        n = max(args.min_images, 2 * b)
        n -= n % b
        await eng.ocr(make_pages(b, seed=1000 + b), timeout_s=args.timeout)  # untimed: this batch size once
        pages = make_pages(n, seed=b)
        errors, lat = 0, []
        start = time.perf_counter()
        for i in range(0, n, b):
            outs = await eng.ocr(pages[i:i + b], timeout_s=args.timeout)
            for o in outs:
                if isinstance(o, BaseException):
                    errors += 1
                    if errors <= 3:
                        print(f"  error at batch {b}: {o!r}", flush=True)
                else:
                    lat.append(o.inference_ms)
        dt = time.perf_counter() - start
        ips = (n - errors) / dt
        results[b] = ips
        p50 = float(np.median(lat)) if lat else float("nan")
        print(f"batch {b:>3}: {n} images in {dt:6.2f} s = {ips:7.2f} images/s, "
              f"per-image latency p50 {p50:.0f} ms, errors {errors}", flush=True)
        if errors == n:
            print(f"FAIL: every image failed at batch {b}", flush=True)
            return 1
    await eng.close()

    base = results.get(1)
    print("\nthroughput (images/s): " + ", ".join(f"b{b}={v:.2f}" for b, v in results.items()))
    if base:
        for b in (8, 32):
            if b in results:
                print(f"ratio batch {b} / batch 1 = {results[b] / base:.2f}x")
    print("RESULT " + json.dumps({"images_per_s": results,
                                  "ratios": {b: results[b] / base for b in results if base}}))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--min-images", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--enforce-eager", type=int, default=int(os.environ.get("ENFORCE_EAGER", "1")))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.enforce_eager = bool(args.enforce_eager)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
