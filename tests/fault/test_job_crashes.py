"""SIGKILL of each stage once during a job: the job's counts end exact and it completes once."""

from __future__ import annotations

import asyncio
import csv
import io
import signal
import time
import uuid

from schemas.jobs import JobCompletedEvent, JobEvent, JobProgress, job_completion_event_id
from services.cli.client import Submitter
from services.common.db import Database
from services.common.codec import loads
from services.common.jobs.store import JobStore
from services.common.s3 import ObjectStore
from services.common.settings import CommonSettings
from tests.jobs import BAD, BAD_CODES, job_completions, job_items, wait_final
from tests.stack import JOBS, STAGES, db_rows

N = 40  # 23 unique images, 12 repeats, 5 bad inputs (60 took 171 s on the loaded 2-core VM: 3 s an image)
REPEATS = round(N * 0.3)
#: Each stage is SIGKILLed once, in this order, at the first progress read with this many final
#: requests (its restart finished before the next kill); the k-th count (k = 5..1 kills to go) < N - (k + 1) CHUNK.
KILL_AT = dict(zip((*STAGES, JOBS), (4, 10, 16, 22, 30)))
WINDOW, CHUNK = 12, 4  # requests submitted ahead of the final count, submitted this many at a time


def _rising(seen: list[JobProgress]) -> dict[str, list[int]]:
    """The counters of ``seen`` that went down between two reads (name -> its series); {} when none did."""
    series = {name: [getattr(p, name) for p in seen] for name in ("done", "ok", "failed", "cache_hits", "pages",
                                                                  "lines", "chars")}
    for code in BAD_CODES:
        series[code] = [p.failed_by_code.get(code, 0) for p in seen]
    return {name: vals for name, vals in series.items() if vals != sorted(vals)}


async def test_sigkill_of_each_stage_mid_job_keeps_counts_exact_and_completes_once(fault_pipeline):
    p = fault_pipeline
    await asyncio.to_thread(p.start, JOBS)
    s = CommonSettings()
    job_id = f"crash-{uuid.uuid4().hex[:12]}"
    items = job_items(uuid.uuid4().hex[:6], N)
    store = JobStore(Database(s.mysql, pool_size=1))
    sub = Submitter(s)
    ids: list[str] = []
    kills = list(KILL_AT.items())
    killed: list[tuple[str, int, int, float]] = []  # (stage, final and submitted requests at the kill, seconds in)
    restart: asyncio.Task | None = None

    async def feed_and_kill(prog: JobProgress) -> None:
        """Keep up to WINDOW requests ahead of the final count; SIGKILL the next stage once its
        count is reached, just after submitting one more CHUNK (records for it to hold). Until
        the last restart is done at most WINDOW past the next kill's count are submitted and the
        last CHUNK requests (one more per kill to go) are held back, so on any machine every kill
        lands while the job runs."""
        nonlocal restart
        if restart is not None and restart.done():
            restart.result()  # a restart that failed fails the test here
            restart = None
        limit = N if not kills and restart is None else min(N - CHUNK * (1 + len(kills)),
                                                               (kills[0][1] if kills else N) + WINDOW)
        while len(ids) < limit and prog.done >= len(ids) - WINDOW:
            ids.extend(await sub.submit_many(items[len(ids):min(limit, len(ids) + CHUNK)], source="test",
                                             job_id=job_id))
        if restart is None and kills and prog.done >= kills[0][1]:
            name, _ = kills.pop(0)
            burst = items[len(ids):min(N - CHUNK * (1 + len(kills)), len(ids) + CHUNK)]
            if burst:  # records for it to hold, however fast the pipeline drained
                ids.extend(await sub.submit_many(burst, source="test", job_id=job_id))
            [st] = [x for x in p.stages[name] if x.proc.poll() is None]
            p.stop(st, sig=signal.SIGKILL)
            killed.append((name, prog.done, len(ids), round(time.monotonic() - started, 1)))
            restart = asyncio.create_task(asyncio.to_thread(p.start, name))

    started = time.monotonic()
    await sub.start()
    try:
        await sub.job_event(JobEvent(action="create", job_id=job_id, name="crashes"))
        await sub.job_event(JobEvent(action="close", job_id=job_id, expected=N))
        ids.extend(await sub.submit_many(items[:WINDOW], source="test", job_id=job_id))
        seen: list[JobProgress] = []
        await wait_final(store, job_id, N, seen, timeout=300, each=feed_and_kill)
        elapsed = time.monotonic() - started
        if restart is not None:
            await restart
    finally:
        await sub.stop()
    raws = await job_completions(job_id, settle_s=5.0)
    print(f"job of {N} with {len(killed)} stages killed {killed}: all final in {elapsed:.1f}s, "
          f"{len(seen)} progress reads; logs in {p.logdir}")
    # every stage was killed while the job was running, and no count went down while observed
    assert [k[0] for k in killed] == [*STAGES, JOBS] and all(k[1] < N for k in killed), killed
    assert _rising(seen) == {}
    # exactly one completion, the bytes stored in MariaDB, with the exact counts
    assert len(raws) == 1, [loads(JobCompletedEvent, r).event_id for r in raws]
    [row] = db_rows("SELECT completion_json, completion_sent FROM jobs WHERE job_id = %s", job_id)
    assert row == {"completion_json": raws[0].decode(), "completion_sent": 1}
    ev = loads(JobCompletedEvent, raws[0])
    prog = ev.progress
    assert ev.event_id == job_completion_event_id(job_id) and ev.name == "crashes"
    assert (prog.state, prog.total, prog.done, prog.ok, prog.failed) == ("completed", N, N, N - 5, 5)
    assert prog.failed_by_code == BAD_CODES and prog.cache_hits == REPEATS
    assert (prog.pages, prog.lines) == (N, N - 5)
    assert ev.summary.by_status == {"error": 5, "ok": N - 5} and ev.summary.requests == N
    # GET /v1/jobs/{id}'s answer (the same read) now, and MariaDB's rows
    assert await store.progress(job_id) == prog
    counted = db_rows("SELECT status, error_code, COUNT(*) AS n FROM job_requests WHERE job_id = %s "
                      "GROUP BY status, error_code ORDER BY status, error_code", job_id)
    assert counted == [{"status": "error", "error_code": c, "n": n} for c, n in sorted(BAD_CODES.items())] + [
        {"status": "ok", "error_code": None, "n": N - 5}]
    marks = ",".join(["%s"] * N)
    requests = {r["request_id"]: (r["status"], r["error_code"] or "") for r in db_rows(
        f"SELECT request_id, status, error_code FROM requests WHERE request_id IN ({marks})", *ids)}
    assert len(requests) == N
    # the report: one row per request, its status and code as in MariaDB
    body = await ObjectStore(s.s3).get_uri(ev.report["csv"])
    rows = list(csv.DictReader(io.StringIO(body.decode())))
    assert len(rows) == N
    assert {r["request_id"]: (r["status"], r["error_code"]) for r in rows} == requests
    assert {r["name"]: r["error_code"] for r in rows if r["status"] == "error"} == {
        name: code.value for _, name, code in BAD}
