"""The HTTP door: cached-image latency, uploads/s, and what long-polling costs next to polling,
each measured against the seed design in the same run.

Starts a pipeline (ingest, dedup, infer, sink) and the HTTP door (``python -m services.api``)
in a fresh namespace on the local stack (deploy/local/up.sh must have run), and the seed design's
HTTP side (``bench/seed_design.py``: FastAPI ``UploadFile``, one Redis ``GET`` of the cache entry in
the upload handler, Celery-style ``LPUSH`` + ``celery-task-meta-<id>`` keys, ``GET /result/{id}``)
as a separate uvicorn process on the same Redis under its own key prefix (deleted at the end).
Then, in one run:

(a) cached image over loopback: one image is finished by ocrstream (and the same result written
    to the seed's cache, as its worker would), then ``--n`` sequential POSTs of the same image per
    variant, each on one keep-alive connection (``http.client``), the variants interleaved in
    ``--rounds`` rounds: ocrstream with a raw ``image/png`` body (what its clients send), ocrstream
    with a ``multipart/form-data`` body, and the seed with the same multipart body (the seed's web
    form upload; it takes nothing else). p50/p99 ms, requests/s, server CPU per request (from
    /proc), and the ratios ocrstream/seed of this run.
(c) waiting for a result: ``--clients`` pending requests (ocrstream's infer stage is stopped; the
    seed has no worker), first each waited on by one ocrstream ``GET ?wait=`` long-poll, then each
    polled with ``GET`` every 0.2 s (the seed's client design), against ocrstream's
    ``GET /v1/ocr/{id}`` and against the seed's ``GET /result/{id}``, for ``--seconds`` each; CPU
    of the serving process and of MariaDB + Redis (from /proc/<pid>/stat utime+stime) as % of one
    core, and the ratios.
(b) uploads/s of distinct new images (the 202 path) with ``--concurrency`` clients, OCR stopped:
    ocrstream raw and multipart (header check, S3 put, Kafka produce acknowledged, Redis marker),
    the seed multipart (Redis GET, LPUSH of the base64 message, SET of the task meta).

The seed's figures recorded elsewhere (1.6 ms p50 cached; polling at 0.2 s ~30 % of a 2-core
machine) are printed as context only.

Usage: python -m bench.http_bench [--n 2000] [--rounds 2] [--clients 50] [--seconds 10] [--uploads 200] [--concurrency 4] [--keyed] [--routed]
(``--keyed``: (a) also measures a second door with API keys required and a per-key rate limit, as the Helm values run it.
``--routed``: (a) also measures a door without the ``POST /v1/ocr`` fast path, ``OCRSTREAM_HTTP_FAST_PATH=false``: what
the fast path saves.)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import redis

from bench import seed_design
from bench.common import pct
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.stack import API, REPO, Pipeline, free_port, namespaced_pipeline

#: The seed design's figures, measured elsewhere (not in this repository): printed as context.
SEED_CACHED_P50_MS = 1.6
SEED_POLL_CPU_SHARE_OF_2_CORES = 0.30
POLL_INTERVAL_S = 0.2
CLK_TCK = os.sysconf("SC_CLK_TCK")
BOUNDARY = "ocrstream-bench-7f3a9c"
RAW = "image/png"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


# -- machine and process CPU ---------------------------------------------------------------------
def machine() -> str:
    """``nproc``, CPU model and ``uptime`` load, one line each."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return f"machine: {os.cpu_count()} cores ({platform.machine()}), {model}\nload:    {load}"


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15 of stat(5)


