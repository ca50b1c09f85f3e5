"""CPU engine vs pipeline throughput in ONE run: the raw engine's worker pool against the pipeline,
on pages of one size or of mixed sizes, 1 vs 2 infer processes, thread counts.

Every configuration reads the same images, and the rounds are interleaved (round 1 runs every
configuration in order, round 2 in reverse order, and so on), so slow drifts in machine load
hit every configuration alike. Ratios are computed within each round, and the median over
rounds is reported.

Configurations (``--configs``, comma-separated):

- ``engine:PxT[wW]``: the raw engine, without Kafka or stores. P processes, each building its
  engine with the infer stage's own ``build_engine(InferSettings())``, with
  ``OCRSTREAM_RAPIDOCR_THREADS=T`` and ``OCRSTREAM_RAPIDOCR_WORKERS=W``, each handed its whole
  share of pages at once (every tile of ``make_tiles`` a ``engine.page`` call): a pool of W
  workers with no barrier, the best the engine can do. Decoding happens before the clock
  starts. Process i gets the images of the partitions that infer process i would own.
- ``pipe:PxT[wW][mM]``: the whole pipeline. Submit -> ingest -> dedup -> infer -> sink ->
  ``ocr.completed``, with P infer processes, the same engine settings and, with ``mM``,
  ``OCRSTREAM_MAX_IN_FLIGHT=M`` (default: the window the engine's slots give, W + 3). Dedup's
  cache is off (``OCRSTREAM_CACHE_ENABLED=false``), so every image is inferred in every round.
  Each configuration has its own namespace (topics, groups and Redis prefix), started once and
  warmed up before round 1. Between its rounds it is idle.

Throughput. A round submits the whole backlog of N images at once (or hands it to the engine
processes at once) and measures N / (time from submission to the last completion). The warm-up
is left out: every configuration has loaded its model, served an image in every process and
settled its consumer groups before round 1. What is left in is one fill latency (the first
image going through ingest and dedup before infer can start) and one drain latency (the last
page going through the sink): under 1 s against a round of tens of seconds, counted against the
pipeline, so the pipeline/engine ratio is a slight underestimate.

The images (``--pages``):

- ``same``: generated printed-text pages (``tests.conftest.text_image``), all of the same shape
  (3 lines of similar length), so each one costs the engine about the same;
- ``mixed`` (the default): one-line images, receipts (the SROIE samples of ``../shared/samples``,
  each made distinct by one changed pixel) and A4 pages at 150 dpi (1240 x 1754 px, 40 printed
  lines) interleaved, so pages cost the engine from under a second to several: what a batch
  with a barrier handles worst.

Either way they are chosen so that their SHA-256 keys fall evenly on the partitions, so two
infer processes get equal shares and the end of a round does not measure partition imbalance.

Where the CPU goes. For each pipeline round, the CPU seconds per image of each stage process,
of the local stack (Kafka, Redis, MariaDB, MinIO), of this bench process, of the idle
configurations, and of the rest of the machine (other users) are read from /proc.

Summary: images/s and every ratio as the median over all rounds, and again over the quiet rounds
only (the rest of the machine under ``QUIET_REST_CPU``), side by side; quote one and say which.
Target (the window, with the default settings): pipeline/engine >= 0.95 on mixed pages.

Usage: python -m bench.infer_bench [--n 24] [--rounds 3] [--pages mixed|same] [--configs ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from services.infer.engines.base import OCR

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/infer_bench.py` as well as `python -m bench.infer_bench`
    sys.path.insert(0, str(REPO))

DEFAULT_CONFIGS = "engine:1x1w2,pipe:1x1w2"
"""The default settings (1 process, 2 workers of 1 thread), raw engine and pipeline."""
WORDS = ("invoice total amount paid cash change receipt order number date station token item price "
         "quantity account balance payment customer service").split()


# -- configurations -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One measured configuration: raw engine or pipeline, P processes x T threads, W workers, a
    window of M (0: the default)."""

    kind: str  # "engine" | "pipe"
    procs: int
    threads: int
    workers: int = 1
    window: int = 0

    @property
    def name(self) -> str:
        w = f"w{self.workers}" if self.workers != 1 else ""
        m = f"m{self.window}" if self.window else ""
        return f"{self.kind}:{self.procs}x{self.threads}{w}{m}"

    def engine_env(self) -> dict[str, str]:
        """Settings of each infer (or raw engine) process."""
        env = {"OCRSTREAM_ENGINE_KIND": "rapidocr", "OCRSTREAM_RAPIDOCR_THREADS": str(self.threads),
               "OCRSTREAM_RAPIDOCR_WORKERS": str(self.workers)}
        if self.window:
            env["OCRSTREAM_MAX_IN_FLIGHT"] = str(self.window)
        return env


