"""bench/gpu/throughput.py's harness (InferHandler.handle over in-memory records) with its fake
engine: the GPU check's plumbing, runnable without vLLM or a GPU."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from bench.gpu import throughput


async def test_fake_engine_run_goes_through_the_infer_handler(capsys, monkeypatch):
    calls = []
    real = throughput.fake_engine_class()

    class Counting(real):
        async def ocr(self, images, timeout_s):
            calls.append([img.shape for img in images])
            return await super().ocr(images, timeout_s)

    monkeypatch.setattr(throughput, "fake_engine_class", lambda: Counting)
    args = SimpleNamespace(fake_engine=True, batches=[1, 4], min_images=4, timeout=30.0, model=None)
    assert await throughput.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["engine"] == "fake" and set(result["images_per_s"]) == {"b1", "b4"}
    assert set(result["ratios"]) == {"b4/b1"}
    # one engine call per micro-batch, each page decoded from PNG at full size (896x1152)
    sizes = [len(c) for c in calls]
    assert sizes == [1] * 5 + [4] * 3  # b1: warm-up + 4 timed; b4: warm-up + 8 images (at least 2 batches)
    assert all(shape == (1152, 896, 3) for c in calls for shape in c)
    assert "max_batch   4: 8 requests through InferHandler.handle" in out and "errors 0" in out


def test_missing_lists_pinned_distributions(monkeypatch):
    from bench.gpu import missing

    monkeypatch.setitem(sys.modules, "vllm", None)
    gone = missing.missing({"vllm": "vllm", "json": "json", "aiokafka": "aiokafka"})
    assert gone[0] == "vllm==0.26.0"
    assert "aiokafka==0.12.0" not in gone  # installed here


def _pins(lines):
    return {n.lower(): v for n, v in (ln.split("==", 1) for ln in lines if "==" in ln and not ln.startswith("#"))}


def test_bundle_requirements_agree_with_pyproject():
    """The offline GPU bundle carries the same versions the project pins (one version of each)."""
    from bench.gpu import missing

    root = missing.ROOT
    bundle = _pins((root / "bench/gpu/bundle-requirements.txt").read_text().split())
    project = {k: v.split("==", 1)[1] for k, v in missing.pins().items()}
    shared = sorted(set(bundle) & set(project))
    assert {"aiokafka", "boto3", "orjson", "pydantic", "pydantic-settings", "fastapi"} <= set(shared)
    assert {n: bundle[n] for n in shared} == {n: project[n] for n in shared}
    assert "vllm" not in bundle and "torch" not in bundle  # vllm comes trimmed, torch from the image


def _bundle(tmp_path, payload: dict[str, str], parts: int, keep: int):
    """A bundle like bench/gpu/bundle.sh makes: tar.xz of ``payload`` split into ``parts``
    parts, one per folder; only the first ``keep`` folders are written."""
    import hashlib
    import io
    import lzma
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in payload.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = lzma.compress(buf.getvalue())
    sha = hashlib.sha256(blob).hexdigest()
    step = -(-len(blob) // parts)
    root = tmp_path / "bundle"
    for i in range(keep):
        d = root / str(i + 1)
        d.mkdir(parents=True)
        (d / f"site.tar.xz.part{i:02d}").write_bytes(blob[i * step:(i + 1) * step])
        (d / "MANIFEST").write_text(f"parts={parts}\nsha256={sha}\nvllm=vllm==0.26.0\n")
    return root


def _gpu_check(tmp_path, bundle):
    import os
    import subprocess

    from bench.gpu import missing

    env = dict(os.environ, GPU_BUNDLE=str(bundle), GPU_BUNDLE_SITE=str(tmp_path / "site"),
               WHEEL_DIR=str(tmp_path / "no-wheels"), PYTHON=sys.executable, PATH="/usr/bin:/bin")
    return subprocess.run(["bash", str(missing.ROOT / "bench/gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_gpu_check_refuses_an_incomplete_bundle(tmp_path):
    bundle = _bundle(tmp_path, {"vllm/__init__.py": "__version__ = 'test'\n"}, parts=2, keep=1)
    res = _gpu_check(tmp_path, bundle)
    assert res.returncode == 1
    assert "bundle incomplete: 1 of 2 parts" in res.stderr
    assert not (tmp_path / "site").exists()


def test_gpu_check_unpacks_the_bundle_first_on_the_path(tmp_path):
    """Both parts reassembled, checked and unpacked; what the bundle holds is importable (here
    a stand-in ``vllm``), so only what it lacks (torch) is reported missing."""
    bundle = _bundle(tmp_path, {"vllm/__init__.py": "__version__ = 'test'\n"}, parts=2, keep=2)
    res = _gpu_check(tmp_path, bundle)
    assert res.returncode == 1, res.stdout
    assert f"bundle unpacked into {tmp_path / 'site'}" in res.stdout
    assert (tmp_path / "site/vllm/__init__.py").read_text() == "__version__ = 'test'\n"
    missing_line = next(ln for ln in res.stdout.splitlines() if ln.startswith("missing for"))
    assert "torch==2.11.0" in missing_line and "vllm" not in missing_line
