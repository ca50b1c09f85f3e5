"""A job of N small generated images end to end on the local stack, against the raw engine in the same run.

Starts its own namespaced stages (ingest, dedup, infer x ``--infer-procs``, sink, jobs) on the
local stack (deploy/local/up.sh must have run), in a fresh namespace (topics, bucket, Redis
prefix), so nothing is answered from an earlier run's cache. The job is what the job tests use
(:func:`tests.jobs.job_items`): ``N - round(0.3 N) - 5`` distinct one-line images, ``round(0.3 N)``
byte-identical repeats and 5 bad inputs, submitted on ``ocr.submit`` with the job's id, the job
closed with ``expected = N``, then waited on until its ``ocr.job_completed.v1`` event arrives.

Prints:

* the raw engine's images/s on a sample of the distinct images (RapidOCR called in-process,
  :func:`bench.common.raw_engine_rate`), measured in the same run before the stages start: one
  image at a time with 2 ONNX Runtime threads, and as the infer stage runs it (its workers,
  threads from ``InferSettings``, every image handed over at once; the ratios are to this one: on small
  images the 2 workers, not the threads, keep both cores busy);
* the job's wall time (first submit to its completion event), images/s end to end, distinct
  images/s, and their ratios to the raw engine;
* each stage's peak RSS (``VmHWM`` of its process, and of the processes it started: decoders,
  RapidOCR workers) read just before the stages are stopped (processes that exited earlier, such
  as a recycled decoder, are not counted);
* the report's generation: the job's report written again in a fresh process
  (:func:`services.common.jobs.report.write_job_report`, the jobs stage's own code) with its
  seconds and peak RSS (``VmHWM``; ``ru_maxrss`` would carry this process's peak across ``exec``).

``--det-limit`` sets the CPU engine's detector limit for the stages and the raw engine alike
(``OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN``; the product's default is RapidOCR's 736 px, at which
a one-line 400 x 90 px image takes ~1.6 s on 2 cores and a 10,000-image job hours; 96 reads it
in ~70 ms).

Usage: python -m bench.job_bench [--n 10000] [--infer-procs 1] [--raw-sample 300] [--det-limit 736]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import raw_engine_rate
from schemas.jobs import JobEvent
from services.cli.client import Submitter
from services.common.db import Database
from services.common.jobs.store import JobStore
from services.common.cache.keys import RAPIDOCR_DET_LIMIT_SIDE_LEN
from services.common.settings import CommonSettings
from services.infer.settings import InferSettings
from tests.jobs import job_completions, job_items
from tests.stack import JOBS, REPO, Pipeline, env_applied, namespace_env

STAGES = ("ingest", "dedup", "infer", "sink", JOBS)

REPORT_SNIPPET = """
import asyncio, sys, time
from services.common.db import Database
from services.common.jobs.report import write_job_report
from services.common.jobs.store import JobStore
from services.common.s3 import ObjectStore
from services.common.cache.keys import RAPIDOCR_DET_LIMIT_SIDE_LEN
from services.common.settings import CommonSettings

async def main():
    s = CommonSettings()
    db = Database(s.mysql, pool_size=1)
    job = await JobStore(db).job(sys.argv[1])
    t0 = time.perf_counter()
    summary, _ = await write_job_report(db, ObjectStore(s.s3), job)
    hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    print(f"{time.perf_counter() - t0:.3f} {summary.requests} {hwm}")

asyncio.run(main())
"""


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from ``/proc/*/stat``'s parent ids)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _hwm_mib(pid: int) -> float:
    """``VmHWM`` (peak resident set) of ``pid`` in MiB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak_rss(p: Pipeline) -> dict[str, tuple[float, float, int]]:
    """Per stage name: (largest peak RSS of one of its processes, MiB; sum of the peaks of the
    processes they started, MiB; how many such processes)."""
    out = {}
    for name, sts in p.stages.items():
        own, kids, n = 0.0, 0.0, 0
        for st in sts:
            own = max(own, _hwm_mib(st.proc.pid))
            for child in _children(st.proc.pid):
                kids += _hwm_mib(child)
                n += 1
        out[name] = (own, kids, n)
    return out


