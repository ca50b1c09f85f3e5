"""Near-duplicate verification on generated pages: re-encodes and rescales match, one changed digit never does."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from schemas.reading import Line
from services.common.cache.neardup import bands, hamming, phash64, scale_lines, verify
from services.dedup.settings import NearDupSettings
from tests.conftest import text_image

PARAMS = NearDupSettings().verify_params()
LINES = ["INVOICE NO: 40213", "DATE: 2024-03-18", "CUSTOMER: C7731", "PAPER A4   12   4.50   54.00",
         "TONER      3   61.20  183.60", "TOTAL             237.60"]


def page(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def jpeg(img: np.ndarray, quality: int) -> np.ndarray:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=quality)
    return page(buf.getvalue())


def rescaled(img: np.ndarray, s: float, f=Image.Resampling.BICUBIC) -> np.ndarray:
    im = Image.fromarray(img)
    return np.asarray(im.resize((round(im.width * s), round(im.height * s)), f))


@pytest.fixture(scope="module", params=[18, 28])
def invoice(request) -> tuple[int, np.ndarray]:
    """(text size, page) of an invoice-like page."""
    return request.param, page(text_image(LINES, size=request.param, width=900))


def test_bands_find_every_hash_within_seven_bits():
    rng = random.Random(3)
    for _ in range(200):
        h = rng.getrandbits(64)
        other = h
        for bit in rng.sample(range(64), rng.randint(0, 7)):
            other ^= 1 << bit
        assert hamming(h, other) <= 7
        assert set(enumerate(bands(h))) & set(enumerate(bands(other)))
    with pytest.raises(ValueError):
        bands(1, n_bands=7)


@pytest.mark.parametrize("quality", [95, 75, 50, 40])
def test_jpeg_reencode_matches(invoice, quality):
    _, a = invoice
    b = jpeg(a, quality)
    assert hamming(phash64(a), phash64(b)) <= NearDupSettings().max_hamming
    v = verify(a, b, PARAMS)
    assert v.match, v


@pytest.mark.parametrize("scale", [0.8, 0.9, 1.1, 1.25])
def test_small_rescale_matches(invoice, scale):
    _, a = invoice
    b = jpeg(rescaled(a, scale), 85)
    assert hamming(phash64(a), phash64(b)) <= NearDupSettings().max_hamming
    v = verify(a, b, PARAMS)
    assert v.match, v
    assert verify(b, a, PARAMS).match  # symmetric


@pytest.mark.parametrize("old,new", [("40213", "40218"), ("4.50", "4.56"), ("2024-03-18", "2024-08-18"),
                                     ("C7731", "C1731"), ("237.60", "237.80")])
@pytest.mark.parametrize("form", ["png", "jpeg75", "scale0.9"])
def test_same_template_one_digit_changed_never_matches(invoice, old, new, form):
    size, a = invoice
    b = page(text_image([t.replace(old, new) for t in LINES], size=size, width=900))
    b = {"png": b, "jpeg75": jpeg(b, 75), "scale0.9": rescaled(b, 0.9)}[form]
    assert hamming(phash64(a), phash64(b)) <= 8  # the hash alone would call them the same document
    v = verify(a, b, PARAMS)
    assert not v.match and v.reason == "blocks", v


def test_other_shapes_never_match(invoice):
    _, a = invoice
    assert verify(a, a[:, : int(a.shape[1] * 0.9)], PARAMS).reason == "aspect"  # cropped
    assert verify(a, rescaled(a, 0.5), PARAMS).reason == "scale"
    tiny = rescaled(a, 0.25)
    assert verify(tiny, rescaled(tiny, 0.9), PARAMS).reason == "small"
    assert verify(a, a, PARAMS).match and verify(a, a, PARAMS).worst_block == 0


def test_scale_lines_maps_boxes_per_axis():
    line = Line(text="TOTAL 9", box=[[10, 20], [110, 20], [110, 40], [10, 40]], confidence=0.9)
    [out] = scale_lines([line], (200, 100), (100, 150))
    assert out.text == "TOTAL 9" and out.confidence == 0.9
    assert out.box == [[5, 30], [55, 30], [55, 60], [5, 60]]
