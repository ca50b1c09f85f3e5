"""`pip install 'ocrstream[gpu]'` has a solution: the base pins and vLLM's own pins agree.

The GPU extra is never installed in CI (no GPU, several GB), so a pin that vLLM refuses would go
unnoticed until someone builds an inference image. vLLM 0.26.0 asks for fastapi < 0.137, torch
2.11.0 exactly and (through mistral-common on Python < 3.13) numpy < 2.4; this test resolves the
whole set, base dependencies and the ``gpu`` extra, for CPython 3.12 on x86-64 Linux against the
package index (uv's resolver; nothing is downloaded but metadata), constrained to the offline
bundle's pins (bench/gpu/bundle-requirements.txt): the bundle must be one solution of that set.
Unconstrained, a transitive dependency that neither vLLM nor we pin (openai, say) moves with the
index, and the test would fail on a day's new release rather than on a disagreement.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import missing

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.stackless  # needs the package index, not the local stack


def test_gpu_extra_resolves_with_the_base_dependencies(tmp_path):
    uv = Path(sys.executable).with_name("uv")
    out = tmp_path / "gpu.txt"
    res = subprocess.run(
        [str(uv), "pip", "compile", "pyproject.toml", "--extra", "gpu", "--python-version", "3.12",
         "--python-platform", "x86_64-manylinux_2_28", "-c", "bench/gpu/bundle-requirements.txt",
         "--no-header", "--quiet", "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    resolved = dict(ln.split("==", 1) for ln in out.read_text().splitlines() if "==" in ln and not ln.startswith(" "))
    assert resolved["vllm"] == "0.26.0" and resolved["torch"] == "2.11.0"
    assert resolved["fastapi"] == "0.136.3" and resolved["numpy"] == "2.3.5"
    # vLLM's sampler imports FlashInfer on CUDA: a real install has it (only the bundle leaves it out,
    # and bench/gpu_check.sh then sets VLLM_USE_FLASHINFER_SAMPLER=0)
    assert resolved["flashinfer-python"] == "0.6.14"
    # the GPU check's offline bundle carries exactly what a `pip install 'ocrstream[gpu]'` gets
    bundle = missing.bundle_pins()
    assert len(bundle) == len({name for name, _ in bundle}) > 40
    assert {name: resolved.get(name) for name, _ in bundle} == dict(bundle)
