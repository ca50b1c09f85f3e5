"""Infer-stage throughput with the vLLM engine: micro-batches with a barrier vs a window (GPU machine).

Drives the infer stage's handler minus Kafka and S3: it builds an
:class:`~services.infer.handler.InferHandler` (real settings, real PNG decode, downscale/tiling,
engine call, line grouping, ``ResultEvent`` building) and feeds it ``ocr.infer`` records two ways:

* ``b<N>`` (``--batches``): micro-batches of N records, each batch started only when the slowest
  record of the one before is done (``InferHandler.handle``: the batch runner's barrier);
* ``w<N>`` (``--windows``): a window of N records in flight, the next one started the moment one
  is done (``InferHandler.handle_record`` under a semaphore: what the window runner does).

Only the transports are stand-ins: an in-memory object store holds the PNG pages, and the
records are built in memory instead of consumed from Kafka. The engine is the real
:class:`~services.infer.engines.vllm_engine.VllmEngine`.

Prints images/s per mode and the ratios to b1 and of each window to the largest batch (last
line: ``RESULT {json}``). With ``--tasks`` (``all``, or e.g. ``ocr,doc_parse,extract``) it runs every
task named at each batch size on the same engine, and prints per task pages/s and output tokens/s
(:mod:`bench.gpu.tasks`: the parameters sent, how pages are counted, the table); ``RESULT`` then
also has ``tasks``. With a random-weight model the text is garbage; ``ignore_eos`` with a
small ``max_tokens`` makes every request generate the same number of tokens, so the numbers
measure batching, not luck.

``--fake-engine`` swaps the engine for an in-process stand-in (a fixed cost per engine call
plus a cost per image, no GPU) to smoke-test the harness on any machine; its numbers say
nothing about vLLM.

Usage:
    python bench/gpu/throughput.py --model DIR [--load-format auto|dummy] [--batches 1,16] [--windows 256] [--tasks all]
    python bench/gpu/throughput.py --fake-engine --batches 1,16 --windows 256 [--tasks all]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gpu import tasks as task_runs  # noqa: E402
from services.infer.engines.base import OCR  # noqa: E402

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


def png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


class MemoryStore:
    """The object-store call the infer handler makes (``get_uri``), over a dict (no S3 here)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def put(self, uri: str, data: bytes) -> None:
        self.objects[uri] = data

    async def get_uri(self, uri: str, max_bytes: int | None = None) -> bytes:
        from schemas.errors import ErrorCode
        from services.common.errors import OcrError

        if uri not in self.objects:
            raise OcrError(ErrorCode.MISSING_OBJECT, uri)
        return self.objects[uri]


def fake_engine_class():
    from schemas.tasks import TASKS
    from services.infer.textlines import Segment
    from services.infer.engines.base import EngineOutput, OcrEngine

    class FakeEngine(OcrEngine):
        """Harness smoke test only: ``per_call_s`` + ``per_image_s`` per page; every task;
        ``tokens_per_image`` counted in :attr:`output_tokens` per page answered."""

        name = "fake"
        max_side = 2048
        tasks = frozenset(TASKS)

        def __init__(self, per_call_s: float = 0.05, per_image_s: float = 0.005, tokens_per_image: int = 64):
            self.per_call_s, self.per_image_s = per_call_s, per_image_s
            self.tokens_per_image = tokens_per_image
            self.output_tokens = 0

        async def start(self) -> None:
            self.ready = True

        async def page(self, image, task, timeout_s, lane="bulk"):
            t0 = time.perf_counter()
            await asyncio.sleep(self.per_call_s + self.per_image_s)
            ms = (time.perf_counter() - t0) * 1000
            h, w = image.shape[:2]
            self.output_tokens += self.tokens_per_image
            if task.name == "extract":
                return EngineOutput([], ms, answer={f: "fake" for f in task.params.fields})
            if task.name != "ocr":
                return EngineOutput([], ms, answer=f"fake {task.name}")
            return EngineOutput([Segment([[0, 0], [w, 0], [w, 20], [0, 20]], "fake", 1.0)], ms)

    return FakeEngine


