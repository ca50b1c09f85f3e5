"""The CPU engine's models against each other: CPU time per page and resident memory, in one run.

For each round and each model of ``--models`` (the rounds alternate their order), a fresh process
builds the engine as infer does (:class:`RapidOcrEngine`: one worker, ``--threads`` ONNX Runtime
threads, the layout and table models too), starts it (its warm-up), then reads every page once,
one at a time, the infer stage's way (decoded as the decoders do, tiled with ``downscale`` as
for this engine). Per page it measures the process's CPU time (user + system, all its threads:
``resource.getrusage``) and the wall time; per process the resident memory after the start
(VmRSS) and its peak over the pages (VmHWM), from ``/proc/self/status``.

Pages: every sample of ``../shared/samples`` and ``--a4`` generated A4 pages at 150 dpi
(1240 x 1760 px, 40 printed lines of 24 px type, as ``bench.infer_bench``'s mixed pages).

Per model: the mean over the rounds of each page's CPU ms, summed per kind (samples, A4), and
the ratio of each model to the first. CPU time is what a page costs the machine whatever else
runs; wall time on a shared machine is reported but says less.

Usage: python -m bench.engine_speed [--models PP-OCRv6-small,PP-OCRv4-ch] [--rounds 2] [--a4 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import statistics
import subprocess
import time
from pathlib import Path

from services.common.cache.keys import RAPIDOCR_MODELS

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"
WORDS = ("ORDER", "INVOICE", "TOTAL", "AMOUNT", "DELIVERY", "NORTH", "HARBOUR", "ROAD", "PAID", "MONDAY",
         "CLOSED", "SECTION", "CLAUSE", "GATE", "SEAT", "TICKET", "PRICE", "BOX", "APPLE", "PEAR")


def pages(a4: int) -> list[tuple[str, bytes]]:
    """``(name, encoded image)``: the samples, then ``a4`` generated A4 pages."""
    from tests.conftest import text_image

    out = [(m["file"], (SAMPLES / m["file"]).read_bytes())
           for m in json.loads((SAMPLES / "manifest.json").read_text())]
    rng = random.Random(5)
    for i in range(a4):
        lines = [" ".join(rng.choice(WORDS) for _ in range(6)) + f" {i:04d}-{k:02d}" for k in range(40)]
        out.append((f"a4_{i}.png", text_image(lines, size=24, width=1240)))
    return out


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (0 where there is none)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(model: str, threads: int, items: list[tuple[str, bytes]], conn) -> None:
    """One model in a fresh process: start the engine, read every page, send the measurements."""
    import asyncio

    from services.common.images import imaging
    from services.infer.engines.base import OCR
    from services.infer.engines.rapid import RapidOcrEngine
    from services.infer.tiles import make_tiles

    async def main() -> dict:
        rss_before = _status("VmRSS")
        engine = RapidOcrEngine(intra_op_threads=threads, workers=1, model=model)
        await engine.start()
        out = {"rss_start_kib": _status("VmRSS"), "rss_python_kib": rss_before, "pages": {}}
        for name, data in items:
            page, _ = next(imaging.iter_flattened(data, 100_000_000, 1))
            tiles = make_tiles(page, 3.0, engine.max_side, downscale=not engine.shrinks_large_pages)
            c0, t0 = _cpu(), time.perf_counter()
            for tile in tiles:
                await engine.page(tile.image, OCR, 600)
            out["pages"][name] = {"cpu_ms": (_cpu() - c0) * 1000, "wall_ms": (time.perf_counter() - t0) * 1000}
        out["rss_peak_kib"] = _status("VmHWM")
        out["rss_end_kib"] = _status("VmRSS")
        await engine.close()
        return out

    conn.send(asyncio.run(main()))


def measure(model: str, threads: int, items: list[tuple[str, bytes]]) -> dict:
    """One process's measurements of ``model`` (see :func:`_worker`)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(model, threads, items, child))
    proc.start()
    if not parent.poll(3600):
        proc.kill()
        raise TimeoutError(f"{model}: no answer in an hour")
    res = parent.recv()
    proc.join()
    return res


def summary(runs: dict[str, list[dict]], items: list[tuple[str, bytes]]) -> None:
    """Print per-page CPU ms (mean over rounds) per model, per kind sums, ratios and memory."""
    models = list(runs)
    mean = {m: {n: statistics.mean(r["pages"][n]["cpu_ms"] for r in runs[m]) for n, _ in items} for m in models}
    wall = {m: {n: statistics.mean(r["pages"][n]["wall_ms"] for r in runs[m]) for n, _ in items} for m in models}
    print(f"\n{'page':34}" + "".join(f" {m[:16]:>16}" for m in models) + "   ratio (CPU ms, mean of rounds)")
    for n, _ in items:
        cells = "".join(f" {mean[m][n]:16.0f}" for m in models)
        print(f"{n:34}{cells}   {mean[models[0]][n] / mean[models[-1]][n]:.2f}")
    print("\n| pages | " + " | ".join(f"{m} CPU s" for m in models) + " | ratio | " +
          " | ".join(f"{m} wall s" for m in models) + " |")
    print("|---|" + "---|" * (2 * len(models) + 1))
    kinds = {"samples (12)": [n for n, _ in items if not n.startswith("a4_")],
             f"A4 pages ({sum(n.startswith('a4_') for n, _ in items)})": [n for n, _ in items if n.startswith("a4_")]}
    for kind, names in kinds.items():
        if not names:
            continue
        cpu = {m: sum(mean[m][n] for n in names) / 1000 for m in models}
        wl = {m: sum(wall[m][n] for n in names) / 1000 for m in models}
        print(f"| {kind} | " + " | ".join(f"{cpu[m]:.1f}" for m in models) + f" | {cpu[models[0]] / cpu[models[-1]]:.2f} | "
              + " | ".join(f"{wl[m]:.1f}" for m in models) + " |")
    print("\n| model | RSS after start, MiB | peak RSS over the pages, MiB | interpreter before the engine, MiB |")
    print("|---|---|---|---|")
    for m in models:
        rs = runs[m]
        print(f"| {m} | {statistics.mean(r['rss_start_kib'] for r in rs) / 1024:.0f} | "
              f"{max(r['rss_peak_kib'] for r in rs) / 1024:.0f} | {statistics.mean(r['rss_python_kib'] for r in rs) / 1024:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(RAPIDOCR_MODELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--a4", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (OCRSTREAM_RAPIDOCR_THREADS)")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = ap.parse_args()
    models = args.models.split(",")
    items = pages(args.a4)
    runs: dict[str, list[dict]] = {m: [] for m in models}
    # the commit measured: taken before the run (HEAD may move while it runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    t0 = time.time()
    for r in range(args.rounds):
        order = models if r % 2 == 0 else models[::-1]
        for m in order:
            load = os.getloadavg()[0]
            res = measure(m, args.threads, items)
            runs[m].append(res)
            total = sum(p["cpu_ms"] for p in res["pages"].values()) / 1000
            print(f"round {r + 1} {m}: {total:.1f} CPU s over {len(items)} pages, RSS after start "
                  f"{res['rss_start_kib'] / 1024:.0f} MiB, peak {res['rss_peak_kib'] / 1024:.0f} MiB "
                  f"(load average {load:.1f} before)", flush=True)
    summary(runs, items)
    print(f"\n{args.rounds} rounds, {args.threads} ONNX Runtime thread(s), commit {commit}, {platform.machine()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end ({time.time() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
