"""The spaces a recogniser drops inside a segment, and what the rules of ``restore_spaces`` put back.

For every sample of ``../shared/samples`` the engine's own reader (``--model``, tiled as infer
tiles) gives segments with a box per character; each pair of neighbouring characters of a
segment (neither a space nor an ideograph) is aligned to the manifest's true text (case-folded,
whitespace removed: :func:`rapidfuzz.fuzz.partial_ratio_alignment`, then Levenshtein opcodes),
and labelled by whether the truth has a space between them. For each pair the evidence of
:func:`services.infer.engines.rapid.space_evidence` is measured: the distance between the two
centres over the segment's median pitch, and the widest blank run between them over the ink
height. The table says, per rule, how many of the spaces the recogniser dropped come back and
how many go where the truth has none (``docs/lines.md``, "Spaces").

Usage: python -m bench.space_rules [--model PP-OCRv6-small]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from rapidfuzz import fuzz
from rapidfuzz.distance import Levenshtein

from services.common.images import imaging
from services.common.cache.keys import ENGINE_MAX_SIDE, RAPIDOCR_DEFAULT_MODEL
from services.infer.textlines import WIDE_CHARS, WIDE_FACTOR, SpaceRule, _blank_run, _is_cjk
from services.infer.engines import rapid_models
from services.infer.engines.rapid import SPACE_RULES, _grey, space_evidence
from services.infer.tiles import make_tiles

SAMPLES = Path(__file__).resolve().parent.parent.parent / "shared" / "samples"


@dataclass(frozen=True)
class Pair:
    """Two neighbouring characters of one segment: ``pitch`` (their centres' distance over the
    segment's median pitch), ``blank`` (widest blank run between them over the ink height),
    ``wide`` (either is a wide letter), ``kept`` (the recogniser put a space), ``truth`` (the
    true text has one)."""

    pitch: float
    blank: float
    wide: bool
    kept: bool
    truth: bool


def _stripped(text: str) -> tuple[str, list[bool]]:
    """``text`` lower-cased without whitespace, and per kept character whether whitespace preceded it."""
    out, before, gap = [], [], False
    for ch in text.lower():
        if ch.isspace():
            gap = True
            continue
        out.append(ch)
        before.append(gap)
        gap = False
    return "".join(out), before


def pairs_of(text: str, centres: list[float], ink: list[bool], ink_height: float, truth: tuple[str, list[bool]]
             ) -> list[Pair]:
    """The labelled character pairs of one segment (none when it does not align with the truth)."""
    seg, seg_gap = _stripped(text)
    tru, tru_gap = truth
    if len(seg) < 4 or len(seg) != len([c for c in text if not c.isspace()]):
        return []
    al = fuzz.partial_ratio_alignment(seg, tru)
    if al is None or al.score < 70:
        return []
    lo, hi = max(0, al.dest_start - 5), min(len(tru), al.dest_end + 5)
    where: dict[int, int] = {}
    for tag, a0, a1, b0, _ in Levenshtein.opcodes(seg, tru[lo:hi]):
        if tag == "equal":
            where.update({a0 + k: lo + b0 + k for k in range(a1 - a0)})
    solid = [c for ch, c in zip(text, centres) if not ch.isspace()]
    steps = [b - a for a, b in zip(solid, solid[1:])]
    plain = [d for d, g in zip(steps, seg_gap[1:]) if not g and d > 0]
    if len(plain) < 3 or any(d < 0 for d in steps):
        return []
    pitch = statistics.median(plain)
    out = []
    for i, d in enumerate(steps):
        a, b = seg[i], seg[i + 1]
        if _is_cjk(a) or _is_cjk(b) or i not in where or i + 1 not in where or where[i + 1] != where[i] + 1:
            continue
        out.append(Pair(d / pitch, _blank_run(ink, solid[i], solid[i + 1]) / ink_height,
                        a in WIDE_CHARS or b in WIDE_CHARS,
                        seg_gap[i + 1], tru_gap[where[i + 1]]))
    return out


def fires(rule: SpaceRule, p: Pair) -> bool:
    """Whether ``rule`` puts a space in pair ``p`` (as :func:`restore_spaces` decides)."""
    return p.blank >= rule.blank_wide or (p.blank >= rule.blank and p.pitch >= rule.pitch * (WIDE_FACTOR if p.wide else 1.0))


RULES = {
    "pitch >= 1.5 alone": SpaceRule(blank=0.0, pitch=1.5),
    "blank >= 0.25 alone": SpaceRule(blank=0.25, pitch=0.0),
    "blank >= 0.45 alone": SpaceRule(blank=0.45, pitch=0.0),
    "blank >= 0.25 and pitch >= 1.3": SpaceRule(blank=0.25, pitch=1.3),
    "blank >= 0.45, or blank >= 0.25 and pitch >= 1.3 (PP-OCRv4's)": SpaceRule(blank=0.25, pitch=1.3, blank_wide=0.45),
    "blank >= 0.35 and pitch >= 1.3": SpaceRule(blank=0.35, pitch=1.3),
    "blank >= 0.45 and pitch >= 1.3 (PP-OCRv6's)": SpaceRule(blank=0.45, pitch=1.3),
    "blank >= 0.45 and pitch >= 1.6": SpaceRule(blank=0.45, pitch=1.6),
    "blank >= 0.65 alone": SpaceRule(blank=0.65, pitch=0.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=RAPIDOCR_DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    read = rapid_models.load(args.model, threads=args.threads, max_side=ENGINE_MAX_SIDE, det_limit_side_len=736)
    pairs: list[Pair] = []
    for m in json.loads((SAMPLES / "manifest.json").read_text()):
        truth = _stripped("\n".join(m["lines"]))
        page, _ = next(imaging.iter_flattened((SAMPLES / m["file"]).read_bytes(), 100_000_000, 1))
        for tile in make_tiles(page, 3.0, ENGINE_MAX_SIDE, downscale=False):  # as infer hands them to RapidOCR
            grey = _grey(tile.image)
            for row in read(tile.image):
                ev = space_evidence(row, grey)
                if ev is not None:
                    pairs += pairs_of(row.text, *ev, truth)
    truth_spaces = [p for p in pairs if p.truth]
    dropped = [p for p in truth_spaces if not p.kept]
    print(f"{args.model}: {len(pairs)} neighbouring character pairs aligned to the truth; {len(truth_spaces)} have a "
          f"space in the truth, the recogniser kept {len(truth_spaces) - len(dropped)} and dropped {len(dropped)}; "
          f"it put {sum(p.kept and not p.truth for p in pairs)} where the truth has none")
    print(f"\n| rule | dropped spaces put back (of {len(dropped)}) | spaces put where the truth has none |")
    print("|---|---|---|")
    unspaced = [p for p in pairs if not p.kept]
    for name, rule in {**RULES, f"the rule {args.model} uses": SPACE_RULES[args.model]}.items():
        print(f"| {name} | {sum(fires(rule, p) for p in dropped)} | {sum(fires(rule, p) and not p.truth for p in unspaced)} |")


if __name__ == "__main__":
    main()
