"""The CPU engine's doc_parse and table against its ocr, per sample page: time, regions, CER.

Pages: every file of ``../shared/samples`` (FUNSD forms, SROIE receipts, two Chinese photos) and
the generated order page of :func:`tests.pages.order_page` (a title, a paragraph, a ruled table).
Each page goes the infer stage's way: decoded as the decoder does
(:func:`services.common.images.imaging.iter_flattened`), cut by :func:`services.infer.tiles.make_tiles`
(``ocr``: the stage's ``tile_max_aspect``; the other tasks: whole, downscaled to the engine's max
side), then :meth:`RapidOcrEngine._one` with one worker, each task in turn.

Printed per page: ms of ``ocr``, ``doc_parse`` and ``table`` and their ratios to ``ocr``; ms of the
layout model alone and of the table model (structure and cell matching) alone on the whole page,
which is what ``doc_parse`` and ``table`` add to the OCR (the task times themselves swing with the
machine's load more than by that on a shared machine); the layout
regions found (label counts); tables in the Markdown; the CER against the manifest's true lines of
the ``ocr`` lines, of the Markdown's plain text and of the tables' plain text; and the CER of the
Markdown's plain text against the ``ocr`` text (0 = the same characters: the Markdown lost or
added nothing but its marks). Plain text: headings' ``#`` and backslash escapes removed, a table
as its cells (a row a line), entities unescaped. CER: :func:`services.infer.textlines.cer`
(Levenshtein over the reference length, case-folded, whitespace collapsed), which is sensitive to
order: text placed in another order than the true lines costs.

Usage: python -m bench.structure_bench [--repeat 1]
"""

from __future__ import annotations

import argparse
import html
import json
import platform
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np

from services.common.images import imaging
from services.infer.textlines import cer, group_lines
from services.infer.engines.rapid import RapidOcrEngine
from services.infer.settings import InferSettings
from services.infer.tiles import make_tiles, map_back
from tests.pages import ORDER_PARAGRAPH, ORDER_TABLE, ORDER_TITLE, order_page

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"
MAX_PIXELS = 100_000_000
_CELL = re.compile(r"<t[dh][^>]*>(.*?)</t[dh]>", re.S)
_ROW = re.compile(r"<tr>(.*?)</tr>", re.S)
_TABLE = re.compile(r"<table>.*?</table>", re.S)


def table_text(table: str) -> str:
    """A ``<table>``'s plain text: its non-empty cells joined by a space, a row a line."""
    rows = [" ".join(html.unescape(c).strip() for c in _CELL.findall(r) if c.strip()) for r in _ROW.findall(table)]
    return "\n".join(r for r in rows if r)


