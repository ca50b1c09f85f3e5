"""The pipeline's pages/s against an ideal client, both on a loopback stand-in for one GPU serving an OCR VLM.

What it measures. How close the whole pipeline comes to what the engine can do when it is kept
full: the infer stage's engine is the ``openai`` engine pointed at :mod:`bench.vlm_standin` (one
simulated GPU with continuous batching, as vLLM: up to 256 running sequences, answers of
long-tailed lengths), and the same N pages are read

* by the **ideal client** (mode ``ideal``): the pages sent straight to the stand-in with K
  requests in flight (asyncio + httpx), each body built exactly as
  :meth:`services.infer.engines.openai_engine.OpenAiEngine.payload` builds it (the page decoded to
  RGB, :func:`~services.infer.engines.hunyuan_prompts.pad_for_vlm`, then ``payload``; bodies built
  before the clock starts); pages/s from the first request to the last answer;
* by the **pipeline** (mode ``pipeline``): the N pages as one job on ``ocr.submit`` through
  ingest, dedup, infer, sink and jobs, as real processes on the local stack
  (``deploy/local/up.sh``) in a fresh namespace (topics, bucket, Redis prefix: nothing cached), the
  infer stage's engine set by ``OCRSTREAM_ENGINE_KIND=openai``, ``OCRSTREAM_ENGINE__ENGINE=openai``,
  ``OCRSTREAM_ENGINE__MODEL=tencent/HunyuanOCR``, ``OCRSTREAM_OPENAI_BASE_URL`` (the stand-in),
  ``OCRSTREAM_OPENAI_MAX_CONCURRENCY=K`` and ``OCRSTREAM_OPENAI_READY_TIMEOUT_S=60``, plus
  ``--env NAME=VALUE`` (the windowed infer reads ``OCRSTREAM_MAX_IN_FLIGHT``; the micro-batch
  one ``OCRSTREAM_MAX_BATCH`` and ``OCRSTREAM_MAX_WAIT_MS``); pages/s from the job's create event
  (just before the first submit) to its ``ocr.job-completed`` record (the record's Kafka
  timestamp). ``--repo DIR`` runs every process of the pipeline (topic creation, the stages, the
  submitting client) from another checkout with this checkout's interpreter (``cwd=DIR``,
  ``PYTHONPATH=DIR``), so an older commit can be measured: ``git worktree add
  /tmp/ocrstream-before 7100ff1``; the bench prints the file the infer stage's handler is
  imported from, checked the same way;
* ``all`` (the default): the ideal client and each ``--configs`` entry in one run, each with a
  fresh stand-in, printing pages/s and the ratio to the ideal client at the same N, then a final
  line ``RESULT {json}``.

The stand-in's counters (``GET /stats``) are read before and after each run: requests and tokens
(the same pages give the same token total in every run, which the bench checks), mean running
sequences per engine step (how full the "GPU" was; 256 at most), and busy time / wall time; and
its arrival and finish times (``timeline*.json`` in the log folder): when 50% and 90% of the pages
were answered (pages/s to 90% leaves out the tail of the last long answers, which is up to ~35 s
for any client), the requests at the engine on average and the time it had none. The pipeline rows
also give the CPU seconds of each stage's processes (their children included) during the job, and
the load average.

Stand-in parameters (``bench/vlm_standin.py``, its defaults; ``--standin "--flag value ..."``
changes them): 256 sequences at most; a step is 8 ms + 0.12 ms per running sequence + 0.01 ms per
prompt token admitted; a 480 x 360 page's prompt is 241 tokens; answer lengths lognormal, median
300 tokens, sigma 1.0, clipped to [8, 4096] (mean ~495), seeded by the image bytes. At 256 in
flight it does ~13 pages/s of these pages.

Pages: N distinct generated 480 x 360 PNGs (a header, three text lines and a unique stamp), the
same N in every run (they depend only on their index), so token totals and lengths agree between
runs and between checkouts.

Target: the pipeline at >= 0.9x the ideal client with 256 in flight.

Usage:
  python -m bench.window_bench [all|ideal|pipeline] [--n 800] [--k 256]
      [--configs 'new:OCRSTREAM_MAX_IN_FLIGHT=288' 'old16:repo=/tmp/ocrstream-before,OCRSTREAM_MAX_BATCH=16,n=300']
      [--repo DIR] [--env NAME=VALUE ...] [--standin '--median-tokens 300']

A config is ``NAME[:KEY=VALUE,...]``: ``repo=DIR`` the checkout its processes run from, ``n=M`` its
own page count (the first M pages; the ideal client is then also run at M), every other key an
environment variable of its stages. Without ``--configs``, the one pipeline is ``--repo`` with
``--env``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.stack import REPO, Pipeline, Stage, free_port

STAGES = ("ingest", "dedup", "infer", "sink", "jobs")
PAGE_SIZE = (480, 360)
"""Width and height of each generated page, px."""

DRIVER = r"""
import asyncio, json, sys, time
from pathlib import Path
from aiokafka import TopicPartition
from schemas.jobs import JobEvent
from services.cli.client import Submitter
from services.common.db import Database
from services.common.jobs.store import JobStore
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings

async def main(folder, job_id, n, timeout):
    items = [(f.read_bytes(), f.name) for f in sorted(Path(folder).glob("*.png"))[:n]]
    s = CommonSettings()
    consumer = make_consumer(s.kafka, [], None, client_id="window-bench", auto_offset_reset="earliest")
    await consumer.start()
    parts = consumer.partitions_for_topic(s.topics.job_completed) or set()
    if not parts:
        await consumer._client.force_metadata_update()
        parts = consumer.partitions_for_topic(s.topics.job_completed) or set()
    tps = [TopicPartition(s.topics.job_completed, p) for p in sorted(parts)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    sub = Submitter(s)
    await sub.start()
    t0 = time.time()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id, name="window-bench"))
        for i in range(0, len(items), 500):
            await sub.submit_many(items[i:i + 500], source="bench", job_id=job_id)
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=len(items)))
    finally:
        await sub.stop()
    submitted = time.time() - t0
    print(f"PROGRESS submitted {len(items)} pages in {submitted:.1f} s", flush=True)
    store, last = JobStore(Database(s.mysql, pool_size=1)), time.time()
    try:
        while time.time() < t0 + timeout:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                for r in recs:
                    if r.key == job_id.encode():
                        ev = json.loads(r.value)
                        print("DRIVER " + json.dumps({"t0": t0, "submitted_s": submitted, "end": r.timestamp / 1000,
                              "completed_at": ev["completed_at_ms"] / 1000, "progress": ev.get("progress"),
                              "by_status": (ev.get("summary") or {}).get("by_status")}), flush=True)
                        return
            if time.time() - last > 30:
                last = time.time()
                prog = await store.progress(job_id)
                print(f"PROGRESS {last - t0:7.1f} s: {prog.done if prog else 0} of {len(items)} final", flush=True)
    finally:
        await consumer.stop()
    raise SystemExit(f"no completion of {job_id} within {timeout} s")

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
"""
"""Run in the checkout under test (``python -c DRIVER folder job_id n timeout_s``): submits the
pages as one job, waits for its completion record, prints ``DRIVER {json}``."""

WHERE = "import services.infer.handler as h, services.common.app as a; print(h.__file__, a.__file__)"
NAMESPACE = "import json; from tests.stack import namespace_env; print(json.dumps(namespace_env(partitions={p})))"


# ---------------------------------------------------------------------------- pages and the stand-in

def make_pages(n: int) -> list[bytes]:
    """``n`` distinct 480 x 360 PNG pages (a header, three printed lines, a stamp with the index);
    page ``i`` depends only on ``i``."""
    from PIL import Image, ImageDraw

    from tests.conftest import font

    big, small = font(26), font(18)
    out = []
    for i in range(n):
        img = Image.new("RGB", PAGE_SIZE, "white")
        d = ImageDraw.Draw(img)
        d.text((24, 20), f"WINDOW BENCH PAGE {i:05d}", fill="black", font=big)
        for j, line in enumerate((f"ORDER {1000 + 7 * i} ITEM {i % 97}", f"AMOUNT {i * 13 % 10000 / 100:.2f}",
                                  f"REF {(i * 2654435761) % 2**32:08x}")):
            d.text((24, 90 + 50 * j), line, fill="black", font=small)
        d.rectangle((300, 280, 300 + (i % 150), 300), fill="black")  # the stamp
        buf = io.BytesIO()
        img.save(buf, "PNG")
        out.append(buf.getvalue())
    return out


class StandIn:
    """``python -m bench.vlm_standin --port 0 ARGS`` as a subprocess (log in ``logdir``), as a context manager.

    Attributes:
        url: Its API root, ``http://127.0.0.1:PORT/v1``.
        params: Its model parameters as printed on its ready line.
    """

    def __init__(self, args: list[str], logdir: Path):
        self.args, self.log = args, logdir / f"standin-{uuid.uuid4().hex[:6]}.log"
        self.proc: subprocess.Popen | None = None
        self.url, self.params = "", {}

    def __enter__(self) -> StandIn:
        from bench.vlm_standin import READY_PREFIX

        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.vlm_standin", "--port", "0", *self.args],
                                         cwd=REPO, stdout=logf, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(REPO)))
        deadline = time.time() + 60
        while time.time() < deadline:
            line = next((ln for ln in self.log.read_text().splitlines() if ln.startswith(READY_PREFIX)), None)
            if line:
                self.url = line.split()[3]
                self.params = json.loads(line.split(" ", 5)[5])
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"the stand-in did not start:\n{self.log.read_text()[-2000:]}")

    def stats(self) -> dict:
        """Its ``GET /stats`` (cumulative counters)."""
        with urllib.request.urlopen(self.url[:-3] + "/stats", timeout=10) as r:
            return json.loads(r.read())

    def times(self, what: str, since: float) -> list[float]:
        """Epoch seconds of its requests' arrivals (``what`` "arrivals") or of its sequences' ends
        ("finishes") after ``since``, oldest first."""
        with urllib.request.urlopen(f"{self.url[:-3]}/{what}?since={since}", timeout=10) as r:
            return json.loads(r.read())

    def cpu_s(self) -> float:
        """CPU seconds its process has used."""
        return cpu_seconds(self.proc.pid)

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def engine_usage(before: dict, after: dict, wall_s: float) -> dict:
    """The stand-in's work between two ``/stats`` reads: ``requests``, ``tokens``, ``steps``,
    ``mean_running`` (per step), ``mean_running_tw`` (time-weighted), ``busy_frac`` (modelled
    step time / ``wall_s``), ``length_cut`` and ``lag_dropped_ms``."""
    d = {k: after[k] - before[k] for k in ("requests", "tokens", "steps", "seq_steps", "seq_step_ms", "busy_ms",
                                            "length_cut", "lag_dropped_ms")}
    return {"requests": d["requests"], "tokens": d["tokens"], "steps": d["steps"],
            "mean_running": d["seq_steps"] / d["steps"] if d["steps"] else 0.0,
            "mean_running_tw": d["seq_step_ms"] / d["busy_ms"] if d["busy_ms"] else 0.0,
            "busy_frac": d["busy_ms"] / 1000 / wall_s if wall_s else 0.0,
            "length_cut": d["length_cut"], "lag_dropped_ms": round(d["lag_dropped_ms"], 1)}


def to_quantiles(si: StandIn, t0: float, n: int, dump: Path | None = None) -> dict:
    """From the stand-in's arrival and finish times (written to ``dump`` as JSON when given, epoch s):

    * ``first_request_s``, ``last_answer_s``: seconds from ``t0`` (epoch s) to the first request
      at the stand-in and to its last answer;
    * ``t50_s``, ``t90_s``: seconds from ``t0`` until 50% and 90% of ``n`` pages had their answers,
      and ``pages_per_s_to_90``: the rate without the last pages' tail, which one 4,096-token
      answer started late can stretch by ~35 s;
    * ``mean_in_flight``: requests at the stand-in (waiting or running), time-averaged from the
      first arrival to the last answer; ``empty_s``: the time in that span with none at all, and
      ``empty_gaps``: how many such gaps were longer than 0.5 s (the engine starved).
    """
    done, arrived = sorted(si.times("finishes", t0)), sorted(si.times("arrivals", t0))
    if dump is not None:
        dump.write_text(json.dumps({"t0": t0, "arrivals": arrived, "finishes": done}))
    out = {"first_request_s": round(arrived[0] - t0, 2) if arrived else None,
           "last_answer_s": round(done[-1] - t0, 2) if done else None}
    for q in (50, 90):
        i = max(1, -(-q * n // 100))
        out[f"t{q}_s"] = round(done[i - 1] - t0, 2) if len(done) >= i else None
    out["pages_per_s_to_90"] = round(0.9 * n / out["t90_s"], 3) if out["t90_s"] else None
    if arrived and done:
        events = sorted([(t, 1) for t in arrived] + [(t, -1) for t in done])
        level, area, empty, gaps, last = 0, 0.0, 0.0, 0, events[0][0]
        for t, d in events:
            area += level * (t - last)
            if level == 0 and t > last:
                empty += t - last
                gaps += t - last > 0.5
            level, last = level + d, t
        span = done[-1] - arrived[0]
        out.update(mean_in_flight=round(area / span, 1) if span > 0 else None, empty_s=round(empty, 2),
                   empty_gaps=gaps)
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants, and of their waited-for
    children; 0 for a process that is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            parents.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            f = stats[p]  # fields from state: utime 11, stime 12, cutime 13, cstime 14 (0-based here)
            total += sum(int(x) for x in f[11:15]) / tick
        todo.extend(parents.get(p, []))
    return total


# ---------------------------------------------------------------------------- the ideal client

async def _ideal(bodies: list[bytes], url: str, k: int) -> tuple[float, float, list[float], dict]:
    import httpx

    sem = asyncio.Semaphore(k)
    lat: list[float] = []
    finish: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, body: bytes) -> None:
        async with sem:
            t = time.perf_counter()
            r = await client.post(f"{url}/chat/completions", content=body, headers={"Content-Type": "application/json"})
            r.raise_for_status()
            lat.append(time.perf_counter() - t)
            fr = r.json()["choices"][0]["finish_reason"]
            finish[fr] = finish.get(fr, 0) + 1

    limits = httpx.Limits(max_connections=k, max_keepalive_connections=k)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0, epoch = time.perf_counter(), time.time()
        await asyncio.gather(*(one(client, b) for b in bodies))
        return time.perf_counter() - t0, epoch, lat, finish


def build_bodies(pages: list[bytes]) -> list[bytes]:
    """The chat-completions bodies of ``pages`` as the infer stage's ``openai`` engine sends them
    (defaults: PNG, ``max_tokens`` 4096, the spotting prompt)."""
    import numpy as np
    from PIL import Image

    from services.infer.engines.hunyuan_prompts import pad_for_vlm
    from services.infer.engines.openai_engine import OpenAiEngine

    engine = OpenAiEngine("http://127.0.0.1:1/v1", max_concurrency=1)
    try:
        return [json.dumps(engine.payload(pad_for_vlm(np.asarray(Image.open(io.BytesIO(p)).convert("RGB"))))).encode()
                for p in pages]
    finally:
        asyncio.run(engine.close())


def run_ideal(pages: list[bytes], k: int, standin_args: list[str], logdir: Path) -> dict:
    """The ideal client over ``pages`` with ``k`` in flight on a fresh stand-in: pages/s and the stand-in's usage."""
    t = time.perf_counter()
    bodies = build_bodies(pages)
    build_ms = (time.perf_counter() - t) * 1000 / len(pages)
    with StandIn(standin_args, logdir) as si:
        before, cpu0, load0 = si.stats(), si.cpu_s(), os.getloadavg()[0]
        wall, t0, lat, finish = asyncio.run(_ideal(bodies, si.url, k))
        usage = engine_usage(before, si.stats(), wall)
        quant = to_quantiles(si, t0, len(pages), logdir / f"timeline-ideal-{len(pages)}.json")
        usage["standin_cpu_s"] = round(si.cpu_s() - cpu0, 2)
        params = si.params
    lat.sort()
    return {"n": len(pages), "k": k, "wall_s": round(wall, 2), "pages_per_s": round(len(pages) / wall, 3),
            "p50_s": round(lat[len(lat) // 2], 2), "p99_s": round(lat[int(len(lat) * 0.99)], 2),
            **quant, "body_build_ms_per_page": round(build_ms, 2), "finish": finish, "engine": usage,
            "load": [round(load0, 2), round(os.getloadavg()[0], 2)], "standin": params}


# ---------------------------------------------------------------------------- the pipeline

@dataclass
class Config:
    """One pipeline run: its ``name``, the checkout its processes run from, its extra stage
    environment and its own page count (None: ``--n``)."""

    name: str
    repo: Path = REPO
    env: dict[str, str] = field(default_factory=dict)
    n: int | None = None


def parse_config(text: str) -> Config:
    """``NAME[:KEY=VALUE,...]`` -> :class:`Config` (``repo=DIR``, ``n=M``, any other key an env var).

    Raises:
        ValueError: an empty name or an item without ``=``.
    """
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"config {text!r}: no name")
    cfg = Config(name)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"config {text!r}: {item!r} is not KEY=VALUE")
        if key == "repo":
            cfg.repo = Path(value).resolve()
        elif key == "n":
            cfg.n = int(value)
        else:
            cfg.env[key] = value
    return cfg


