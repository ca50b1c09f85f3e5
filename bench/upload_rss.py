"""The HTTP door's memory during large uploads: whole body in memory vs streamed to S3.

Starts the HTTP door alone (``python -m services.api``; no stages: accepted requests
just wait on ``ocr.requests``) in a fresh namespace on the local stack (deploy/local/up.sh must
have run), twice:

* ``in memory``: ``OCRSTREAM_HTTP_STREAM_PART_BYTES`` above the body size, so every body takes
  the path all bodies took before streaming (read whole, hashed, then one S3 PutObject);
* ``streamed``: the default 8 MiB parts (multipart upload to the staging prefix while reading,
  then a server-side copy to the content key).

``--body multipart`` sends each image as the file part of a ``multipart/form-data`` body (with
an option field before and after it) instead of a raw body: ``in memory`` then holds the file
part whole, as the door did before file parts were streamed (Starlette's parser, then
``read()``), and ``streamed`` sends it to S3 in parts as it is parsed.

Each door gets one small warm-up upload, then ``--uploads`` distinct ``--mib`` MiB PNGs one
after the other, then ``--concurrent`` more at the same time. The door's resident memory is read
from ``/proc/<pid>/status``: VmRSS after the warm-up (baseline) and VmHWM (peak) after each
phase. Figures from one run on a shared machine; compare the two rows, not the absolutes.

Usage: python -m bench.upload_rss [--mib 40] [--uploads 3] [--concurrent 4] [--body raw|multipart]
"""

from __future__ import annotations

import argparse
import http.client
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.http_bench import machine
from tests.integration.test_http_streaming import FORM_END, FORM_TYPE, form_part, padded_png
from tests.stack import API, REPO, Pipeline, env_applied, namespace_env

MiB = 1024 * 1024


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field (VmRSS, VmHWM) of ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def as_form(png: bytes) -> bytes:
    """``png`` as the file part of a multipart/form-data body, between two option fields."""
    return form_part("source", b"bench") + form_part("file", png, "bench.png") + form_part("task", b"ocr") + FORM_END


def post(port: int, body: bytes, form: bool = False) -> float:
    """POST ``body``: a raw PNG, or (``form``) a multipart/form-data body; 202 expected; returns ms."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/ocr", body=body, headers={"Content-Type": FORM_TYPE if form else "image/png"})
    r = conn.getresponse()
    data = r.read()
    ms = (time.perf_counter() - t0) * 1000
    conn.close()
    assert r.status == 202, (r.status, data[:300])
    return ms


def run_door(p: Pipeline, label: str, part_bytes: int, mib: int, n: int, concurrent: int, form: bool) -> dict:
    st = p.start(API, extra_env={"OCRSTREAM_HTTP_STREAM_PART_BYTES": str(part_bytes)})
    pid = st.proc.pid
    wrap = as_form if form else (lambda png: png)
    try:
        post(st.port, wrap(padded_png([f"WARM {label}"], 64 * 1024)), form)
        base = status_kib(pid, "VmRSS")
        seq_ms = [post(st.port, wrap(padded_png([f"{label} SEQ {i}"], mib * MiB)), form) for i in range(n)]
        seq_peak = status_kib(pid, "VmHWM")
        bodies = [wrap(padded_png([f"{label} CONC {i}"], mib * MiB)) for i in range(concurrent)]
        conc_ms: list[float] = []
        threads = [threading.Thread(target=lambda b=b: conc_ms.append(post(st.port, b, form))) for b in bodies]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        conc_wall = (time.perf_counter() - t0) * 1000
        assert len(conc_ms) == concurrent, "a concurrent upload failed (see the door's log)"
        conc_peak = status_kib(pid, "VmHWM")
    finally:
        p.stop(st)
    return {"label": label, "base": base / 1024, "seq_peak": seq_peak / 1024, "conc_peak": conc_peak / 1024,
            "seq_ms": sorted(seq_ms)[len(seq_ms) // 2], "conc_wall": conc_wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=40, help="size of each upload, MiB (the limit is 50)")
    ap.add_argument("--uploads", type=int, default=3, help="sequential uploads per door")
    ap.add_argument("--concurrent", type=int, default=4, help="uploads at the same time per door")
    ap.add_argument("--body", choices=["raw", "multipart"], default="raw",
                    help="raw image bodies, or multipart/form-data with the image as a file part")
    args = ap.parse_args()
    print(machine())
    logdir = Path(tempfile.mkdtemp(prefix="bench-upload-rss-"))
    env = namespace_env()
    rows = []
    with env_applied(env):
        subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, check=True, capture_output=True)
        p = Pipeline(env=env, logdir=logdir)
        form = args.body == "multipart"
        rows.append(run_door(p, "in memory", 1024 * MiB, args.mib, args.uploads, args.concurrent, form))
        rows.append(run_door(p, "streamed", 8 * MiB, args.mib, args.uploads, args.concurrent, form))
    print(f"door logs in {logdir}")
    print()
    print(f"door RSS, MiB: {args.uploads} x {args.mib} MiB {args.body} uploads one after the other, "
          f"then {args.concurrent} at once "
          f"(202 path: S3 write + Kafka produce)")
    print(f"    {'':12} {'baseline':>9} {'peak seq':>9} {'+seq':>7} {'peak conc':>10} {'+conc':>7} "
          f"{'p50 ms/upload':>14} {'conc wall ms':>13}")
    for r in rows:
        print(f"    {r['label']:12} {r['base']:9.0f} {r['seq_peak']:9.0f} {r['seq_peak'] - r['base']:7.0f} "
              f"{r['conc_peak']:10.0f} {r['conc_peak'] - r['base']:7.0f} {r['seq_ms']:14.0f} {r['conc_wall']:13.0f}")
    a, b = rows
    print(f"    growth over baseline, streamed/in memory: one at a time "
          f"{(b['seq_peak'] - b['base']) / max(a['seq_peak'] - a['base'], 1e-9):.2f}, "
          f"{args.concurrent} at once {(b['conc_peak'] - b['base']) / max(a['conc_peak'] - a['base'], 1e-9):.2f}")
    print(machine().splitlines()[1].replace("load:    ", "load after: "))


if __name__ == "__main__":
    main()