def infer_settings(args, in_flight: int):
    """The infer stage's settings for this run (vLLM engine fields as production reads them),
    ``in_flight`` records at most at once."""
    from services.common.cache.keys import EngineIdentity
    from services.common.settings import Limits
    from services.infer.settings import InferSettings

    return InferSettings(
        max_in_flight=in_flight, fetch_concurrency=max(8, in_flight), vlm_dialect=getattr(args, "dialect", "auto"),
        limits=Limits(infer_timeout_s=args.timeout),
        engine_kind="vllm", engine=EngineIdentity(engine="vllm", model=args.model or "none", model_revision="tiny-random"),
        device=args.device, vllm_model=args.model or "none", vllm_max_tokens=args.max_tokens,
        vllm_gpu_memory_utilization=args.gpu_mem, vllm_max_model_len=args.max_model_len,
        vllm_max_num_seqs=args.max_num_seqs, vllm_max_num_batched_tokens=args.max_num_batched_tokens,
        vllm_enforce_eager=args.enforce_eager, vllm_prompt_template=QWEN_TEMPLATE, vllm_repeat_stop=False,
        vllm_engine_args={"load_format": args.load_format, "seed": 0}, vllm_sampling_args={"ignore_eos": True},
        vllm_trust_remote_code=False, vllm_repetition_penalty=1.0, vllm_dtype="bfloat16",
    ) if not args.fake_engine else InferSettings(
        max_in_flight=in_flight, fetch_concurrency=max(8, in_flight), limits=Limits(infer_timeout_s=args.timeout),
    )


def build_engine(args):
    if args.fake_engine:
        print("engine: FAKE (harness smoke test; the numbers say nothing about vLLM)", flush=True)
        return fake_engine_class()()
    from services.infer.engines.vllm_engine import VllmEngine

    print("engine: VllmEngine.from_settings(InferSettings)", flush=True)
    return VllmEngine.from_settings(infer_settings(args, 1))


def records(store: MemoryStore, pages: list[np.ndarray], tag: str, gen_id: str, task: str = "ocr") -> list:
    """``ocr.infer`` records of ``task`` (its parameters: :func:`bench.gpu.tasks.task_params`), one
    per page, each page PNG-encoded into the store, keyed ``<gen_id>:<sha256>`` as dedup would key
    them for this engine."""
    import hashlib

    from aiokafka import ConsumerRecord

    from schemas.events import InferEvent, RequestEvent
    from services.common.codec import dumps
    from services.common.records import RecordParser

    decode = RecordParser({"ocr.infer": InferEvent})  # as the runner decodes them for InferHandler
    out = []
    now = int(time.time() * 1000)
    for i, img in enumerate(pages):
        data = png(img)
        sha = hashlib.sha256(data).hexdigest()
        uri = f"s3://bench/{tag}/{i}.png"
        store.put(uri, data)
        req = RequestEvent(request_id=f"{tag}-{i}", content_sha256=sha, image_uri=uri, task=task,
                           task_params=task_runs.task_params(task))
        ev = InferEvent(request=req, cache_key=f"{gen_id}:{sha}")
        out.append(decode(ConsumerRecord("ocr.infer", 0, i, now, 0, None, dumps(ev), None, len(ev.request.request_id),
                                         0, [])))
    return out


