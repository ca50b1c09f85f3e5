"""A job's report at 1,000 and 10,000 rows: time and peak RSS of the jobs stage's report writer.

Inserts synthetic ``job_requests`` rows (one job per size, ids ``bench-<hex>``, deleted at the
end) into the local MariaDB, then runs :func:`services.common.jobs.report.write_job_report` (CSV,
JSONL, summary.json and the PNG chart, streamed from a server-side cursor into files, uploaded
to the local S3 under a bucket of its own) in a fresh process per size, and prints each run's
seconds, rows/s and the process's peak RSS, then the ratios 10k/1k: time about 10x and peak RSS
about 1x is what streaming promises (rows never all in memory).

Usage: python -m bench.job_report_bench [--sizes 1000,10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import subprocess
import sys
import time
import uuid

import orjson

BUCKET = "bench-job-report"


def _rows(job_id: str, n: int) -> list[tuple]:
    out = []
    for i in range(n):
        err = i % 200 == 7
        timings = {"total": 100.0 + i % 97, "inference": 0.0 if i % 3 == 0 else 40.0 + i % 13, "fetch": 3.0}
        out.append((job_id, f"{job_id}-{i:06d}", "error" if err else "ok", "corrupt_image" if err else None,
                    int(i % 3 == 0), 1, 0 if err else 12, 0 if err else 480, None if err else 0.93,
                    f"invoice_{i:06d}.png", timings["total"], timings["inference"], orjson.dumps(timings).decode(),
                    None, 1_700_000_000_000 + i, 1_700_000_001_000 + i))
    return out


async def _setup(sizes: list[int]) -> dict[int, str]:
    from services.common.db import Database
    from services.common.jobs.store import _REQUEST
    from services.common.settings import CommonSettings

    db = Database(CommonSettings().mysql, pool_size=1)
    await db.migrate()
    jobs = {}
    for n in sizes:
        job_id = f"bench-{uuid.uuid4().hex[:12]}"
        await db.execute("INSERT INTO jobs (job_id, name, expected) VALUES (%s, %s, %s)", job_id, "bench", n)
        rows = _rows(job_id, n)
        for k in range(0, n, 1000):
            await db.transact("bench_rows", lambda cur, chunk: cur.executemany(_REQUEST, chunk), rows[k:k + 1000])
        jobs[n] = job_id
    return jobs


async def _cleanup(job_ids: list[str]) -> None:
    from services.common.db import Database
    from services.common.settings import CommonSettings

    db = Database(CommonSettings().mysql, pool_size=1)
    for j in job_ids:
        await db.execute("DELETE FROM job_requests WHERE job_id = %s", j)
        await db.execute("DELETE FROM jobs WHERE job_id = %s", j)


def _child(job_id: str) -> None:
    """One report in this process; prints ``{"s": seconds, "rss_mib": peak RSS}`` as JSON."""
    import os

    os.environ["OCRSTREAM_S3__BUCKET"] = BUCKET
    from services.common.db import Database
    from services.common.jobs.report import write_job_report
    from services.common.jobs.store import JobStore
    from services.common.s3 import ObjectStore
    from services.common.settings import CommonSettings

    async def run() -> float:
        s = CommonSettings()
        db, store = Database(s.mysql, pool_size=1), ObjectStore(s.s3)
        await store.ensure_bucket()
        job = await JobStore(db).job(job_id)
        import matplotlib  # imported before the clock: the first report of a process pays it once

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401

        t = time.perf_counter()
        summary, _ = await write_job_report(db, store, job)
        assert summary.requests > 0
        return time.perf_counter() - t

    secs = asyncio.run(run())
    print(json.dumps({"s": secs, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    """Run the bench (see the module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        _child(a.child)
        return
    sizes = [int(x) for x in a.sizes.split(",")]
    jobs = asyncio.run(_setup(sizes))
    res = {}
    try:
        for n, job_id in jobs.items():
            out = subprocess.run([sys.executable, "-m", "bench.job_report_bench", "--child", job_id],
                                 capture_output=True, text=True, check=True)
            res[n] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{n:>6} rows: {res[n]['s']:.2f} s ({n / res[n]['s']:.0f} rows/s), peak RSS {res[n]['rss_mib']:.0f} MiB")
    finally:
        asyncio.run(_cleanup(list(jobs.values())))
    lo, hi = min(res), max(res)
    print(f"{hi}/{lo} rows: time {res[hi]['s'] / res[lo]['s']:.2f}x, peak RSS {res[hi]['rss_mib'] / res[lo]['rss_mib']:.2f}x "
          f"({platform.machine()}, {platform.python_version()})")


if __name__ == "__main__":
    main()