def markdown_text(md: str) -> str:
    """The Markdown's plain text (module docstring)."""
    out = []
    for block in md.split("\n\n"):
        if block.startswith("<table"):
            out.append(table_text(block))
            continue
        block = re.sub(r"^# ", "", block)
        out.append(re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", block))
    return "\n".join(out)


def run(engine: RapidOcrEngine, data: bytes, max_aspect: float, repeat: int) -> dict:
    """One page's figures (the first page of ``data``)."""
    page, _ = next(iter(imaging.iter_flattened(data, MAX_PIXELS, 1)))
    h, w = page.shape[:2]
    out: dict = {}
    for task in ("ocr", "doc_parse", "table"):
        tiles = make_tiles(page, max_aspect if task == "ocr" else float("inf"), engine.max_side,
                           downscale=not engine.shrinks_large_pages)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            results = [(tile, engine._one(tile.image, task)) for tile in tiles]
            best = min(best, (time.perf_counter() - t0) * 1000)
        out[task + "_ms"] = best
        if task == "ocr":
            segs = [s for tile, r in results for s in map_back(tile, r.segments, w, h)]
            out["ocr"] = "\n".join(line.text for line in group_lines(segs))
        else:
            out[task] = "\n\n".join(r.answer for _, r in results if r.answer)
    tile = make_tiles(page, float("inf"), engine.max_side, downscale=not engine.shrinks_large_pages)[0]
    bgr = np.ascontiguousarray(tile.image[:, :, ::-1])
    segs = engine._segments(tile.image)
    out["layout_ms"] = out["struct_ms"] = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        regions = engine._structure.regions(bgr)
        t1 = time.perf_counter()
        engine._structure.table(bgr, None, segs)
        t2 = time.perf_counter()
        out["layout_ms"] = min(out["layout_ms"], (t1 - t0) * 1000)
        out["struct_ms"] = min(out["struct_ms"], (t2 - t1) * 1000)
    out["regions"] = Counter(r.label for r in regions)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per page and task; the fastest counts")
    args = ap.parse_args()
    import asyncio

    engine = RapidOcrEngine()  # one worker, one thread: the default engine's per-image path
    t_load = time.perf_counter()
    asyncio.run(engine.start())
    load_s = time.perf_counter() - t_load
    max_aspect = InferSettings.model_fields["tile_max_aspect"].default
    items = [(m["file"], (SAMPLES / m["file"]).read_bytes(), m["lines"])
             for m in json.loads((SAMPLES / "manifest.json").read_text())]
    truth = [ORDER_TITLE, *ORDER_PARAGRAPH, *(" ".join(r) for r in ORDER_TABLE)]
    items.append(("generated order_page", order_page(), truth))
    print(f"{'page':30} {'ocr ms':>7} {'doc ms':>7} {'tab ms':>7} {'doc/ocr':>7} {'tab/ocr':>7} {'lay ms':>6} {'tm ms':>6} "
          f"{'CER ocr':>7} {'CER md':>7} {'CER tab':>7} {'md~ocr':>6} {'tables':>6}  regions")
    rows = []
    for name, data, lines in items:
        r = run(engine, data, max_aspect, args.repeat)
        ref = "\n".join(lines)
        md_text = markdown_text(r["doc_parse"])
        tab_text = "\n".join(table_text(t) for t in _TABLE.findall(r["table"]))
        row = dict(name=name, ocr_ms=r["ocr_ms"], doc_ms=r["doc_parse_ms"], tab_ms=r["table_ms"],
                   layout_ms=r["layout_ms"], struct_ms=r["struct_ms"],
                   cer_ocr=cer(ref, r["ocr"]), cer_md=cer(ref, md_text), cer_tab=cer(ref, tab_text),
                   md_vs_ocr=cer(r["ocr"], md_text), tables=len(_TABLE.findall(r["doc_parse"])),
                   regions=dict(sorted(r["regions"].items())))
        rows.append(row)
        regions = ", ".join(f"{k} {v}" for k, v in row["regions"].items()) or "none"
        print(f"{name:30} {row['ocr_ms']:7.0f} {row['doc_ms']:7.0f} {row['tab_ms']:7.0f} "
              f"{row['doc_ms'] / row['ocr_ms']:7.2f} {row['tab_ms'] / row['ocr_ms']:7.2f} {row['layout_ms']:6.0f} "
              f"{row['struct_ms']:6.0f} {row['cer_ocr']:7.4f} "
              f"{row['cer_md']:7.4f} {row['cer_tab']:7.4f} {row['md_vs_ocr']:6.4f} {row['tables']:6d}  {regions}",
              flush=True)
    samples = rows[:-1]

    def mean(key: str, rs: list[dict] = samples) -> float:
        return sum(r[key] for r in rs) / len(rs)

    print()
    print("| samples | ocr ms | doc_parse ms | table ms | doc_parse/ocr | table/ocr | layout model ms | table model ms "
          "| (layout+table model)/ocr | CER ocr | CER doc_parse text | CER table text | doc_parse text vs ocr |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(samples)} (mean) | {mean('ocr_ms'):.0f} | {mean('doc_ms'):.0f} | {mean('tab_ms'):.0f} | "
          f"{mean('doc_ms') / mean('ocr_ms'):.2f} | {mean('tab_ms') / mean('ocr_ms'):.2f} | {mean('layout_ms'):.0f} | "
          f"{mean('struct_ms'):.0f} | {(mean('layout_ms') + mean('struct_ms')) / mean('ocr_ms'):.2f} | {mean('cer_ocr'):.4f} | "
          f"{mean('cer_md'):.4f} | {mean('cer_tab'):.4f} | {mean('md_vs_ocr'):.4f} |")
    labels = Counter()
    for r in samples:
        labels.update(r["regions"])
    print(f"\nregions over the samples: {dict(sorted(labels.items()))}; pages with a table region: "
          f"{sum(1 for r in samples if r['regions'].get('table'))} of {len(samples)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    print(f"engine start {load_s:.1f} s (RapidOCR, layout and table models, warm-up); one worker, 1 thread; "
          f"repeat {args.repeat}; commit {commit}, {platform.machine()} {platform.processor() or ''}")


if __name__ == "__main__":
    main()
