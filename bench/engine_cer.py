"""CER per kind of page: the pipeline against the raw RapidOCR engine, in one run.

Pages: every file of ``../shared/samples`` (its manifest's true lines; kind from the manifest)
and every generated page of :mod:`tests.pages` (light text on transparent backgrounds, a
two-column form, words whose spaces the recogniser drops, a 6000x160 banner).

* **pipeline**: the infer stage's own path, in process: decoding as the decoder processes do
  it (:func:`services.common.imaging.iter_flattened`: EXIF, alpha flattening), tiling
  (:func:`services.infer.tiles.make_tiles` at the stage's ``tile_max_aspect`` and the engine's
  max side), the stage's RapidOCR adapter (:class:`RapidOcrEngine`, spaces restored), boxes
  mapped back, lines assembled (:func:`services.common.textlines.group_lines`). The real
  stack runs the same functions (``tests/integration/test_pipeline.py`` checks its results
  against the bounds written here).
* **raw**: what a new user gets from the engine: the file opened with Pillow (EXIF applied,
  ``convert("RGB")``), ``RapidOCR()(image)`` with the same detector limit, one line per
  segment in RapidOCR's own order.
* **raw+lines**: the raw engine's segments assembled into lines by ocrstream's
  ``group_lines`` (the same row grouping as the pipeline).

CER: Levenshtein distance over the reference length, case-folded and whitespace runs collapsed
(:func:`services.common.textlines.cer`).

``--write`` stores, per sample, the raw engine's CER (the better of raw and raw+lines), the
bound (that + ``--margin``), the pipeline's CER, and the raw mean; the pipeline test holds
every sample to its bound and the pipeline's mean to the raw mean.

Usage: python -m bench.engine_cer [--margin 0.01] [--det-limit 736] [--write tests/data/cer_bounds.json]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from services.common import imaging
from services.common.settings import ENGINE_MAX_SIDE
from services.common.textlines import Segment, cer, group_lines
from services.infer.engines.rapid import RapidOcrEngine
from services.infer.settings import InferSettings
from services.infer.tiles import make_tiles, map_back
from tests.pages import all_pages

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"
MAX_PIXELS = 100_000_000


def pipeline_text(engine: RapidOcrEngine, data: bytes, max_aspect: float) -> str:
    """The pipeline's text for ``data``: lines joined by newlines, pages by a blank line."""
    pages = []
    for page, _ in imaging.iter_flattened(data, MAX_PIXELS, 100):
        h, w = page.shape[:2]
        segs: list[Segment] = []
        for tile in make_tiles(page, max_aspect, engine.max_side):
            segs += map_back(tile, engine._one(tile.image).segments, w, h)
        pages.append("\n".join(line.text for line in group_lines(segs)))
    return "\n\n".join(pages)


def raw_texts(ocr, data: bytes) -> tuple[str, str]:
    """The raw engine's text, one segment per line in RapidOCR's order, and the same segments
    assembled by ``group_lines``."""
    img = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    result, _ = ocr(img)
    segs = [Segment([[float(x), float(y)] for x, y in box], str(text), float(score))
            for box, text, score in result or []]
    return "\n".join(s.text for s in segs), "\n".join(line.text for line in group_lines(segs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--det-limit", type=int, default=736,
                    help="detector limit, px (OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN; the product default 736)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    args = ap.parse_args()
    from rapidocr_onnxruntime import RapidOCR

    ocr = RapidOCR(intra_op_num_threads=args.threads, print_verbose=False, det_limit_side_len=args.det_limit,
                   max_side_len=ENGINE_MAX_SIDE)
    engine = RapidOcrEngine(max_side=ENGINE_MAX_SIDE, det_limit_side_len=args.det_limit)
    engine._ocr = ocr
    max_aspect = InferSettings.model_fields["tile_max_aspect"].default

    items = [(m["file"], m["kind"], (SAMPLES / m["file"]).read_bytes(), m["lines"], True)
             for m in json.loads((SAMPLES / "manifest.json").read_text())]
    items += [(p.name, p.kind, p.data, list(p.lines), False) for p in all_pages()]
    rows = []
    t_start = time.perf_counter()
    print(f"{'page':36} {'kind':15} {'pipeline':>8} {'raw':>7} {'raw+lines':>9} {'s':>5}")
    for name, kind, data, lines, sample in items:
        t0 = time.perf_counter()
        ref = "\n".join(lines)
        pipe = cer(ref, pipeline_text(engine, data, max_aspect))
        raw, raw_lines = (cer(ref, t) for t in raw_texts(ocr, data))
        rows.append(dict(name=name, kind=kind, sample=sample, pipeline=pipe, raw=raw, raw_lines=raw_lines))
        took = time.perf_counter() - t0
        print(f"{name:36} {kind:15} {pipe:8.4f} {raw:7.4f} {raw_lines:9.4f} {took:5.1f}", flush=True)
    print()
    print("| kind | pages | pipeline CER | raw engine CER | raw + ocrstream lines CER |")
    print("|---|---|---|---|---|")
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    groups = [(k, [r for r in rows if r["kind"] == k]) for k in kinds]
    groups += [("all samples", [r for r in rows if r["sample"]]),
               ("all generated", [r for r in rows if not r["sample"]])]
    for k, rs in groups:
        mean = {c: sum(r[c] for r in rs) / len(rs) for c in ("pipeline", "raw", "raw_lines")}
        print(f"| {k} | {len(rs)} | {mean['pipeline']:.4f} | {mean['raw']:.4f} | {mean['raw_lines']:.4f} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    print(f"\ndetector limit {args.det_limit} px, max side {ENGINE_MAX_SIDE}, tile_max_aspect {max_aspect}, "
          f"commit {commit}, {platform.machine()} {platform.processor() or ''} ({time.perf_counter() - t_start:.0f} s)")
    if args.write:
        samples = [r for r in rows if r["sample"]]
        bounds = {r["name"]: {"raw_cer": round(min(r["raw"], r["raw_lines"]), 4),
                              "bound": round(min(r["raw"], r["raw_lines"]) + args.margin, 4),
                              "pipeline_cer": round(r["pipeline"], 4)} for r in samples}
        raw_mean = sum(b["raw_cer"] for b in bounds.values()) / len(bounds)
        args.write.write_text(json.dumps({"margin": args.margin, "raw_mean": round(raw_mean, 4), "images": bounds},
                                         indent=2) + "\n")
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
