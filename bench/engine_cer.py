"""CER per kind of page: the pipeline on the new and the old CPU engine, and the raw engines, in one run.

Pages: every file of ``../shared/samples`` (its manifest's true lines; kind from the manifest)
and every generated page of :mod:`tests.pages` (light text on transparent backgrounds, a
two-column form, words whose spaces the recogniser drops, a 6000x160 banner, side-by-side
regions of a form and a product label).

Per page and per engine model (``--models``, the first is the engine the bounds are for:
``PP-OCRv6-small``, then ``PP-OCRv4-ch``, the engine before it):

* **pipeline**: the infer stage's own path, in process: decoding as the decoder processes do
  it (:func:`services.common.images.imaging.iter_flattened`: EXIF, alpha flattening), tiling
  (:func:`services.infer.tiles.make_tiles` at the stage's ``tile_max_aspect`` and the engine's
  max side), the stage's RapidOCR adapter (:class:`RapidOcrEngine`, spaces restored), boxes
  mapped back, lines assembled (:func:`services.infer.textlines.group_lines`). The real
  stack runs the same functions (``tests/integration/test_pipeline.py`` checks its results
  against the bounds written here).
* **raw**: what a new user gets from the engine: the file opened with Pillow (EXIF applied,
  ``convert("RGB")``) and handed to RapidOCR as that image (RapidOCR turns it into the BGR its
  models were trained on), the same models from the same wheel and the same detector limit,
  one line per segment in RapidOCR's own order.
* **raw+lines**: the raw engine's segments assembled into lines by ocrstream's ``group_lines``.

CER: Levenshtein distance over the reference length, case-folded and whitespace runs collapsed
(:func:`services.infer.textlines.cer`).

``--write`` stores, per sample, the first model's raw CER (the better of raw and raw+lines), the
bound (that + ``--margin``), its pipeline's CER, and the raw mean; the pipeline test holds every
sample to its bound and the pipeline's mean to the raw mean.

Usage: python -m bench.engine_cer [--models PP-OCRv6-small,PP-OCRv4-ch] [--margin 0.01] [--det-limit 736]
[--write tests/data/cer_bounds.json]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import subprocess
import time
from pathlib import Path

from PIL import Image, ImageOps

from services.common.images import imaging
from services.common.cache.keys import ENGINE_MAX_SIDE, RAPIDOCR_MODELS
from services.infer.textlines import Segment, cer, group_lines
from services.infer.engines import rapid_models
from services.infer.engines.rapid import RapidOcrEngine
from services.infer.settings import InferSettings
from services.infer.tiles import make_tiles, map_back
from tests.pages import all_pages

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"
MAX_PIXELS = 100_000_000
COLUMNS = ("pipeline", "raw", "raw_lines")


def pipeline_text(engine: RapidOcrEngine, data: bytes, max_aspect: float) -> str:
    """The pipeline's text for ``data``: lines joined by newlines, pages by a blank line."""
    pages = []
    for page, _ in imaging.iter_flattened(data, MAX_PIXELS, 100):
        h, w = page.shape[:2]
        segs: list[Segment] = []
        for tile in make_tiles(page, max_aspect, engine.max_side, downscale=not engine.shrinks_large_pages):
            segs += map_back(tile, engine._one(tile.image).segments, w, h)
        pages.append("\n".join(line.text for line in group_lines(segs)))
    return "\n\n".join(pages)


def raw_engine(model: str, det_limit: int, threads: int):
    """RapidOCR of ``model`` as a user builds it (its package's defaults, the wheel's models by
    path, no download): a function of a Pillow image -> its segments in RapidOCR's order."""
    models = rapid_models.models_for(model)
    folder = rapid_models.model_dir(models)
    if models.package == "rapidocr-onnxruntime":
        from rapidocr_onnxruntime import RapidOCR as Legacy

        legacy = Legacy(intra_op_num_threads=threads, print_verbose=False, det_limit_side_len=det_limit,
                        max_side_len=ENGINE_MAX_SIDE)

        def read_legacy(img: Image.Image) -> list[Segment]:
            result, _ = legacy(img)
            return [Segment([[float(x), float(y)] for x, y in box], str(text), float(score))
                    for box, text, score in result or []]

        return read_legacy
    from rapidocr import RapidOCR

    rapid_models.refuse_downloads()
    ocr = RapidOCR(params={"Global.log_level": "warning", "Det.limit_side_len": det_limit,
                           "Det.model_path": str(folder / models.det), "Cls.model_path": str(folder / models.cls),
                           "Rec.model_path": str(folder / models.rec),
                           "EngineConfig.onnxruntime.intra_op_num_threads": threads})

    def read(img: Image.Image) -> list[Segment]:
        out = ocr(img)
        if out.boxes is None or out.txts is None:
            return []
        return [Segment(box.tolist(), str(text), float(score)) for box, text, score in zip(out.boxes, out.txts, out.scores)]

    return read