def parse_config(text: str) -> Config:
    """``engine:1x2``, ``pipe:2x1``, ``pipe:1x1w2m8`` -> :class:`Config`."""
    m = re.fullmatch(r"(engine|pipe):(\d+)x(\d+)(?:w(\d+))?(?:m(\d+))?", text.strip())
    if not m or (m.group(1) == "engine" and m.group(5)):
        raise ValueError(f"bad configuration {text!r}: use engine:PxT[wW] or pipe:PxT[wW][mM]")
    kind, p, t, w, mm = m.groups()
    return Config(kind, int(p), int(t), int(w or 1), int(mm or 0))


# -- images ------------------------------------------------------------------------------------
def partition_of(key: str, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as aiokafka's) gives ``key``."""
    from aiokafka.partitioner import murmur2

    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


SAMPLES = REPO.parent / "shared" / "samples"


def _same_page(rng: random.Random, i: int) -> bytes:
    """A printed-text PNG of 3 lines, 640 px wide (every one about the same cost)."""
    from tests.conftest import text_image

    lines = [" ".join(rng.choice(WORDS) for _ in range(3)) + f" {i:04d}-{k}" for k in range(3)]
    return text_image(lines, size=32, width=640)


def _mixed_page(rng: random.Random, i: int) -> bytes:
    """Page ``i`` of the mixed set: a one-line image, a receipt or an A4 page, in turn."""
    import io

    from PIL import Image

    from tests.conftest import text_image

    kind = i % 3
    if kind == 0:
        return text_image([" ".join(rng.choice(WORDS) for _ in range(4)) + f" {i:04d}"], size=32)
    if kind == 1:
        receipts = sorted(SAMPLES.glob("sroie_*.jpg"))
        img = Image.open(receipts[(i // 3) % len(receipts)]).convert("RGB")
        img.putpixel((i % img.width, 0), (i % 256, 255 - i % 256, 128))  # distinct bytes, same page
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue()
    lines = [" ".join(rng.choice(WORDS) for _ in range(6)) + f" {i:04d}-{k:02d}" for k in range(40)]
    return text_image(lines, size=24, width=1240)  # 1240 x 1760 px


def balanced_images(n: int, partitions: int, seed: int = 11, pages: str = "same") -> list[tuple[bytes, int]]:
    """``n`` distinct PNGs (``pages``: ``same`` or ``mixed``, module docstring), ``n / partitions``
    per partition.

    Returns:
        ``(png bytes, partition of its SHA-256 key)`` pairs, interleaved over the partitions.
    """
    if n % partitions:
        raise ValueError(f"--n must be a multiple of the partitions ({partitions})")
    make = _mixed_page if pages == "mixed" else _same_page
    rng = random.Random(seed)
    per = n // partitions
    buckets: list[list[bytes]] = [[] for _ in range(partitions)]
    i = 0
    while any(len(b) < per for b in buckets):
        data = make(rng, i)
        part = partition_of(hashlib.sha256(data).hexdigest(), partitions)
        if len(buckets[part]) < per:
            buckets[part].append(data)
        i += 1
    return [(buckets[p][j], p) for j in range(per) for p in range(partitions)]


# -- rates -------------------------------------------------------------------------------------
def backlog_rate(start: float, done: list[float]) -> float:
    """Images/s from submission (``start``) to the last completion."""
    return len(done) / (max(done) - start)


# -- CPU accounting ----------------------------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``, idle and iowait excluded)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / CLK_TCK


STACK = {"kafka": "kafka.Kafka", "redis": "redis-server", "mariadb": "mariadbd", "minio": "minio server"}


def stack_pids() -> dict[str, list[int]]:
    """Process ids of the local stack by component: Kafka, Redis, MariaDB and MinIO (from /proc)."""
    pids: dict[str, list[int]] = {name: [] for name in STACK}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name, needle in STACK.items():
            if needle in cmd:
                pids[name].append(int(d))
    return pids


# -- raw engine processes ----------------------------------------------------------------------
def _engine_worker(env: dict[str, str], images: list[bytes], conn) -> None:
    """One raw engine process: build the engine like the infer stage, decode, then on "go" hand
    every page's tiles to the engine at once (its workers are the pool, no barrier)."""
    os.environ.update(env)

    from services.common.images.imaging import decode
    from services.infer.main import build_engine
    from services.infer.settings import InferSettings
    from services.infer.tiles import make_tiles

    async def main() -> None:
        s = InferSettings()
        engine = build_engine(s)
        await engine.start()
        pages = [p for data in images for p in decode(data, s.limits.max_pixels, s.limits.max_pages)]
        conn.send("ready")
        async def one(page) -> float:
            tiles = [t.image for t in make_tiles(page, s.tile_max_aspect, engine.max_side,
                                                 downscale=not engine.shrinks_large_pages)]
            await asyncio.gather(*(engine.page(t, OCR, s.limits.infer_timeout_s) for t in tiles))
            return time.time()

        while conn.recv() == "go":
            conn.send(list(await asyncio.gather(*(one(p) for p in pages))))
        await engine.close()

    asyncio.run(main())


@dataclass
class EngineRunner:
    """P persistent raw engine processes (models loaded once), started together each round."""

    cfg: Config
    images: list[tuple[bytes, int]]
    partitions: int
    procs: list = field(default_factory=list)
    conns: list = field(default_factory=list)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        # partitions of infer process i under the range assignor: a contiguous block
        per = self.partitions // self.cfg.procs
        for i in range(self.cfg.procs):
            own = range(i * per, (i + 1) * per if i < self.cfg.procs - 1 else self.partitions)
            share = [data for data, part in self.images if part in own]
            parent, child = ctx.Pipe()
            env = {**self.cfg.engine_env(), "PYTHONPATH": str(REPO)}
            p = ctx.Process(target=_engine_worker, args=(env, share, child), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        for c in self.conns:
            if not c.poll(600):
                raise TimeoutError(f"{self.cfg.name}: engine process not ready")
            assert c.recv() == "ready"

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run_round(self) -> tuple[float, list[float]]:
        """(start time, completion time of every image)."""
        t0 = time.time()
        for c in self.conns:
            c.send("go")
        done: list[float] = []
        for c in self.conns:
            if not c.poll(3600):
                raise TimeoutError(f"{self.cfg.name}: round did not finish")
            done += c.recv()
        return t0, done

    def stop(self) -> None:
        for c in self.conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.terminate()


# -- pipelines ---------------------------------------------------------------------------------
@dataclass
class PipeRunner:
    """One configuration's own namespaced pipeline: ingest, dedup (cache off), P infer, sink."""

    cfg: Config
    images: list[tuple[bytes, int]]
    partitions: int
    logdir: Path
    pipeline: object = None
    env: dict[str, str] = field(default_factory=dict)
    last_infer_seconds: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        from tests.stack import Pipeline, env_applied, namespace_env

        tag = f"ib{os.getpid()}{re.sub(r'[^a-z0-9]', '', self.cfg.name)}"
        self.env = {**namespace_env(tag, partitions=self.partitions), "OCRSTREAM_CACHE_ENABLED": "false",
                    "OCRSTREAM_TELEMETRY__LOG_LEVEL": "WARNING"}
        with env_applied(self.env):
            subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        self.pipeline = p = Pipeline(env=self.env, logdir=self.logdir / tag)
        p.logdir.mkdir(parents=True, exist_ok=True)
        for st in ("ingest", "dedup", "sink"):
            p.start(st, wait_ready=False)
        for _ in range(self.cfg.procs):
            p.start("infer", self.cfg.engine_env(), wait_ready=False)

    def wait_ready(self) -> None:
        for sts in self.pipeline.stages.values():
            for st in sts:
                self.pipeline.wait_ready(st, timeout=600)

    def pids(self) -> dict[str, list[int]]:
        return {name: [st.proc.pid for st in sts] for name, sts in self.pipeline.stages.items()}

    def run_round(self, items: list[tuple[bytes, str]] | None = None) -> tuple[float, list[float]]:
        """(submission time, completion time of every image), from the sink's ``completed_at_ms``."""
        from tests.stack import env_applied

        items = items or [(data, f"bench-{i}.png") for i, (data, _) in enumerate(self.images)]
        m0 = self.infer_seconds()
        with env_applied(self.env):
            t0, docs = asyncio.run(_submit_and_wait(items))
        m1 = self.infer_seconds()
        self.last_infer_seconds = {k: m1[k] - m0[k] for k in m0}
        bad = [d for d in docs if d.status != "ok"]
        if bad:
            raise RuntimeError(f"{self.cfg.name}: {len(bad)} images failed, e.g. {bad[0].error}")
        return t0, [d.completed_at_ms / 1000 for d in docs]

    def infer_seconds(self) -> dict[str, float]:
        """Seconds the infer processes' requests spent on the engine so far (wall time per request,
        engine slot waits included; all processes)."""
        from tests.stack import metric_value

        return {"engine": metric_value(self.pipeline.metrics("infer"), "ocrstream_engine_seconds_sum")}

    def warm_up(self) -> None:
        """One image per partition through every stage (every infer process gets work), not timed."""
        warm = balanced_images(self.partitions, self.partitions, seed=99, pages="same")
        self.run_round([(data, f"warm-{i}.png") for i, (data, _) in enumerate(warm)])

    def stop(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop_all()


async def _submit_and_wait(items: list[tuple[bytes, str]], timeout: float = 3600):
    from services.cli.client import Submitter
    from services.common.results.completions import CompletionWatcher
    from services.common.settings import CommonSettings

    s = CommonSettings()
    watcher, submitter = CompletionWatcher(s), Submitter(s)
    await watcher.start()
    await submitter.start()
    try:
        t0 = time.time()
        ids = await submitter.submit_many(items, source="bench")
    finally:
        await submitter.stop()
    done = {}
    try:
        async def collect():
            async for ev in watcher.completions(set(ids)):
                done[ev.request_id] = ev.result

        await asyncio.wait_for(collect(), timeout)
    finally:
        await watcher.stop()
    return t0, [done[i] for i in ids]


QUIET_REST_CPU = 0.1
"""A round is "quiet" when the rest of the machine (other users) used under this many CPU-s per image."""


def summarize(results: dict[str, list[dict]], names: list[str], rounds: int) -> dict[str, list[float]]:
    """Print images/s, CPU per image and the ratios; return the per-round ratios."""
    quiet = lambda x: x["cpu_rest_of_machine"] < QUIET_REST_CPU  # noqa: E731
    med = lambda vs: f"{statistics.median(vs):.3f}" if vs else "  -  "  # noqa: E731
    print("\n== images/s (median over all rounds, median over quiet rounds; every round in brackets, * = quiet)")
    for n in names:
        st = [x["rate"] for x in results[n]]
        rounds_txt = ", ".join(f"{x['rate']:.3f}" + ("*" if quiet(x) else "") for x in results[n])
        print(f"{n:16s} all {statistics.median(st):.3f}  quiet {med([x['rate'] for x in results[n] if quiet(x)])} "
              f"[{rounds_txt}]   {statistics.median(x['engine_s_per_img'] for x in results[n]):.3f} engine-s/img")
    print("\n== CPU seconds per image (mean over rounds)")
    for n in names:
        keys = [k for k in results[n][0] if k.startswith("cpu_")]
        print(f"{n:16s} " + "  ".join(f"{k[4:]} {statistics.mean(x[k] for x in results[n]):.3f}" for k in keys))
    ratios = {}
    print("\n== ratios (each computed within a round; median [per round])")
    for label, a, b in _ratio_pairs(names):
        per = [x["rate"] / y["rate"] for x, y in zip(results[a], results[b])]
        ratios[label] = per
        print(f"{label:34s} {statistics.median(per):.3f} [{', '.join(f'{v:.3f}' for v in per)}]")
    pipes = [n for n in names if n.startswith("pipe:")]
    engines = [n for n in names if n.startswith("engine:")]
    if pipes and engines:
        med = {n: statistics.median(x["rate"] for x in results[n]) for n in names}
        bp, be = max(pipes, key=med.get), max(engines, key=med.get)
        per = [max(results[p][i]["rate"] for p in pipes) / max(results[e][i]["rate"] for e in engines)
               for i in range(rounds)]
        ratios["best pipeline/best engine"] = per
        print(f"{'best pipeline/best engine':34s} {statistics.median(per):.3f} [{', '.join(f'{v:.3f}' for v in per)}]"
              f"  (by median: {bp} vs {be})")
    # Rounds that other users left alone: the same ratios over those only (where both sides were quiet),
    # next to the all-rounds median, so a summary can quote either and say which
    print(f"\n== quiet rounds only (rest of machine under {QUIET_REST_CPU} CPU-s/img on both sides), "
          "next to the all-rounds median")
    for label, a, b in _ratio_pairs(names):
        every = [x["rate"] / y["rate"] for x, y in zip(results[a], results[b])]
        per = [x["rate"] / y["rate"] for x, y in zip(results[a], results[b]) if quiet(x) and quiet(y)]
        print(f"{label:34s} all {statistics.median(every):.3f}  quiet "
              + (f"{statistics.median(per):.3f} [{', '.join(f'{v:.3f}' for v in per)}] ({len(per)} of {len(every)} rounds)"
                 if per else "no quiet pair"))
    # What the pipeline adds in CPU per image, against the engine's own CPU per image. When both cores
    # run the engine (2 processes, or 2 workers), this extra CPU comes out of the engine's share, so the
    # ratio it predicts is engine / (engine + extra); with one engine thread it fits in the other core.
    if engines and pipes:
        mean = lambda n, k: statistics.mean(x.get(k, 0.0) for x in results[n])  # noqa: E731
        stack = ("cpu_kafka", "cpu_redis", "cpu_mariadb", "cpu_minio")
        base_stack = statistics.mean(sum(mean(n, k) for k in stack) for n in engines)
        print("\n== CPU the pipeline adds per image (stages other than infer + submitting client + local stack above "
              "its level in the engine rounds)")
        for n in pipes:
            extra = sum(mean(n, k) for k in ("cpu_ingest", "cpu_dedup", "cpu_sink", "cpu_bench"))
            extra += max(0.0, sum(mean(n, k) for k in stack) - base_stack)
            eng = mean(n, "cpu_infer")
            print(f"{n:16s} extra {extra:.3f} CPU-s/img vs infer {eng:.3f} CPU-s/img: "
                  f"{extra / eng:.1%}; on 2 saturated cores that predicts pipeline/engine {eng / (eng + extra):.3f}")
    return ratios


# -- the run -----------------------------------------------------------------------------------
def _ratio_pairs(names: list[str]) -> list[tuple[str, str, str]]:
    """(label, numerator, denominator) for every ratio whose two configurations were measured."""
    pairs = []
    for n in names:
        c = parse_config(n)
        if c.kind == "pipe":
            eng = Config("engine", c.procs, c.threads, c.workers).name
            if eng in names:
                pairs.append((f"pipeline/engine {n[5:]}", n, eng))
    for n in names:
        c = parse_config(n)
        one = Config(c.kind, 1, c.threads, c.workers, c.window).name
        if c.procs == 2 and one in names:
            pairs.append((f"2 procs/1 proc {n}", n, one))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="images per round (a multiple of --partitions)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated configurations (module docstring)")
    ap.add_argument("--pages", choices=("mixed", "same"), default="mixed", help="page sizes (module docstring)")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--from-json", type=Path, help="only print the summary of a run saved with --json")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        summarize(saved["results"], list(saved["results"]), saved["rounds"])
        return

    from tests.stack import stack_reachable

    missing = stack_reachable()
    if missing:
        sys.exit(f"local stack not reachable ({missing}): run deploy/local/up.sh")
    cfgs = [parse_config(c) for c in args.configs.split(",")]
    names = [c.name for c in cfgs]
    images = balanced_images(args.n, args.partitions, pages=args.pages)
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"machine: {platform.machine()} {cpu_model}, nproc {os.cpu_count()}; load {os.getloadavg()}")
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = git("status", "--porcelain", "--", "services/infer", "services/common")
    print(f"code: {git('rev-parse', '--short', 'HEAD')}" + (f", uncommitted changes in: {' '.join(ln[3:] for ln in dirty.splitlines())}"
                                                           if dirty else ", services/infer and services/common as committed"))
    print(f"{args.n} {args.pages} pages ({args.n // args.partitions} per partition), "
          f"{args.rounds} interleaved rounds, configs: {', '.join(names)}", flush=True)

    logdir = Path(tempfile.mkdtemp(prefix="infer-bench-"))
    runners: dict[str, EngineRunner | PipeRunner] = {}
    try:
        for c in cfgs:  # start everything (models load in parallel), then wait
            r = EngineRunner(c, images, args.partitions) if c.kind == "engine" else PipeRunner(c, images, args.partitions, logdir)
            if c.kind == "pipe":
                r.start()
            runners[c.name] = r
        for r in runners.values():
            if isinstance(r, EngineRunner):
                r.start()
            else:
                r.wait_ready()
                r.warm_up()
        print(f"all configurations ready and warmed up; stage logs in {logdir}", flush=True)

        def all_pids() -> dict[str, list[int]]:
            out = {}
            for n, r in runners.items():
                out[n] = r.pids() if isinstance(r, EngineRunner) else [p for ps in r.pids().values() for p in ps]
            return out

        stack = stack_pids()
        # idle cost of everything started, over 10 s (what an idle configuration takes from a measured one)
        everything = [p for ps in all_pids().values() for p in ps]
        print("local stack: " + ", ".join(f"{k} {v}" for k, v in stack.items()))
        c0, m0 = sum(map(cpu_seconds, everything)), machine_busy_seconds()
        time.sleep(10)
        idle_cpu = (sum(map(cpu_seconds, everything)) - c0) / 10
        print(f"idle: all configurations' processes use {idle_cpu * 100:.1f}% of one core; "
              f"whole machine busy {(machine_busy_seconds() - m0) * 10:.0f}% of one core", flush=True)

        results: dict[str, list[dict]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for n in order:
                r, c = runners[n], parse_config(n)
                pids = all_pids()
                own = r.pids() if isinstance(r, PipeRunner) else {"engine": r.pids()}
                others = [p for m, ps in pids.items() if m != n for p in ps]
                snap = lambda: ({k: sum(map(cpu_seconds, v)) for k, v in {**own, **stack}.items()},  # noqa: E731
                                0.0, sum(map(cpu_seconds, others)),
                                cpu_seconds(os.getpid()), machine_busy_seconds())
                before, load = snap(), os.getloadavg()[0]
                t0, done = r.run_round()
                after = snap()
                wall = max(done) - t0
                cpu = {f"cpu_{k}": (after[0][k] - before[0][k]) / args.n for k in {**own, **stack}}
                cpu.update(cpu_idle_configs=(after[2] - before[2]) / args.n,
                           cpu_bench=(after[3] - before[3]) / args.n)
                accounted = sum(after[0].values()) - sum(before[0].values()) + sum(
                    after[i] - before[i] for i in (1, 2, 3))
                cpu["cpu_rest_of_machine"] = max(0.0, (after[4] - before[4]) - accounted) / args.n
                rec = dict(round=rnd + 1, rate=backlog_rate(t0, done), first_s=min(done) - t0, wall_s=wall,
                           load1=load, machine_busy_cores=(after[4] - before[4]) / wall, **cpu)
                if isinstance(r, PipeRunner):
                    # where infer's time goes: engine busy share and engine seconds per image
                    busy = r.last_infer_seconds
                    rec.update(engine_s_per_img=busy["engine"] / args.n)
                else:
                    rec.update(engine_s_per_img=c.procs * wall / args.n)
                results[n].append(rec)
                print(f"round {rnd + 1} {n:16s} {rec['rate']:.3f} img/s  first completion {rec['first_s']:.1f}s  "
                      f"{rec['engine_s_per_img']:.3f} engine-s/img (wall {wall:.1f}s, load {load:.2f}, machine busy {rec['machine_busy_cores']:.2f} cores)  "
                      + "  ".join(f"{k[4:]} {v:.3f}" for k, v in cpu.items()) + " CPU-s/img", flush=True)
    finally:
        for r in runners.values():
            r.stop()

    ratios = summarize(results, names, args.rounds)
    print(f"\nload average at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"machine": {"nproc": os.cpu_count(), "cpu": cpu_model},
                                         "n": args.n, "rounds": args.rounds, "idle_cpu_cores": idle_cpu,
                                         "results": results, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
