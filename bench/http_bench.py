"""The HTTP door: cached-image latency, uploads/s, and what long-polling costs next to polling.

Starts a pipeline (ingest, dedup, infer, sink) and the HTTP door (``python -m services.ingest.api``)
in a fresh namespace on the local stack (deploy/local/up.sh must have run), then measures in one run:

(a) cached image over loopback: one image is uploaded and finished, then ``--n`` sequential POSTs of
    the same bytes on one keep-alive connection (``http.client``): p50/p99 ms, requests/s, and the
    door's CPU per request (from /proc). Compared with the seed design's cached repeat, 1.6 ms p50
    over HTTP — a figure RECORDED elsewhere (the seed is not in this repository), not measured here.
(c) waiting for a result: ``--clients`` pending requests (the infer stage is stopped, so they stay
    pending), first each waited on by one ``GET ?wait=30`` long-poll, then each polled with
    ``GET`` every 0.2 s (the seed's client design) for ``--seconds``; CPU of the door process and of
    MariaDB + Redis (from /proc/<pid>/stat utime+stime) as % of one core, and the ratio. The seed's
    figure, recorded elsewhere: polling every 0.2 s burned about 30 % of a 2-core machine.
(b) uploads/s of distinct new images (the 202 path: header check, S3 put, Kafka produce acknowledged,
    Redis marker) with ``--concurrency`` clients, infer still stopped so OCR does not compete.

Usage: python -m bench.http_bench [--n 2000] [--clients 50] [--seconds 10] [--uploads 200] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.common import pct
from tests.conftest import text_image
from tests.stack import API, Pipeline, namespaced_pipeline

#: The seed design's figures, measured elsewhere (not in this repository): labelled "recorded".
SEED_CACHED_P50_MS = 1.6
SEED_POLL_CPU_SHARE_OF_2_CORES = 0.30
POLL_INTERVAL_S = 0.2
CLK_TCK = os.sysconf("SC_CLK_TCK")


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
def post(conn: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", "/v1/ocr", body=body, headers={"Content-Type": "image/png"})
    r = conn.getresponse()
    return r.status, r.read()


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, bytes]:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read()


def upload_and_finish(port: int, img: bytes) -> str:
    """Upload ``img`` (202) and long-poll until it is finished; returns its text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    status, body = post(conn, img)
    assert status == 202, (status, body[:300])
    rid = json.loads(body)["request_id"]
    status, body = get(conn, f"/v1/ocr/{rid}?wait=60")
    doc = json.loads(body)
    assert status == 200 and doc["status"] == "ok", doc
    conn.close()
    return doc["result"]["text"]