@dataclass
class RepoPipeline(Pipeline):
    """:class:`tests.stack.Pipeline` whose stage processes run from the checkout ``repo``
    (``cwd`` and ``PYTHONPATH``; this interpreter)."""

    repo: Path = REPO

    def start(self, name: str, extra_env: dict[str, str] | None = None, wait_ready: bool = True) -> Stage:
        """Start one more process of stage ``name`` from :attr:`repo`."""
        port = free_port()
        st = Stage(name, port, self.logdir / f"{name}-{len(self.stages.get(name, []))}.log")
        env = dict(os.environ, **self.env, **(extra_env or {}), OCRSTREAM_TELEMETRY__METRICS_PORT=str(port),
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(self.repo))
        with open(st.log, "ab") as logf:
            st.proc = subprocess.Popen([sys.executable, "-m", f"services.{name}"], cwd=self.repo, env=env,
                                       stdout=logf, stderr=subprocess.STDOUT)
        self.stages.setdefault(name, []).append(st)
        if wait_ready:
            self.wait_ready(st)
        return st


def checkout_commit(repo: Path) -> str:
    """``repo``'s short commit, ``+modified`` when its tracked files differ from it (read-only git plumbing)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    dirty = subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"], cwd=repo, capture_output=True)
    return head.stdout.strip() + ("+modified" if dirty.returncode == 1 else "")


def _in_repo(repo: Path, code: str, env: dict[str, str] | None = None) -> str:
    """stdout of ``python -c code`` run from ``repo``."""
    return subprocess.run([sys.executable, "-c", code], cwd=repo, check=True, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {}), PYTHONPATH=str(repo))).stdout.strip()


def run_pipeline(cfg: Config, pages_dir: Path, n: int, k: int, standin_args: list[str], logdir: Path,
                 timeout_s: float) -> dict:
    """The first ``n`` pages of ``pages_dir`` as one job through the pipeline of ``cfg`` on a fresh stand-in."""
    run_dir = logdir / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    with StandIn(standin_args, run_dir) as si:
        env = {**json.loads(_in_repo(cfg.repo, NAMESPACE.format(p=4))),
               "OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_ENGINE__ENGINE": "openai",
               "OCRSTREAM_ENGINE__MODEL": "tencent/HunyuanOCR", "OCRSTREAM_OPENAI_BASE_URL": si.url,
               "OCRSTREAM_OPENAI_MAX_CONCURRENCY": str(k), "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60", **cfg.env}
        where = _in_repo(cfg.repo, WHERE, env)
        print(f"[{cfg.name}] stage code from {where}; stage logs in {run_dir}", flush=True)
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=cfg.repo, check=True, capture_output=True,
                       env=dict(os.environ, **env, PYTHONPATH=str(cfg.repo)))
        p = RepoPipeline(env=env, logdir=run_dir, repo=cfg.repo)
        try:
            for st in STAGES:
                p.start(st, wait_ready=False)
            for sts in p.stages.values():
                for st in sts:
                    p.wait_ready(st)
            infer = p.stages["infer"][0]
            cwd = os.readlink(f"/proc/{infer.proc.pid}/cwd")
            window = "a window of" in infer.log.read_text()
            print(f"[{cfg.name}] infer pid {infer.proc.pid} cwd {cwd}; windowed runner: {window}", flush=True)
            before, load0 = si.stats(), os.getloadavg()[0]
            cpu0 = {name: sum(cpu_seconds(s.proc.pid) for s in sts) for name, sts in p.stages.items()}
            scpu0 = si.cpu_s()
            job_id = f"window-{cfg.name}-{uuid.uuid4().hex[:6]}"
            drv = subprocess.Popen([sys.executable, "-c", DRIVER, str(pages_dir), job_id, str(n), str(timeout_s)],
                                   cwd=cfg.repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=dict(os.environ, **env, PYTHONPATH=str(cfg.repo)))
            out = None
            for line in drv.stdout:
                if line.startswith("DRIVER "):
                    out = json.loads(line[7:])
                else:
                    print(f"[{cfg.name}] {line.rstrip()}", flush=True)
            if drv.wait() != 0 or out is None:
                raise RuntimeError(f"[{cfg.name}] the driver failed (exit {drv.returncode}); logs in {run_dir}")
            wall = out["end"] - out["t0"]
            usage = engine_usage(before, si.stats(), wall)
            usage["standin_cpu_s"] = round(si.cpu_s() - scpu0, 2)
            quant = to_quantiles(si, out["t0"], n, run_dir / "timeline.json")
            cpu = {name: round(sum(cpu_seconds(s.proc.pid) for s in sts) - cpu0[name], 1)
                   for name, sts in p.stages.items()}
        finally:
            p.stop_all()
    return {"name": cfg.name, "repo": str(cfg.repo), "commit": checkout_commit(cfg.repo), "env": cfg.env,
            "n": n, "k": k, "wall_s": round(wall, 2), "pages_per_s": round(n / wall, 3), **quant,
            "submit_s": round(out["submitted_s"], 2),
            "last_result_s": round(out["completed_at"] - out["t0"], 2), "by_status": out["by_status"],
            "engine": usage, "stage_cpu_s": cpu, "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "standin": si.params, "infer_windowed": window, "infer_code": where.split()[0]}


# ---------------------------------------------------------------------------- main

def _print_ideal(r: dict) -> None:
    e = r["engine"]
    print(f"ideal client n={r['n']} k={r['k']}: {r['pages_per_s']:.2f} pages/s ({r['wall_s']:.1f} s; 50%/90% of "
          f"the pages done at {r['t50_s']}/{r['t90_s']} s: {r['pages_per_s_to_90']} pages/s to 90%; "
          f"{r.get('mean_in_flight')} requests at the engine on average; latency p50 "
          f"{r['p50_s']} s, p99 {r['p99_s']} s); engine: {e['tokens']} tokens, mean running {e['mean_running']:.1f} "
          f"per step ({e['mean_running_tw']:.1f} time-weighted), busy {e['busy_frac']:.2f} of the wall time, "
          f"lag dropped {e['lag_dropped_ms']} ms, stand-in CPU {e['standin_cpu_s']} s; load {r['load']}", flush=True)


def _print_pipeline(r: dict, ideal: dict | None) -> None:
    e = r["engine"]
    ratio = ""
    if ideal:
        ratio = f" = {r['pages_per_s'] / ideal['pages_per_s']:.3f}x the ideal client"
        if r["pages_per_s_to_90"] and ideal["pages_per_s_to_90"]:
            ratio += f" (to 90% of the pages: {r['pages_per_s_to_90'] / ideal['pages_per_s_to_90']:.3f}x)"
    print(f"pipeline {r['name']} n={r['n']}: {r['pages_per_s']:.2f} pages/s{ratio} ({r['wall_s']:.1f} s; 50%/90% "
          f"done at {r['t50_s']}/{r['t90_s']} s; first page at the engine after {r['first_request_s']} s, last answer "
          f"at {r['last_answer_s']} s; {r.get('mean_in_flight')} requests at the engine on average, none for "
          f"{r.get('empty_s')} s; submitted "
          f"in {r['submit_s']} s; statuses {r['by_status']}); engine: {e['requests']} requests, {e['tokens']} tokens, "
          f"mean running {e['mean_running']:.1f} per step ({e['mean_running_tw']:.1f} time-weighted), busy "
          f"{e['busy_frac']:.2f} of the wall time; stage CPU s {r['stage_cpu_s']}, stand-in {e['standin_cpu_s']}; "
          f"load {r['load']}", flush=True)
    if ideal and e["tokens"] != ideal["engine"]["tokens"]:
        print(f"  note: {e['tokens']} tokens here, {ideal['engine']['tokens']} for the ideal client: not the same work",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="all", choices=("all", "ideal", "pipeline"))
    ap.add_argument("--n", type=int, default=800, help="pages (default 800)")
    ap.add_argument("--k", type=int, default=256, help="requests in flight: the ideal client's and "
                    "OCRSTREAM_OPENAI_MAX_CONCURRENCY (default 256)")
    ap.add_argument("--configs", nargs="+", default=None, metavar="NAME[:KEY=VALUE,...]",
                    help="pipeline configurations (mode all/pipeline); default: one from --repo and --env")
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout the pipeline runs from (default this one)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="stage env var (repeatable)")
    ap.add_argument("--standin", default="", help="extra flags of bench.vlm_standin, one string")
    ap.add_argument("--timeout", type=float, default=3600, help="longest wait for one job's completion, s")
    ap.add_argument("--logdir", type=Path, default=None, help="stage and stand-in logs (default a temp folder)")
    args = ap.parse_args(argv)

    configs = [parse_config(c) for c in args.configs] if args.configs else [
        Config("pipeline", args.repo.resolve(), dict(e.split("=", 1) for e in args.env))]
    standin_args = shlex.split(args.standin)
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="windowbench-"))
    logdir.mkdir(parents=True, exist_ok=True)
    commit = checkout_commit(REPO)
    print(f"window_bench: mode {args.mode}, n {args.n}, k {args.k}; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; this checkout {commit}; logs in {logdir}", flush=True)
    pages = make_pages(max([args.n] + [c.n or 0 for c in configs]))
    pages_dir = logdir / "pages"
    pages_dir.mkdir(exist_ok=True)
    for i, data in enumerate(pages):
        (pages_dir / f"page{i:05d}.png").write_bytes(data)

    ideal: dict[int, dict] = {}
    result: dict = {"n": args.n, "k": args.k, "commit": commit, "ideal": [], "pipelines": []}
    if args.mode in ("all", "ideal"):
        for n in sorted({args.n} | {c.n for c in configs if c.n and args.mode == "all"}):
            ideal[n] = run_ideal(pages[:n], args.k, standin_args, logdir)
            _print_ideal(ideal[n])
            result["ideal"].append(ideal[n])
    if args.mode in ("all", "pipeline"):
        for cfg in configs:
            n = cfg.n or args.n
            r = run_pipeline(cfg, pages_dir, n, args.k, standin_args, logdir, args.timeout)
            if n in ideal:
                r["ratio_to_ideal"] = round(r["pages_per_s"] / ideal[n]["pages_per_s"], 3)
                if r["pages_per_s_to_90"] and ideal[n]["pages_per_s_to_90"]:
                    r["ratio_to_ideal_to_90"] = round(r["pages_per_s_to_90"] / ideal[n]["pages_per_s_to_90"], 3)
            _print_pipeline(r, ideal.get(n))
            result["pipelines"].append(r)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