async def run_mode(args, engine, telemetry, mode: str, task: str = "ocr") -> tuple[task_runs.TaskRun, list[float]]:
    """``task`` through the handler in ``mode``: ``b<N>`` micro-batches of N with a barrier
    (``InferHandler.handle``), ``w<N>`` a window of N in flight (``handle_record`` under a
    semaphore); returns the measured :class:`~bench.gpu.tasks.TaskRun` (its ``batch`` is N) and
    the per-request inference ms of the pages answered ok."""
    import orjson

    from schemas.events import ResultEvent
    from services.infer.handler import InferHandler

    n_in_flight = int(mode[1:])
    window = mode.startswith("w")
    store = MemoryStore()
    settings = infer_settings(args, n_in_flight)
    gen_id = settings.generation(task, task_runs.task_params(task)).gen_id
    handler = InferHandler(settings, store, engine, telemetry)
    n = max(args.min_images, 2 * n_in_flight)
    n -= n % n_in_flight
    tag = f"{task}-{mode}"
    warm = records(store, make_pages(min(n_in_flight, 32), seed=1000 + n_in_flight), f"warm-{tag}", gen_id, task)
    await handler.handle(warm)  # untimed
    recs = records(store, make_pages(n, seed=n_in_flight + (7 if window else 0)), tag, gen_id, task)
    counts = {"ok": 0, "errors": 0, "unparsable": 0}
    inference: list[float] = []

    def tally(out) -> None:
        for o in out:
            ev = ResultEvent.model_validate(orjson.loads(o.value))
            if ev.status == "ok":
                counts["ok"] += 1
                inference.append(ev.request.timings_ms.get("inference", 0.0))
            elif ev.error.code.value == "unparsable_output":  # a random-weight model writes no JSON
                counts["unparsable"] += 1
            else:
                counts["errors"] += 1
                if counts["errors"] <= 3:
                    print(f"  error at {task} {mode}: {ev.error.code.value}: {ev.error.message}", flush=True)

    tokens0 = getattr(engine, "output_tokens", None)
    start = time.perf_counter()
    if window:
        slots = asyncio.Semaphore(n_in_flight)

        async def one(rec) -> None:
            async with slots:
                tally(await handler.handle_record(rec))

        await asyncio.gather(*(one(r) for r in recs))
    else:
        for i in range(0, n, n_in_flight):
            tally(await handler.handle(recs[i:i + n_in_flight]))
    dt = time.perf_counter() - start
    tokens = None if tokens0 is None else engine.output_tokens - tokens0
    return task_runs.TaskRun(task, n_in_flight, counts["ok"], counts["unparsable"], counts["errors"], dt,
                             tokens, window=window), inference


async def engine_checks(engine) -> bool:
    """vLLM only: a 1 ms timeout gives EngineTimeout (request aborted), and the engine still
    answers afterwards."""
    from services.infer.engines.base import EngineOutput, EngineTimeout

    try:
        res = await engine.page(make_pages(1, seed=999)[0], OCR, timeout_s=0.001)
    except Exception as exc:  # noqa: BLE001 - the check is which one
        res = exc
    print(f"check: timeout -> {type(res).__name__}", flush=True)
    if not isinstance(res, EngineTimeout):
        print("FAIL: a 1 ms timeout did not give EngineTimeout", flush=True)
        return False
    try:
        res = await engine.page(make_pages(1, seed=998)[0], OCR, timeout_s=60)
    except Exception as exc:  # noqa: BLE001
        res = exc
    if not isinstance(res, EngineOutput):
        print(f"FAIL: request after an abort failed: {res!r}", flush=True)
        return False
    print(f"check: after abort OK ({res.inference_ms:.0f} ms, {len(res.segments)} segments)", flush=True)
    return True


