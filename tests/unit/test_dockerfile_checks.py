"""The checks the images run at build time (`python -c "..."` in docker/Dockerfile*) pass here.

No test builds the images (no Docker here): a check that names a moved module would fail only at
`docker build`. Each runs in this environment, which installs the same packages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = [(f.name, code) for f in sorted((REPO / "docker").glob("Dockerfile*"))
          for code in re.findall(r'/opt/venv/bin/python -c "([^"]+)"', f.read_text())]


def test_the_cpu_image_has_build_checks():
    assert any(name == "Dockerfile" and "RAPIDOCR_MODELS" in code for name, code in CHECKS), CHECKS


@pytest.mark.parametrize("name,code", CHECKS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CHECKS)])
def test_a_build_check_passes(name, code):
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{name}: {code}\n{res.stderr[-2000:]}"