def pids_named(*names: str) -> list[int]:
    """Pids whose ``comm`` is one of ``names`` (e.g. the local stack's mariadbd and redis-server)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() in names:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


class CpuMeter:
    """CPU seconds used by groups of processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups
        self.t0 = 0.0
        self.c0: dict[str, float] = {}
        self.result: dict[str, float] = {}
        self.wall = 0.0

    def _now(self) -> dict[str, float]:
        return {g: sum(cpu_s(p) for p in pids) for g, pids in self.groups.items()}

    def start(self) -> None:
        self.t0, self.c0 = time.perf_counter(), self._now()

    def stop(self) -> None:
        self.wall = time.perf_counter() - self.t0
        self.result = {g: v - self.c0[g] for g, v in self._now().items()}

    def pct_of_core(self, group: str) -> float:
        """CPU of ``group`` over the window, % of one core."""
        return 100 * self.result[group] / self.wall


# -- HTTP helpers ---------------------------------------------------------------------------------
def multipart(img: bytes, filename: str = "bench.png") -> bytes:
    """``img`` as the one file part (field ``file``) of a ``multipart/form-data`` body (:data:`MULTIPART`),
    as a browser form sends it (RFC 7578)."""
    head = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f"Content-Type: image/png\r\n\r\n").encode()
    return head + img + f"\r\n--{BOUNDARY}--\r\n".encode()


