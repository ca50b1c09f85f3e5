"""Shared fixtures: paths to ../shared, generated text images."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
SAMPLES = SHARED / "samples"
CASES = SHARED / "cases"

FONT_PATHS = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Bold.ttf",
]


def font(size: int = 40) -> ImageFont.ImageFont:
    """A TrueType font if the machine has one, else Pillow's built-in scalable font."""
    for p in FONT_PATHS:
        if Path(p).exists():
            return ImageFont.truetype(p, size)
    return ImageFont.load_default(size)


def text_image(lines: list[str], size: int = 40, width: int | None = None, fmt: str = "PNG") -> bytes:
    """A white image with ``lines`` printed in black, one per row, encoded as ``fmt``."""
    f = font(size)
    w = width or max(400, max(int(f.getlength(t)) for t in lines) + 80)
    h = 40 + len(lines) * int(size * 1.8)
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    for i, t in enumerate(lines):
        d.text((40, 20 + i * int(size * 1.8)), t, fill="black", font=f)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="session")
def manifest() -> list[dict]:
    """``../shared/samples/manifest.json``."""
    return json.loads((SAMPLES / "manifest.json").read_text())


@pytest.fixture(scope="session")
def cases() -> list[dict]:
    """``../shared/cases/cases.json``'s case list."""
    return json.loads((CASES / "cases.json").read_text())["cases"]