# -- (a) cached latency ---------------------------------------------------------------------------
def cached_latency(port: int, api_pid: int, img: bytes, n: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(min(200, n)):  # warm-up: connection, LRU, code paths
        status, body = post(conn, img)
        assert status == 200, (status, body[:300])
    lat = []
    meter = CpuMeter({"api": [api_pid]})
    meter.start()
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        status, body = post(conn, img)
        lat.append((time.perf_counter() - s) * 1000)
        if status != 200 or b'"cache_hit":true' not in body:
            raise AssertionError(f"not a cache hit: {status} {body[:300]!r}")
    wall = time.perf_counter() - t0
    meter.stop()
    conn.close()
    return {"p50": pct(lat, 50), "p99": pct(lat, 99), "mean": sum(lat) / n, "rps": n / wall,
            "api_cpu_ms_per_req": 1000 * meter.result["api"] / n, "bytes": len(img)}


# -- (c) long-poll vs polling -----------------------------------------------------------------------
def pending_requests(port: int, k: int, tag: str) -> list[str]:
    """``k`` requests that stay pending (infer is stopped): their ids."""
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


def pollers(port: int, ids: list[str], seconds: float, groups: dict[str, list[int]]) -> tuple[CpuMeter, int]:
    """One client per id polling ``GET`` every 0.2 s for ``seconds``; (CPU meter, polls answered)."""
    stop = threading.Event()
    polls = [0] * len(ids)

    def one(i: int, rid: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        time.sleep(POLL_INTERVAL_S * i / len(ids))  # spread the clients over the interval
        nxt = time.monotonic()
        while not stop.is_set():
            status, body = get(conn, f"/v1/ocr/{rid}")
            assert status == 200, (status, body[:200])
            polls[i] += 1
            nxt += POLL_INTERVAL_S
            stop.wait(max(0.0, nxt - time.monotonic()))
        conn.close()

    threads = [threading.Thread(target=one, args=(i, rid), daemon=True) for i, rid in enumerate(ids)]
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
def uploads(port: int, images: list[bytes], concurrency: int) -> dict:
    lat: list[float] = []
    lock = threading.Lock()
    nxt = iter(range(len(images)))

    def worker() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                break
            s = time.perf_counter()
            status, body = post(conn, images[i])
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
    return {"rate": len(images) / wall, "p50": pct(lat, 50), "p99": pct(lat, 99),
            "bytes": sum(map(len, images)) // len(images)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="sequential cached POSTs")
    ap.add_argument("--clients", type=int, default=50, help="waiting clients (long-poll, then polling)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring window of each waiting design")
    ap.add_argument("--uploads", type=int, default=200, help="distinct new images uploaded")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent upload clients")
    args = ap.parse_args()

    print(machine())
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    tag = f"H{int(time.time()) % 100000}"
    cached_img = text_image(["CACHED HTTP BENCH", "INVOICE 4711 TOTAL 99.00"], size=32)
    new_imgs = [text_image([f"{tag} UPLOAD {i:05d}", "NEW IMAGE FOR THE 202 PATH"], size=32)
                for i in range(args.uploads)]
    print(f"stage and door logs in {tmp}")
    with namespaced_pipeline(tmp) as p:  # type: Pipeline
        api = p.start(API)
        api_pid = api.proc.pid
        stores = pids_named("mariadbd", "mysqld", "redis-server")
        groups = {"api": [api_pid], "stores": stores, "clients": [os.getpid()]}
        text = upload_and_finish(api.port, cached_img)
        assert text.startswith("CACHED HTTP BENCH"), text

        a = cached_latency(api.port, api_pid, cached_img, args.n)

        p.stop(p.stages["infer"][0])  # from here on requests stay pending, and no OCR competes for the CPU
        ids = pending_requests(api.port, args.clients, tag)
        lp = waiters(api.port, ids, args.seconds, groups)
        poll, n_polls = pollers(api.port, ids, args.seconds, groups)

        b = uploads(api.port, new_imgs, args.concurrency)

    print()
    print(f"(a) cached image over loopback, {a['bytes']} B PNG, {args.n} sequential POSTs, one keep-alive connection")
    print(f"    {'':34} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    print(f"    {'ocrstream (this run)':34} {a['p50']:8.2f} {a['p99']:8.2f} {a['rps']:8.0f}")
    print(f"    {'seed design (recorded, not run)':34} {SEED_CACHED_P50_MS:8.2f} {'-':>8} {'-':>8}")
    print(f"    p50 ratio ocrstream/seed: {a['p50'] / SEED_CACHED_P50_MS:.2f} (target: p50 <= 2 ms); "
          f"door CPU {a['api_cpu_ms_per_req']:.2f} ms per request")
    print()
    print(f"(c) {args.clients} clients waiting on pending requests for {args.seconds:.0f} s "
          f"(CPU % of one core, from /proc)")
    print(f"    {'':34} {'door':>8} {'db+redis':>9} {'clients':>8} {'GETs/s':>8}")
    print(f"    {'long-poll GET ?wait=' + str(int(args.seconds) + 3):34} {lp.pct_of_core('api'):8.1f} "
          f"{lp.pct_of_core('stores'):9.1f} {lp.pct_of_core('clients'):8.1f} {0:8.1f}")
    print(f"    {'poll GET every 0.2 s (seed design)':34} {poll.pct_of_core('api'):8.1f} "
          f"{poll.pct_of_core('stores'):9.1f} {poll.pct_of_core('clients'):8.1f} {n_polls / poll.wall:8.1f}")
    lp_total = lp.pct_of_core("api") + lp.pct_of_core("stores")
    poll_total = poll.pct_of_core("api") + poll.pct_of_core("stores")
    print(f"    door CPU, polling/long-poll: {poll.pct_of_core('api') / max(lp.pct_of_core('api'), 1e-3):.1f}x; "
          f"door+stores: {poll_total:.1f}% vs {lp_total:.1f}% of a core "
          f"({poll_total / max(lp_total, 1e-3):.1f}x)")
    print(f"    seed design (recorded, not run): polling every 0.2 s burned about "
          f"{100 * SEED_POLL_CPU_SHARE_OF_2_CORES:.0f}% of a 2-core machine (= {200 * SEED_POLL_CPU_SHARE_OF_2_CORES:.0f}% "
          f"of one core)")
    print()
    print(f"(b) distinct new images, {b['bytes']} B PNG each, {args.uploads} uploads, {args.concurrency} concurrent "
          f"clients (202 path, OCR stopped)")
    print(f"    {b['rate']:.1f} uploads/s, p50 {b['p50']:.1f} ms, p99 {b['p99']:.1f} ms per upload")
    print()
    print(machine().splitlines()[1].replace("load:    ", "load after: "))


if __name__ == "__main__":
    main()
