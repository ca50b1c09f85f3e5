"""Measure the raw engine's CER on ../shared/samples and write the pipeline's CER bounds.

The raw engine is RapidOCR called directly on each file (EXIF applied, RGB), its segments
ordered into lines the same way the pipeline does. The bound for each image is that CER plus
``--margin``: the pipeline must cost no accuracy beyond it.

Usage: python bench/engine_cer.py [--margin 0.02] [--det-limit 736] [--write tests/data/cer_bounds.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from services.common.textlines import cer, group_lines
from services.infer.engines.rapid import RapidOcrEngine

SAMPLES = Path(__file__).resolve().parent.parent.parent / "shared" / "samples"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--det-limit", type=int, default=736,
                    help="detector limit, px (OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN; the product default 736)")
    args = ap.parse_args()
    from rapidocr_onnxruntime import RapidOCR

    ocr = RapidOCR(intra_op_num_threads=2, print_verbose=False, det_limit_side_len=args.det_limit)
    engine = RapidOcrEngine()
    engine._ocr = ocr
    manifest = json.loads((SAMPLES / "manifest.json").read_text())
    bounds = {}
    print(f"{'file':36} {'ms':>7} {'raw CER':>8}")
    for m in manifest:
        img = np.asarray(ImageOps.exif_transpose(Image.open(SAMPLES / m["file"])).convert("RGB"))
        t0 = time.perf_counter()
        out = engine._one(img)
        ms = (time.perf_counter() - t0) * 1000
        text = "\n".join(s.text for s in group_lines(out.segments))
        c = cer("\n".join(m["lines"]), text)
        bounds[m["file"]] = {"raw_cer": round(c, 4), "bound": round(c + args.margin, 4)}
        print(f"{m['file']:36} {ms:7.0f} {c:8.4f}")
    mean = sum(b["raw_cer"] for b in bounds.values()) / len(bounds)
    print(f"mean raw CER {mean:.4f} over {len(bounds)} images (detector limit {args.det_limit} px)")
    if args.write:
        args.write.write_text(json.dumps({"margin": args.margin, "images": bounds}, indent=2) + "\n")
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
