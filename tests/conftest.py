"""Shared fixtures: paths to ../shared, generated text images; the test tiers' markers.

Every test under tests/integration is marked ``integration``, under tests/fault ``fault``, under
tests/helm ``helm``; integration and fault tests are also ``stack`` unless marked ``stackless``.
A ``stack`` test skips with one line when the local stack is not up, and fails instead in CI or
under scripts/test.sh (``tests.stack.strict_run``). tests/unit needs no stack.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
SAMPLES = SHARED / "samples"
CASES = SHARED / "cases"
#: Marker of each test tier, by the folder under tests/ that holds it.
TIERS = {"integration": "integration", "fault": "fault", "helm": "helm"}

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


def solid_image(rgb: tuple[int, int, int], size: tuple[int, int] = (240, 120)) -> bytes:
    """A PNG of one colour (the loopback model servers tell a red one apart: ``tests.stack.is_red_image``)."""
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def manifest() -> list[dict]:
    """``../shared/samples/manifest.json``."""
    return json.loads((SAMPLES / "manifest.json").read_text())


@pytest.fixture(scope="session")
def cases() -> list[dict]:
    """``../shared/cases/cases.json``'s case list."""
    return json.loads((CASES / "cases.json").read_text())["cases"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier (the folder under tests/) and integration/fault tests with ``stack``;
    give every test a node id of its own.

    Schemathesis' cases (``@schema.parametrize()``, one per route) share their function's node id
    under pytest 9.2 although each is named ``test_...[GET /route]``; pytest-xdist schedules by node
    id, so it ran the first route only and dropped the others without a word. Such a case gets its
    name's ``[...]`` in its node id, and a collection that still holds one node id twice is refused.

    Raises:
        pytest.UsageError: two collected tests with one node id.
    """
    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.name.endswith("]") and not item.nodeid.endswith("]"):
            # pytest 9.2's Node.nodeid is str(Node._id), a frozen NodeId: give it the case's params
            item._id = dataclasses.replace(item._id, params=item.name[item.name.index("[") + 1:-1])
    if twice := sorted(n for n, c in Counter(item.nodeid for item in items).items() if c > 1):
        raise pytest.UsageError(f"tests share a node id (pytest-xdist would run one of each): {twice}")
    tests_dir = REPO / "tests"
    for item in items:
        path = Path(item.path).resolve()
        tier = TIERS.get(path.relative_to(tests_dir).parts[0]) if path.is_relative_to(tests_dir) else None
        if tier is None:
            continue
        item.add_marker(tier)
        if tier in ("integration", "fault") and item.get_closest_marker("stackless") is None \
                and item.get_closest_marker("stack") is None:
            item.add_marker("stack")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of a ``stack`` test: skip it (fail it in CI) when the local stack is not up."""
    if item.get_closest_marker("stack") is not None:
        from tests.stack import require_stack

        require_stack()