async def run_job(items: list[tuple[bytes, str]], job_id: str) -> tuple[float, float]:
    """Submit the job, close it, wait for its completion event: (seconds to submit, seconds to the event)."""
    s = CommonSettings()
    store = JobStore(Database(s.mysql, pool_size=1))
    sub = Submitter(s)
    await sub.start()
    t0 = time.perf_counter()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id, name="bench"))
        for i in range(0, len(items), 1000):
            await sub.submit_many(items[i:i + 1000], source="bench", job_id=job_id)
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=len(items)))
    finally:
        await sub.stop()
    submitted = time.perf_counter() - t0
    last = 0.0
    while True:
        prog = await store.progress(job_id)
        if prog is not None and prog.done >= len(items):
            break
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            print(f"  {last - t0:7.1f} s: {prog.done if prog else 0} of {len(items)} final", flush=True)
        await asyncio.sleep(1)
    raws = await job_completions(job_id, settle_s=0.5, timeout=600)
    assert len(raws) == 1, f"{len(raws)} completion events"
    return submitted, time.perf_counter() - t0


def report_run(env: dict[str, str], job_id: str) -> tuple[float, int, float]:
    """Write the job's report again in a fresh process: (seconds, rows, peak RSS MiB)."""
    out = subprocess.run([sys.executable, "-c", REPORT_SNIPPET, job_id], cwd=REPO, env={**os.environ, **env},
                         check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1]), int(out[2]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--infer-procs", type=int, default=1)
    ap.add_argument("--raw-sample", type=int, default=300, help="distinct images the raw engine reads")
    ap.add_argument("--det-limit", type=int, default=RAPIDOCR_DET_LIMIT_SIDE_LEN,
                    help="CPU engine detector limit, px (OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN)")
    args = ap.parse_args()
    tag = uuid.uuid4().hex[:6]
    items = job_items(tag, args.n)
    distinct = len({data for data, _ in items}) - 5
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; commit {commit}; job: {args.n} images "
          f"({distinct} distinct, {args.n - distinct - 5} repeats, 5 bad); {args.infer_procs} infer process(es); "
          f"detector limit {args.det_limit} px; load average {os.getloadavg()[0]:.1f}")
    sample = [data for data, _ in items[:min(args.raw_sample, distinct)]]
    one_rate, one_secs = raw_engine_rate(sample, det_limit_side_len=args.det_limit)
    print(f"raw engine, one image at a time (2 threads): {len(sample)} distinct images in {one_secs:.1f} s "
          f"= {one_rate:.2f} images/s")
    inf = InferSettings()
    raw_rate, raw_secs = raw_engine_rate(sample, threads=inf.rapidocr_threads, det_limit_side_len=args.det_limit,
                                         workers=inf.rapidocr_workers)
    print(f"raw engine as the infer stage runs it ({inf.rapidocr_workers} workers x {inf.rapidocr_threads} thread, "
          f"no barrier): {len(sample)} in {raw_secs:.1f} s = {raw_rate:.2f} images/s (the ratios below are to this)")

    env = {**namespace_env(partitions=4), "OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN": str(args.det_limit)}
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        p = Pipeline(env=env, logdir=Path(tempfile.mkdtemp(prefix="jobbench-")))
        for st in STAGES:
            for _ in range(args.infer_procs if st == "infer" else 1):
                p.start(st, wait_ready=False)
        try:
            for sts in p.stages.values():
                for st in sts:
                    p.wait_ready(st)
            job_id = f"bench-{tag}"
            submitted, wall = asyncio.run(run_job(items, job_id))
            rss = peak_rss(p)
        finally:
            p.stop_all()
        report_s, rows, report_mib = report_run(env, job_id)
    rate = args.n / wall
    print(f"job: submitted in {submitted:.1f} s; completion event after {wall:.1f} s")
    print(f"end to end: {rate:.2f} images/s = {rate / raw_rate:.2f}x the raw engine; "
          f"distinct images {distinct / wall:.2f}/s = {distinct / wall / raw_rate:.2f}x the raw engine")
    print("peak RSS (MiB): stage  own  children(sum, n)")
    for name, (own, kids, n) in rss.items():
        print(f"  {name:7s} {own:7.1f}  {kids:7.1f} ({n})")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"report: {rows} rows written in {report_s:.2f} s, peak RSS {report_mib:.1f} MiB "
          f"(this bench's own peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