async def run(args) -> int:
    """Start the engine, run every task of ``args.tasks`` (default ``["ocr"]``) at every batch
    size of ``args.batches``, print the lines, the ocr ratios, the per-task table (more than one
    task) and ``RESULT {json}``; close the engine. Returns the exit status (1: a check failed or a
    task had no page answered at some batch size)."""
    from services.common.settings import TelemetrySettings
    from services.common.telemetry import Telemetry

    tasks = list(getattr(args, "tasks", None) or ["ocr"])
    engine = build_engine(args)
    t0 = time.perf_counter()
    runs: list[task_runs.TaskRun] = []
    try:  # closed on every path: vLLM's engine core is a process of its own, holding the GPU
        await engine.start()
        print(f"engine: started and warmed up in {time.perf_counter() - t0:.1f} s (ready={engine.ready})", flush=True)
        if not args.fake_engine and not await engine_checks(engine):
            return 1

        telemetry = Telemetry("infer", TelemetrySettings())
        modes = [f"b{b}" for b in args.batches] + [f"w{w}" for w in getattr(args, "windows", None) or []]
        for task in tasks:
            for mode in modes:
                r, inf = await run_mode(args, engine, telemetry, mode, task)
                runs.append(r)
                p50 = float(np.median(inf)) if inf else float("nan")
                tok = "" if r.tokens_per_s is None else f", {r.tokens_per_s:8.1f} output tokens/s"
                unp = f", unparsable {r.unparsable}" if r.unparsable else ""
                how = (f"window {r.batch:>3}: {r.ok + r.unparsable + r.errors} requests through InferHandler.handle_record"
                       if mode.startswith("w") else
                       f"max_batch {r.batch:>3}: {r.ok + r.unparsable + r.errors} requests through InferHandler.handle")
                print(f"{task:<9} {how}, {r.pages_per_s:7.2f} images/s{tok}, inference p50 {p50:.0f} ms, "
                      f"errors {r.errors}{unp}", flush=True)
                if r.answered == 0:
                    print(f"FAIL: every request failed for {task} at {mode}", flush=True)
                    return 1
    finally:
        await engine.close()

    results = {r.key: r.pages_per_s for r in runs if r.task == "ocr"}
    ratios = {}
    if results:
        print("\nthroughput (images/s): " + ", ".join(f"{m}={v:.2f}" for m, v in results.items()))
        base = results.get("b1")
        batches = [m for m in results if m.startswith("b")]
        widest = max(batches, key=lambda m: int(m[1:]), default=None)
        for m, v in results.items():
            if base and m != "b1":
                ratios[f"{m}/b1"] = round(v / base, 2)
                print(f"ratio {m}/b1 = {v / base:.2f}x")
            if m.startswith("w") and widest and results[widest]:
                ratios[f"{m}/{widest}"] = round(v / results[widest], 2)
                print(f"ratio {m}/{widest} = {v / results[widest]:.2f}x")
    out = {"engine": engine.name, "images_per_s": {m: round(v, 3) for m, v in results.items()}, "ratios": ratios}
    if tasks != ["ocr"]:
        print("\nper task (pages/s: pages the engine answered, unparsable_output included; tok/s: generated tokens):")
        print(task_runs.format_report(runs))
        out["tasks"] = task_runs.result_json(runs)
    print("RESULT " + json.dumps(out))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``batches`` and ``tasks`` come back as lists, ``enforce_eager`` as a bool.

    Raises:
        SystemExit: (2) a bad argument (argparse's message on stderr).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="local checkpoint directory (required unless --fake-engine)")
    ap.add_argument("--fake-engine", action="store_true", help="harness smoke test without vLLM or a GPU")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batches", default="1,16", help="micro-batch sizes (a barrier after each batch)")
    ap.add_argument("--windows", default="256", help="window sizes (records in flight, no barrier); '' for none")
    ap.add_argument("--tasks", default="ocr", help="all, or a comma-separated list of tasks (default ocr)")
    ap.add_argument("--dialect", default="hunyuan", choices=("auto", "hunyuan", "generic"),
                    help="prompts of the tasks other than ocr (default hunyuan: HunyuanOCR's own)")
    ap.add_argument("--min-images", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM max_num_seqs (256: the window of 256 all on the GPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--enforce-eager", type=int, default=int(os.environ.get("ENFORCE_EAGER", "1")))
    args = ap.parse_args(argv)
    if not args.fake_engine and not args.model:
        ap.error("--model is required (or --fake-engine)")
    given = args.batches
    try:
        args.batches = [int(b) for b in given.split(",")]
        if min(args.batches) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batches: positive integers, comma-separated, not {given!r}")
    given = args.windows
    try:
        args.windows = [int(w) for w in given.split(",") if w.strip()]
        if args.windows and min(args.windows) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--windows: positive integers, comma-separated, not {given!r}")
    try:
        args.tasks = task_runs.parse_tasks(args.tasks)
    except ValueError as exc:
        ap.error(str(exc))
    args.enforce_eager = bool(args.enforce_eager)
    return args


def main() -> None:
    rc = asyncio.run(run(parse_args()))
    # run() closed the engine on every path. With CUDA graphs (--enforce-eager 0) the interpreter was seen
    # on an H200 to hang at exit for over a minute after the last line (vLLM 0.26.0 threads);
    # the results are printed, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()
