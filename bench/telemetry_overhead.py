"""Cost of telemetry: pipeline images/s with tracing + metrics fully on vs tracing off, in one run.

Starts two namespaced pipelines on the local stack (deploy/local/up.sh must have run): "off"
(``traces_exporter=none``: ids still propagate, no span is recorded) and "on" (the ``file``
exporter, or ``--exporter console``, writing every span). Metrics are served by both (the
stages always count). Rounds alternate off/on (ABAB...) so drift of the machine hits both
alike; every round sends fresh small generated images (cache misses). Prints per-round and
overall images/s and the cost of telemetry = 1 - on/off (target: under 3 %).

Usage: python bench/telemetry_overhead.py [--n 40] [--rounds 2] [--exporter file|console]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import pct
from tests.conftest import text_image
from tests.stack import Pipeline, env_applied, namespace_env


def images(n: int, tag: str) -> list[tuple[bytes, str]]:
    """``n`` distinct small printed-text images (same size, so the same OCR work)."""
    return [(text_image([f"{tag} INVOICE {i:05d}", f"TOTAL {i * 7 % 1000:03d}.00"], size=32), f"{tag}-{i}.png")
            for i in range(n)]


def start(env: dict[str, str], logdir: Path, max_in_flight: int) -> Pipeline:
    """A pipeline in namespace ``env`` (topics created), one process per stage, ready."""
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], check=True, capture_output=True)
    p = Pipeline(env=env, logdir=logdir)
    for st in ("ingest", "dedup", "sink"):
        p.start(st, wait_ready=False)
    p.start("infer", {"OCRSTREAM_MAX_IN_FLIGHT": str(max_in_flight)} if max_in_flight else {}, wait_ready=False)
    for sts in p.stages.values():
        for st in sts:
            p.wait_ready(st)
    return p


def run_round(p: Pipeline, items: list[tuple[bytes, str]]) -> tuple[float, list[float]]:
    """Push ``items`` through ``p``; returns (images/s, submit->completion latencies in ms)."""
    with env_applied(p.env):  # the submitter reads the namespace's topics from the environment
        t0 = time.perf_counter()
        docs = asyncio.run(p.run(items, timeout=1800, source="bench"))
        wall = time.perf_counter() - t0
    bad = [d for d in docs if d.status != "ok"]
    assert not bad, bad[0].error
    return len(docs) / wall, [d.completed_at_ms - d.submitted_at_ms for d in docs]


def span_cost_us(exporter: str, path: Path, n: int = 20000) -> float:
    """CPU µs per span (start, store-call style child, inject, end) with ``exporter``, in-process."""
    from services.common.settings import TelemetrySettings
    from services.common.telemetry import Telemetry

    tel = Telemetry("bench", TelemetrySettings(traces_exporter=exporter, traces_file=str(path)))
    t0 = time.process_time()
    for _ in range(n // 2):
        with tel.span("stage", parent_headers=[]):
            with tel.store_call("s3", "get"):
                tel.inject()
    tel.close()  # includes the exporter's flush
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=40, help="images per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per setting (alternating)")
    ap.add_argument("--exporter", choices=("file", "console"), default="file")
    ap.add_argument("--max-in-flight", type=int, default=0, help="infer's window (0: the engine's default)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-telemetry-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.rounds} rounds x {args.n} images "
          f"per setting; 'on' = {args.exporter} exporter + metrics; logs in {tmp}")
    off_env = namespace_env(partitions=4)
    off_env["OCRSTREAM_TELEMETRY__TRACES_EXPORTER"] = "none"
    on_env = namespace_env(partitions=4)
    on_env["OCRSTREAM_TELEMETRY__TRACES_EXPORTER"] = args.exporter
    on_env["OCRSTREAM_TELEMETRY__TRACES_FILE"] = str(tmp / "spans.jsonl")
    (tmp / "off").mkdir()
    (tmp / "on").mkdir()
    pipes = {"off": start(off_env, tmp / "off", args.max_in_flight), "on": start(on_env, tmp / "on", args.max_in_flight)}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    lats: dict[str, list[float]] = {"off": [], "on": []}
    try:
        # warm-up: first requests pay connection set-up and engine first-call costs
        for name, p in pipes.items():
            run_round(p, images(8, f"W{name}"))
        for r in range(args.rounds):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rate, lat = run_round(pipes[name], images(args.n, f"R{r}{name}"))
                rates[name].append(rate)
                lats[name].extend(lat)
                print(f"round {r + 1} {name:>3}: {rate:.2f} images/s (p50 {pct(lat, 50):.0f} ms)")
    finally:
        for p in pipes.values():
            p.stop_all()
    off = sum(rates["off"]) / len(rates["off"])
    on = sum(rates["on"]) / len(rates["on"])
    spans = sum(1 for _ in open(tmp / "spans.jsonl", "rb")) if (tmp / "spans.jsonl").exists() else 0
    print(f"off: {off:.2f} images/s, p50 {pct(lats['off'], 50):.0f} ms, p95 {pct(lats['off'], 95):.0f} ms")
    print(f"on:  {on:.2f} images/s, p50 {pct(lats['on'], 50):.0f} ms, p95 {pct(lats['on'], 95):.0f} ms "
          f"({spans} spans written)")
    print(f"ratio on/off: {on / off:.3f}; telemetry cost: {100 * (1 - on / off):+.1f}% (target < 3%)")
    # The end-to-end ratio is as noisy as the machine; the CPU cost per request is not.
    per_req = spans / max(1, (len(lats["on"]) + 16))  # + the warm-up requests
    none_us, on_us = span_cost_us("none", tmp / "micro.jsonl"), span_cost_us(args.exporter, tmp / "micro.jsonl")
    cpu_ms = per_req * on_us / 1000
    print(f"span CPU cost: {none_us:.1f} us (none) / {on_us:.1f} us ({args.exporter}) per span; "
          f"{per_req:.1f} spans per request = {cpu_ms:.2f} ms CPU per request with tracing on, "
          f"{100 * cpu_ms / (1000 / max(off, 1e-9)):.3f}% of the {1000 / off:.0f} ms per image of the 'off' pipeline")


if __name__ == "__main__":
    main()