def post(conn: http.client.HTTPConnection, body: bytes, path: str = "/v1/ocr", ctype: str = RAW,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn.request("POST", path, body=body, headers={"Content-Type": ctype, **(headers or {})})
    r = conn.getresponse()
    return r.status, r.read()


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read()


def upload_and_finish(port: int, img: bytes) -> dict:
    """Upload ``img`` to ocrstream (202) and long-poll until it is finished; returns its result document."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    status, body = post(conn, img)
    assert status == 202, (status, body[:300])
    rid = json.loads(body)["request_id"]
    status, body = get(conn, f"/v1/ocr/{rid}?wait=60")
    doc = json.loads(body)
    assert status == 200 and doc["status"] == "ok", doc
    conn.close()
    return doc["result"]


# -- the seed design's process ------------------------------------------------------------------
@dataclass
class Seed:
    """``bench/seed_design.py`` running as its own uvicorn process on ``port``, keys under ``prefix``."""

    port: int
    prefix: str
    proc: subprocess.Popen
    redis: redis.Redis

    @classmethod
    def start(cls, redis_url: str, log: Path) -> "Seed":
        port, prefix = free_port(), f"seedbench-{uuid.uuid4().hex[:8]}"
        with open(log, "ab") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "bench.seed_design", "--port", str(port), "--prefix", prefix,
                                     "--redis-url", redis_url], cwd=REPO, stdout=logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"seed design exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                if get(conn, "/result/none")[0] == 404:  # up: an unknown task id
                    conn.close()
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
        return cls(port, prefix, proc, redis.Redis.from_url(redis_url))

    def submit(self, img: bytes) -> str:
        """Upload ``img`` (multipart) and expect 202; its task id."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        status, body = post(conn, multipart(img), "/ocr", MULTIPART)
        conn.close()
        assert status == 202, (status, body[:300])
        return json.loads(body)["task_id"]

    def stop(self) -> int:
        """Stop the process and delete every key under the prefix; keys deleted."""
        self.proc.terminate()
        self.proc.wait(30)
        return seed_design.cleanup(self.redis, self.prefix)


# -- (a) cached latency ---------------------------------------------------------------------------
@dataclass
class Variant:
    """One cached-image client loop: who is asked, with which body, and how a cached answer looks."""

    label: str
    port: int
    pid: int
    path: str
    body: bytes
    ctype: str
    is_hit: Callable[[int, bytes], bool]
    headers: dict[str, str] = field(default_factory=dict)  # e.g. X-API-Key for a door requiring keys
    lat: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    resp_bytes: int = 0
    conn: http.client.HTTPConnection | None = None

    def p(self, q: float) -> float:
        return pct(self.lat, q)


def cached_latency(variants: list[Variant], n: int, rounds: int) -> None:
    """``n`` sequential POSTs per variant on its own keep-alive connection, the variants taking
    turns in ``rounds`` rounds of ``n // rounds`` (so drifting background load hits all alike);
    fills ``lat`` (ms), ``cpu_s`` (server) and ``wall_s`` of each."""
    for v in variants:
        v.conn = http.client.HTTPConnection("127.0.0.1", v.port, timeout=30)
        for _ in range(min(200, n)):  # warm-up: connection, caches, code paths
            status, body = post(v.conn, v.body, v.path, v.ctype, v.headers)
            assert v.is_hit(status, body), (v.label, status, body[:300])
        v.resp_bytes = len(body)
    per_round = n // rounds
    for _ in range(rounds):
        for v in variants:
            # a fresh keep-alive connection per turn (uvicorn drops one idle for 5 s, as it is while
            # the other variants run), warmed by 20 untimed requests
            v.conn.close()
            v.conn = http.client.HTTPConnection("127.0.0.1", v.port, timeout=30)
            for _ in range(20):
                post(v.conn, v.body, v.path, v.ctype, v.headers)
            meter = CpuMeter({"server": [v.pid]})
            meter.start()
            for _ in range(per_round):
                s = time.perf_counter()
                status, body = post(v.conn, v.body, v.path, v.ctype, v.headers)
                v.lat.append((time.perf_counter() - s) * 1000)
                if not v.is_hit(status, body):
                    raise AssertionError(f"{v.label}: not a cache hit: {status} {body[:300]!r}")
            meter.stop()
            v.cpu_s += meter.result["server"]
            v.wall_s += meter.wall
    for v in variants:
        v.conn.close()


# -- (c) long-poll vs polling -----------------------------------------------------------------------
def pending_requests(port: int, k: int, tag: str) -> list[str]:
    """``k`` ocrstream requests that stay pending (infer is stopped): their ids."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    ids = []
    for i in range(k):
        status, body = post(conn, text_image([f"{tag} PENDING {i:04d}"], size=24))
        assert status == 202, (status, body[:300])
        ids.append(json.loads(body)["request_id"])
    conn.close()
    return ids


def waiters(port: int, ids: list[str], seconds: float, groups: dict[str, list[int]]) -> CpuMeter:
    """One long-poll per id (``?wait=`` just over ``seconds``); CPU measured while all of them wait."""
    wait = int(seconds) + 3
    answered: list[int] = []

    def one(rid: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=wait + 30)
        status, body = get(conn, f"/v1/ocr/{rid}?wait={wait}")
        assert status == 200 and json.loads(body)["status"] == "pending", (status, body[:200])
        answered.append(1)
        conn.close()

    threads = [threading.Thread(target=one, args=(rid,), daemon=True) for rid in ids]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every waiter connected and registered
    meter = CpuMeter(groups)
    meter.start()
    time.sleep(seconds)
    meter.stop()
    assert not answered, "a long-poll returned early"
    for t in threads:
        t.join()
    return meter


def pollers(port: int, paths: list[str], seconds: float, groups: dict[str, list[int]],
            pending: bytes) -> tuple[CpuMeter, int]:
    """One client per path polling ``GET`` every 0.2 s for ``seconds``; (CPU meter, polls answered).
    Every answer must be 200 and contain ``pending`` (the request is still waiting)."""
    stop = threading.Event()
    polls = [0] * len(paths)

    def one(i: int, path: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        time.sleep(POLL_INTERVAL_S * i / len(paths))  # spread the clients over the interval
        nxt = time.monotonic()
        while not stop.is_set():
            status, body = get(conn, path)
            assert status == 200 and pending in body, (status, body[:200])
            polls[i] += 1
            nxt += POLL_INTERVAL_S
            stop.wait(max(0.0, nxt - time.monotonic()))
        conn.close()

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(paths)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = sum(polls)
    meter = CpuMeter(groups)
    meter.start()
    time.sleep(seconds)
    meter.stop()
    n = sum(polls) - before
    stop.set()
    for t in threads:
        t.join()
    return meter, n


# -- (b) uploads/s ----------------------------------------------------------------------------------
def uploads(port: int, bodies: list[bytes], concurrency: int, path: str = "/v1/ocr", ctype: str = RAW) -> dict:
    """``bodies`` POSTed by ``concurrency`` clients, each answered 202: uploads/s, p50/p99 ms."""
    lat: list[float] = []
    lock = threading.Lock()
    nxt = iter(range(len(bodies)))

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                break
            s = time.perf_counter()
            status, body = post(conn, bodies[i], path, ctype)
            ms = (time.perf_counter() - s) * 1000
            assert status == 202, (status, body[:300])
            with lock:
                lat.append(ms)
        conn.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"rate": len(bodies) / wall, "p50": pct(lat, 50), "p99": pct(lat, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="sequential cached POSTs per variant")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds the cached POSTs are split into")
    ap.add_argument("--clients", type=int, default=50, help="waiting clients (long-poll, then polling)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring window of each waiting design")
    ap.add_argument("--uploads", type=int, default=200, help="distinct new images uploaded per row of (b)")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent upload clients")
    ap.add_argument("--keyed", action="store_true",
                    help="also a door with keys required and a per-key rate limit (the Helm configuration) in (a)")
    ap.add_argument("--routed", action="store_true",
                    help="also a door without the POST /v1/ocr fast path (FastAPI routing only) in (a)")
    args = ap.parse_args()

    print(machine())
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    tag = f"H{int(time.time()) % 100000}"
    cached_img = text_image(["CACHED HTTP BENCH", "INVOICE 4711 TOTAL 99.00"], size=32)
    new_imgs = {k: [text_image([f"{tag} {k.upper()} {i:05d}", "NEW IMAGE FOR THE 202 PATH"], size=32)
                    for i in range(args.uploads)] for k in ("raw", "multipart")}
    print(f"stage, door and seed logs in {tmp}")
    with namespaced_pipeline(tmp, for_tests=False) as p:  # type: Pipeline
        api = p.start(API)
        api_pid = api.proc.pid
        seed = Seed.start(CommonSettings().redis.url, tmp / "seed-design.log")
        try:
            stores = pids_named("mariadbd", "mysqld", "redis-server")
            me = [os.getpid()]
            result = upload_and_finish(api.port, cached_img)
            assert result["text"].startswith("CACHED HTTP BENCH"), result["text"]
            # the seed's first upload is a miss; its worker would then store the result: the same document
            seed_design.finish(seed.redis, seed.prefix, seed.submit(cached_img), cached_img, result)

            def door_hit(status: int, body: bytes) -> bool:
                return status == 200 and b'"cache_hit":true' in body

            form = multipart(cached_img)
            va = [Variant("ocrstream POST /v1/ocr, raw image/png", api.port, api_pid, "/v1/ocr", cached_img, RAW,
                          door_hit),
                  Variant("ocrstream POST /v1/ocr, multipart", api.port, api_pid, "/v1/ocr", form, MULTIPART, door_hit),
                  Variant("seed POST /ocr, multipart (this run)", seed.port, seed.proc.pid, "/ocr", form, MULTIPART,
                          lambda status, body: status == 200 and b'"status": "SUCCESS"' in body)]
            if args.keyed:
                # the door as the Helm values run it: keys required, a per-key token bucket in Redis
                # (rate high enough never to refuse: the cost of the check, not of a 429, is measured)
                key = subprocess.run([sys.executable, "-m", "services.cli", "keys", "create", "--name", f"bench-{tag}",
                                      "--rate", "100000", "--burst", "100000"], cwd=REPO, env=dict(os.environ, **p.env),
                                     capture_output=True, text=True, check=True).stdout
                api_key = re.search(r"api_key:\s+(\S+)", key).group(1)
                keyed = p.start(API, {"OCRSTREAM_AUTH_REQUIRED": "true"})
                va.insert(1, Variant("ocrstream POST /v1/ocr, raw, API key + rate limit", keyed.port, keyed.proc.pid,
                                     "/v1/ocr", cached_img, RAW, door_hit, headers={"X-API-Key": api_key}))
            if args.routed:  # the same door through FastAPI's routing: what the fast path saves
                routed = p.start(API, {"OCRSTREAM_HTTP_FAST_PATH": "false"})
                at = 1 + bool(args.keyed)
                va[at:at] = [Variant("ocrstream raw, routed (no fast path)", routed.port, routed.proc.pid, "/v1/ocr",
                                     cached_img, RAW, door_hit)]
                va.insert(-1, Variant("ocrstream multipart, routed (no fast path)", routed.port, routed.proc.pid,
                                      "/v1/ocr", form, MULTIPART, door_hit))
            cached_latency(va, args.n, args.rounds)

            p.stop(p.stages["infer"][0])  # from here on requests stay pending, and no OCR competes for the CPU
            ids = pending_requests(api.port, args.clients, tag)
            door_groups = {"server": [api_pid], "stores": stores, "clients": me}
            lp = waiters(api.port, ids, args.seconds, door_groups)
            poll, n_polls = pollers(api.port, [f"/v1/ocr/{rid}" for rid in ids], args.seconds, door_groups,
                                    b'"status":"pending"')
            task_ids = [seed.submit(text_image([f"{tag} SEED PENDING {i:04d}"], size=24)) for i in range(args.clients)]
            seed_groups = {"server": [seed.proc.pid], "stores": stores, "clients": me}
            spoll, n_spolls = pollers(seed.port, [f"/result/{t}" for t in task_ids], args.seconds, seed_groups,
                                      b'"status": "PENDING"')

            b_raw = uploads(api.port, new_imgs["raw"], args.concurrency)
            b_form = uploads(api.port, [multipart(i) for i in new_imgs["multipart"]], args.concurrency,
                             ctype=MULTIPART)
            b_seed = uploads(seed.port, [multipart(i) for i in new_imgs["raw"]], args.concurrency, "/ocr", MULTIPART)
        finally:
            deleted = seed.stop()

    raw, sd = va[0], va[-1]
    form_v = next(v for v in va if v.label == "ocrstream POST /v1/ocr, multipart")
    routed_v = [v for v in va if "routed" in v.label]
    keyed_v = va[1] if args.keyed else None
    print()
    print(f"(a) cached image over loopback, {len(cached_img)} B PNG ({len(form)} B as multipart), {args.n} sequential "
          f"POSTs per row on one keep-alive connection, rows interleaved in {args.rounds} rounds")
    print(f"    {'':40} {'p50 ms':>7} {'p99 ms':>7} {'req/s':>7} {'server CPU ms/req':>18} {'answer B':>9}")
    for v in va:
        print(f"    {v.label:40} {v.p(50):7.2f} {v.p(99):7.2f} {len(v.lat) / v.wall_s:7.0f} "
              f"{1000 * v.cpu_s / len(v.lat):18.2f} {v.resp_bytes:9}")
    print(f"    {'seed design (recorded elsewhere, context)':40} {SEED_CACHED_P50_MS:7.2f} {'-':>7} {'-':>7} {'-':>18} {'-':>9}")
    print(f"    ocrstream/seed, this run, same multipart body: p50 {form_v.p(50) / sd.p(50):.2f}, "
          f"p99 {form_v.p(99) / sd.p(99):.2f}, server CPU {form_v.cpu_s / sd.cpu_s:.2f}")
    print(f"    ocrstream raw body/seed multipart, this run: p50 {raw.p(50) / sd.p(50):.2f}, "
          f"p99 {raw.p(99) / sd.p(99):.2f}, server CPU {raw.cpu_s / sd.cpu_s:.2f}")
    print(f"    target p50 <= 2 ms: ocrstream raw {raw.p(50):.2f} ms, multipart {form_v.p(50):.2f} ms"
          + (f", raw with an API key and a rate limit {keyed_v.p(50):.2f} ms (keyed/open p50 {keyed_v.p(50) / raw.p(50):.2f}, "
             f"server CPU {keyed_v.cpu_s / raw.cpu_s:.2f})" if keyed_v else ""))
    if routed_v:
        rr, rf = routed_v
        print(f"    fast path vs routed, server CPU ms/req: raw {1000 * raw.cpu_s / len(raw.lat):.2f} vs "
              f"{1000 * rr.cpu_s / len(rr.lat):.2f}, multipart {1000 * form_v.cpu_s / len(form_v.lat):.2f} vs "
              f"{1000 * rf.cpu_s / len(rf.lat):.2f}; p50 ms: raw {raw.p(50):.2f} vs {rr.p(50):.2f}, "
              f"multipart {form_v.p(50):.2f} vs {rf.p(50):.2f}")
    print()
    print(f"(c) {args.clients} clients waiting on pending requests for {args.seconds:.0f} s each "
          f"(CPU % of one core, from /proc; server = the door or the seed process)")
    print(f"    {'':40} {'server':>7} {'db+redis':>9} {'clients':>8} {'GETs/s':>8}")
    rows = [(f"ocrstream long-poll GET ?wait={int(args.seconds) + 3}", lp, 0),
            ("ocrstream poll GET every 0.2 s", poll, n_polls),
            ("seed poll GET /result/{id} every 0.2 s", spoll, n_spolls)]
    for label, m, n in rows:
        print(f"    {label:40} {m.pct_of_core('server'):7.1f} {m.pct_of_core('stores'):9.1f} "
              f"{m.pct_of_core('clients'):8.1f} {n / m.wall:8.1f}")

    def both(m: CpuMeter) -> float:
        return m.pct_of_core("server") + m.pct_of_core("stores")

    print(f"    seed polling / ocrstream long-poll: server CPU {spoll.pct_of_core('server') / max(lp.pct_of_core('server'), 1e-3):.1f}x, "
          f"server+stores {both(spoll):.1f}% vs {both(lp):.1f}% of a core ({both(spoll) / max(both(lp), 1e-3):.1f}x)")
    print(f"    same polling, ocrstream/seed server CPU: {poll.pct_of_core('server') / spoll.pct_of_core('server'):.2f}")
    print(f"    seed design (recorded elsewhere, context): polling every 0.2 s burned about "
          f"{100 * SEED_POLL_CPU_SHARE_OF_2_CORES:.0f}% of a 2-core machine (= {200 * SEED_POLL_CPU_SHARE_OF_2_CORES:.0f}% "
          f"of one core, clients included)")
    print()
    size = sum(map(len, new_imgs["raw"])) // args.uploads
    print(f"(b) distinct new images, {size} B PNG each, {args.uploads} uploads per row, {args.concurrency} concurrent "
          f"clients (202 path, OCR stopped)")
    print(f"    {'':40} {'uploads/s':>9} {'p50 ms':>7} {'p99 ms':>7}")
    for label, b in (("ocrstream raw image/png (S3, Kafka ack)", b_raw), ("ocrstream multipart (S3, Kafka ack)", b_form),
                     ("seed multipart (Redis LPUSH + SET)", b_seed)):
        print(f"    {label:40} {b['rate']:9.1f} {b['p50']:7.1f} {b['p99']:7.1f}")
    print(f"    ocrstream/seed uploads/s, this run: multipart {b_form['rate'] / b_seed['rate']:.2f}, "
          f"raw {b_raw['rate'] / b_seed['rate']:.2f}")
    print()
    print(f"seed design: {deleted} Redis keys under its prefix deleted")
    print(machine().splitlines()[1].replace("load:    ", "load after: "))


if __name__ == "__main__":
    main()
