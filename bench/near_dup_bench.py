"""Near-duplicate lookup: false hits on same-template documents, true hits on re-encodes/rescales.

One run, two sets, judged exactly as dedup judges a candidate (pHash distance within
``max_hamming``, then :func:`services.common.cache.neardup.verify`):

* **must never hit** (false-hit rate, must be 0): invoice-like pages drawn from one template
  (same layout, font and size) whose field values differ (one digit of one field, chosen among
  look-alike digits such as 3/8 or 1/7; one whole field; every value), each compared as PNG, as
  a JPEG re-encode and as a rescale; plus real pages of ``../shared/samples`` with one digit
  of one text line painted over with another digit.
* **should hit** (true-hit rate): JPEG re-encodes (quality 95..40), rescales (0.8..1.25) and
  both, of the generated pages and of the real pages.

Usage: python bench/near_dup_bench.py [--templates 12] [--seed 1] [--json OUT] [--explore]
The real pages are read in place (read-only) from ``../shared/samples``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from services.common.images.imaging import decode
from services.common.cache.neardup import hamming, phash64, verify
from services.dedup.settings import NearDupSettings

SAMPLES = Path(__file__).resolve().parent.parent.parent / "shared" / "samples"
FONTS = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
]
LOOKALIKE = {"0": "8", "1": "7", "2": "7", "3": "8", "4": "1", "5": "6", "6": "5", "7": "1", "8": "3", "9": "8"}
JPEG_QUALITIES = (95, 85, 75, 60, 50, 40)
SCALES = (0.8, 0.9, 1.1, 1.25)
BOTH = ((0.9, 75), (1.1, 60), (0.8, 85), (1.25, 50))


def _font(path: str, size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.truetype(path, size)
    except OSError:
        return ImageFont.load_default(size)


# -- generated invoices ---------------------------------------------------------------------
@dataclass(frozen=True)
class Template:
    """One invoice layout: page width, font, text size, company, item rows."""

    width: int
    font: str
    size: int
    company: str
    items: tuple[str, ...]


def make_template(rng: random.Random) -> Template:
    """A random invoice layout (page 700-1700 px wide, text 12-30 px, half of them 12-16 px)."""
    words = ["ACME", "NORTHWIND", "GLOBEX", "INITECH", "UMBRELLA", "STARK", "WAYNE", "HOOLI", "VANDELAY"]
    goods = ["PAPER A4 80G", "TONER CARTRIDGE", "STAPLER", "USB CABLE 2M", "DESK LAMP", "NOTEBOOK",
             "PENS (BOX 50)", "MONITOR STAND", "KEYBOARD", "ENVELOPES C5", "LABELS", "FOLDERS"]
    return Template(
        width=rng.randint(700, 1700), font=rng.choice(FONTS), size=rng.choice([12, 13, 14, 16, 18, 22, 26, 30]),
        company=f"{rng.choice(words)} {rng.choice(['SUPPLIES', 'TRADING', 'OFFICE'])} LTD",
        items=tuple(rng.sample(goods, rng.randint(3, 7))),
    )


def make_values(t: Template, rng: random.Random) -> dict[str, str]:
    """Field values of one invoice: number, date, customer id, qty/price per item, total."""
    v = {"no": str(rng.randint(10000, 999999)), "date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
         "cust": f"C{rng.randint(1000, 9999)}"}
    total = 0.0
    for i in range(len(t.items)):
        q, p = rng.randint(1, 99), rng.randint(100, 99999) / 100
        v[f"q{i}"], v[f"p{i}"] = str(q), f"{p:.2f}"
        total += q * p
    v["total"] = f"{total:.2f}"
    return v


def render(t: Template, v: dict[str, str]) -> Image.Image:
    """Draw the invoice: header, fields, a table of items, the total."""
    f, fb = _font(t.font, t.size), _font(t.font, int(t.size * 1.5))
    row = int(t.size * 1.7)
    h = int(row * (12 + len(t.items))) + 80
    img = Image.new("RGB", (t.width, h), "white")
    d = ImageDraw.Draw(img)
    x0, y = 40, 30
    d.text((x0, y), t.company, fill="black", font=fb)
    y += int(row * 1.6)
    d.text((x0, y), "12 HIGH STREET, SPRINGFIELD  TEL 555-0100", fill="black", font=f)
    y += row * 2
    for label, key in (("INVOICE NO:", "no"), ("DATE:", "date"), ("CUSTOMER:", "cust")):
        d.text((x0, y), label, fill="black", font=f)
        d.text((x0 + t.size * 9, y), v[key], fill="black", font=f)
        y += row
    y += row // 2
    cols = [x0, int(t.width * 0.55), int(t.width * 0.7), int(t.width * 0.85) - 20]
    for c, name in zip(cols, ("ITEM", "QTY", "PRICE", "AMOUNT")):
        d.text((c, y), name, fill="black", font=f)
    y += row
    d.line([(x0, y - 4), (t.width - 40, y - 4)], fill="black", width=2)
    for i, item in enumerate(t.items):
        q, p = v[f"q{i}"], v[f"p{i}"]
        for c, text in zip(cols, (item, q, p, f"{int(q) * float(p):.2f}")):
            d.text((c, y), text, fill="black", font=f)
        y += row
    d.line([(x0, y + 4), (t.width - 40, y + 4)], fill="black", width=2)
    y += row
    d.text((cols[2], y), "TOTAL", fill="black", font=fb)
    d.text((cols[3], y), v["total"], fill="black", font=fb)
    y += row * 2
    d.text((x0, y), "THANK YOU FOR YOUR BUSINESS", fill="black", font=f)
    return img


def change_one_digit(v: dict[str, str], rng: random.Random) -> dict[str, str]:
    """The same values with one digit of one stand-alone field (number, date, customer or total;
    a quantity or price would change its line's amount too) replaced by a look-alike digit."""
    key = rng.choice(["no", "date", "cust", "total"])
    s = v[key]
    i = rng.choice([i for i, c in enumerate(s) if c.isdigit()])
    return {**v, key: s[:i] + LOOKALIKE[s[i]] + s[i + 1:]}


def change_one_field(t: Template, v: dict[str, str], rng: random.Random) -> dict[str, str]:
    """The same values with one field (not the total) drawn anew."""
    fresh = make_values(t, rng)
    key = rng.choice(["no", "date", "cust", "q0", "p0"])
    return {**v, key: fresh[key] if fresh[key] != v[key] else fresh[key] + "1"}


# -- variants -----------------------------------------------------------------------------
def encode(img: Image.Image, fmt: str = "PNG", quality: int = 90) -> bytes:
    """Encode ``img`` as PNG or JPEG (``quality``) bytes."""
    buf = io.BytesIO()
    img.convert("RGB").save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def rescale(img: Image.Image, s: float, rng: random.Random) -> Image.Image:
    """``img`` resized by ``s`` with a randomly chosen common filter."""
    f = rng.choice([Image.Resampling.BICUBIC, Image.Resampling.BILINEAR, Image.Resampling.LANCZOS])
    return img.resize((max(1, round(img.width * s)), max(1, round(img.height * s))), f)


def variants(img: Image.Image, rng: random.Random) -> list[tuple[str, bytes]]:
    """Re-encodes, rescales and both of one page, as (label, encoded bytes)."""
    out = [(f"jpeg{q}", encode(img, "JPEG", q)) for q in JPEG_QUALITIES]
    out += [(f"scale{s}", encode(rescale(img, s, rng))) for s in SCALES]
    out += [(f"scale{s}+jpeg{q}", encode(rescale(img, s, rng), "JPEG", q)) for s, q in BOTH]
    return out


def hard_forms(img: Image.Image, rng: random.Random) -> list[tuple[str, bytes]]:
    """How a different document may arrive: as PNG, re-encoded, rescaled (as (label, bytes))."""
    return [("png", encode(img)), ("jpeg75", encode(img, "JPEG", 75)), ("scale0.9", encode(rescale(img, 0.9, rng))),
            ("scale1.1+jpeg60", encode(rescale(img, 1.1, rng), "JPEG", 60))]


# -- real pages with one digit painted over --------------------------------------------------
def digit_edits(path: Path, rng: random.Random, ocr, n: int) -> list[tuple[str, Image.Image]]:
    """Up to ``n`` copies of a real page, each with one digit of one line painted over with a
    different digit of about the same size (positions from RapidOCR's line boxes, the digit's
    place within its line by its index in the text)."""
    img = Image.open(path).convert("RGB")
    res, _ = ocr(np.asarray(img))
    lines = [(box, text) for box, text, _ in (res or []) if any(c.isdigit() for c in text)]
    out = []
    for box, text in rng.sample(lines, min(n, len(lines))):
        xs, ys = [p[0] for p in box], [p[1] for p in box]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        i = rng.choice([i for i, c in enumerate(text) if c.isdigit()])
        cw = (x1 - x0) / max(1, len(text))
        cx0 = x0 + i * cw
        edited = img.copy()
        d = ImageDraw.Draw(edited)
        d.rectangle([cx0, y0 + 1, cx0 + cw, y1 - 1], fill="white")
        f = _font(FONTS[0], max(8, int((y1 - y0) * 0.8)))
        d.text((cx0, y0 + (y1 - y0) * 0.1), LOOKALIKE[text[i]], fill="black", font=f)
        out.append((f"{path.name}:{text[i]}->{LOOKALIKE[text[i]]}", edited))
    return out


# -- judging --------------------------------------------------------------------------------
def page(data: bytes) -> np.ndarray:
    """Decode like the pipeline (upright RGB, first page)."""
    return decode(data, 100_000_000, 20)[0]


@dataclass
class Tally:
    """Counts of one category."""

    n: int = 0
    hits: int = 0
    candidates: int = 0
    worst: list[float] = field(default_factory=list)
    dist: list[int] = field(default_factory=list)

    def add(self, d: int, cand: bool, hit: bool, worst: float) -> None:
        """Count one pair: pHash distance, candidate or not, hit or not, worst window."""
        self.n += 1
        self.candidates += cand
        self.hits += hit
        self.worst.append(worst)
        self.dist.append(d)


def judge(a: np.ndarray, ha: int, data: bytes, nd: NearDupSettings) -> tuple[int, bool, bool, float]:
    """(pHash distance, is a candidate, verified hit, worst window difference) of one pair."""
    b = page(data)
    d = hamming(ha, phash64(b))
    v = verify(a, b, nd.verify_params())
    return d, d <= nd.max_hamming, d <= nd.max_hamming and v.match, v.worst_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--templates", type=int, default=12, help="generated invoice templates")
    ap.add_argument("--docs", type=int, default=2, help="base documents per template")
    ap.add_argument("--real-edits", type=int, default=4, help="digit edits per real page")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="write the tallies here")
    ap.add_argument("--explore", action="store_true", help="print every pair's figures")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    nd = NearDupSettings()
    t0 = time.time()
    neg: dict[str, Tally] = {}
    pos: dict[str, Tally] = {}

    def record(table: dict[str, Tally], cat: str, label: str, res: tuple[int, bool, bool, float]) -> None:
        table.setdefault(cat, Tally()).add(*res)
        if args.explore:
            print(f"  {cat:22} {label:40} d={res[0]:2d} cand={res[1]:d} hit={res[2]:d} worst={res[3]:6.2f}")

    for ti in range(args.templates):
        t = make_template(rng)
        for _ in range(args.docs):
            v = make_values(t, rng)
            base = render(t, v)
            a = page(encode(base))
            ha = phash64(a)
            for kind, v2 in (("one digit", change_one_digit(v, rng)), ("one field", change_one_field(t, v, rng)),
                             ("all values", make_values(t, rng))):
                for form, data in hard_forms(render(t, v2), rng):
                    record(neg, f"template: {kind}", f"t{ti} {form}", judge(a, ha, data, nd))
            for label, data in variants(base, rng):
                record(pos, "generated: " + label.split("+")[0].rstrip("0123456789."), f"t{ti} {label}",
                       judge(a, ha, data, nd))

    from rapidocr_onnxruntime import RapidOCR
    ocr = RapidOCR(intra_op_num_threads=1, print_verbose=False)
    for path in sorted(p for p in SAMPLES.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg")):
        raw = path.read_bytes()
        a = page(raw)
        ha = phash64(a)
        img = Image.fromarray(a)
        for label, edited in digit_edits(path, rng, ocr, args.real_edits):
            for form, data in hard_forms(edited, rng)[:2]:
                record(neg, "real page: one digit", f"{label} {form}", judge(a, ha, data, nd))
        for label, data in variants(img, rng):
            record(pos, "real: " + label.split("+")[0].rstrip("0123456789."), f"{path.name} {label}",
                   judge(a, ha, data, nd))

    def show(title: str, table: dict[str, Tally]) -> tuple[int, int]:
        print(f"\n{title}")
        print(f"  {'category':26} {'pairs':>5} {'pHash cand.':>11} {'hits':>5} {'d max':>5} {'worst p50':>9} {'min':>6} {'max':>6}")
        tot = hits = 0
        for cat, tl in table.items():
            w = np.array(tl.worst)
            print(f"  {cat:26} {tl.n:5d} {tl.candidates:11d} {tl.hits:5d} {max(tl.dist):5d} "
                  f"{np.nanmedian(w):9.2f} {np.nanmin(w):6.2f} {np.nanmax(w):6.2f}")
            tot, hits = tot + tl.n, hits + tl.hits
        return tot, hits

    print(f"near-dup settings: max_hamming={nd.max_hamming}, {nd.verify_params()}")
    n_neg, fh = show("Different documents (must never hit):", neg)
    n_pos, th = show("Same page re-encoded / rescaled (should hit):", pos)
    print(f"\nfalse-hit rate: {fh}/{n_neg} = {fh / n_neg:.4f}")
    print(f"true-hit rate:  {th}/{n_pos} = {th / n_pos:.4f}")
    print(f"({time.time() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "false_hits": fh, "different_pairs": n_neg, "true_hits": th, "same_pairs": n_pos,
            "negatives": {k: vars(x) for k, x in neg.items()}, "positives": {k: vars(x) for k, x in pos.items()},
        }, indent=1))


if __name__ == "__main__":
    main()