def raw_texts(read, data: bytes) -> tuple[str, str]:
    """The raw engine's text, one segment per line in RapidOCR's order, and the same segments
    assembled by ``group_lines``."""
    segs = read(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    return "\n".join(s.text for s in segs), "\n".join(line.text for line in group_lines(segs))


def summary(rows: list[dict], models: list[str]) -> None:
    """Print the table of mean CER per kind, each model's three columns."""
    head = " | ".join(f"{m} {c.replace('_', '+')}" for m in models for c in COLUMNS)
    print(f"| kind | pages | {head} |")
    print("|---|---|" + "---|" * (len(models) * len(COLUMNS)))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    groups = [(k, [r for r in rows if r["kind"] == k]) for k in kinds]
    groups += [("all samples", [r for r in rows if r["sample"]]),
               ("all generated", [r for r in rows if not r["sample"]])]
    for k, rs in groups:
        cells = " | ".join(f"{sum(r[m][c] for r in rs) / len(rs):.4f}" for m in models for c in COLUMNS)
        print(f"| {k} | {len(rs)} | {cells} |")
    samples = [r for r in rows if r["sample"]]
    if len(models) > 1 and samples:
        new, old = (sum(r[m]["pipeline"] for r in samples) / len(samples) for m in models[:2])
        print(f"\nsamples' pipeline mean: {models[0]} {new:.4f} vs {models[1]} {old:.4f} "
              f"({(new - old) / old * 100:+.1f}%)" if old else "")
    worse = [(r["name"], m) for r in rows for m in models[:1]
             if r[m]["pipeline"] > min(r[m]["raw"], r[m]["raw_lines"]) + 0.01]
    print(f"pages where {models[0]}'s pipeline is worse than its raw engine + 0.01: {worse or 'none'}")


def write_bounds(path: Path, rows: list[dict], model: str, margin: float) -> None:
    """``tests/data/cer_bounds.json``: per sample the raw CER of ``model``, the bound, the pipeline's CER."""
    samples = [r for r in rows if r["sample"]]
    bounds = {r["name"]: {"raw_cer": round(min(r[model]["raw"], r[model]["raw_lines"]), 4),
                          "bound": round(min(r[model]["raw"], r[model]["raw_lines"]) + margin, 4),
                          "pipeline_cer": round(r[model]["pipeline"], 4)} for r in samples}
    raw_mean = sum(b["raw_cer"] for b in bounds.values()) / len(bounds)
    path.write_text(json.dumps({"model": model, "margin": margin, "raw_mean": round(raw_mean, 4), "images": bounds},
                               indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(RAPIDOCR_MODELS),
                    help="engine.model values, comma-separated; the first is the one --write bounds")
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--det-limit", type=int, default=736,
                    help="detector limit, px (OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN; the product default 736)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    ap.add_argument("--only", default="", help="read only the pages whose name contains this")
    args = ap.parse_args()
    models = args.models.split(",")
    engines, raws = {}, {}
    for m in models:
        engines[m] = RapidOcrEngine(args.threads, max_side=ENGINE_MAX_SIDE, det_limit_side_len=args.det_limit, model=m)
        engines[m]._read = rapid_models.load(m, threads=args.threads, max_side=ENGINE_MAX_SIDE,
                                             det_limit_side_len=args.det_limit)
        raws[m] = raw_engine(m, args.det_limit, args.threads)
    max_aspect = InferSettings.model_fields["tile_max_aspect"].default

    items = [(m["file"], m["kind"], (SAMPLES / m["file"]).read_bytes(), m["lines"], True)
             for m in json.loads((SAMPLES / "manifest.json").read_text())]
    items += [(p.name, p.kind, p.data, list(p.lines), False) for p in all_pages()]
    items = [it for it in items if args.only in it[0]]
    rows = []
    t_start = time.perf_counter()
    print(f"{'page':36} {'kind':15} " + " ".join(f"{m[:14]:>14} {'raw':>7} {'raw+l':>7}" for m in models) + "     s")
    for name, kind, data, lines, sample in items:
        t0 = time.perf_counter()
        ref = "\n".join(lines)
        row = dict(name=name, kind=kind, sample=sample)
        for m in models:
            raw, raw_lines = (cer(ref, t) for t in raw_texts(raws[m], data))
            row[m] = dict(pipeline=cer(ref, pipeline_text(engines[m], data, max_aspect)), raw=raw, raw_lines=raw_lines)
        rows.append(row)
        cells = " ".join(f"{row[m]['pipeline']:14.4f} {row[m]['raw']:7.4f} {row[m]['raw_lines']:7.4f}" for m in models)
        print(f"{name:36} {kind:15} {cells} {time.perf_counter() - t0:5.1f}", flush=True)
    print()
    summary(rows, models)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    print(f"\ndetector limit {args.det_limit} px, max side {ENGINE_MAX_SIDE}, tile_max_aspect {max_aspect}, "
          f"commit {commit}, {platform.machine()} {platform.processor() or ''} ({time.perf_counter() - t_start:.0f} s)")
    if args.write:
        write_bounds(args.write, rows, models[0], args.margin)


if __name__ == "__main__":
    main()
