"""bench/gpu/throughput.py's harness (InferHandler over in-memory records: micro-batches with a
barrier and a window) with its fake engine: the GPU check's plumbing, runnable without vLLM or a GPU."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from bench.gpu import throughput
from services.common import telemetry


async def test_fake_engine_run_goes_through_the_infer_handler(capsys, monkeypatch):
    calls = []  # per engine call: (images' shapes, calls in flight when it started, itself included)
    in_flight = 0
    real = throughput.fake_engine_class()

    class Counting(real):
        async def page(self, image, task, timeout_s, lane="bulk"):
            nonlocal in_flight
            in_flight += 1
            calls.append(([image.shape], in_flight))
            try:
                return await super().page(image, task, timeout_s, lane)
            finally:
                in_flight -= 1

    monkeypatch.setattr(throughput, "fake_engine_class", lambda: Counting)
    made = []  # the run's Telemetry (its metrics registry)

    class Kept(telemetry.Telemetry):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(telemetry, "Telemetry", Kept)
    args = SimpleNamespace(fake_engine=True, batches=[1, 4], windows=[4], min_images=4, timeout=30.0, model=None)
    assert await throughput.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["engine"] == "fake" and set(result["images_per_s"]) == {"b1", "b4", "w4"}
    assert set(result["ratios"]) == {"b4/b1", "w4/b1", "w4/b4"}
    # every page is its own engine call, decoded from PNG at full size (896x1152); b1 reads one
    # at a time, b4 and w4 at most four at once (records load and decode on their own)
    n = 5 + 12 + 12  # b1: warm-up + 4; b4: warm-up (4) + 8; w4: warm-up (4) + 8
    assert len(calls) == n
    assert all(shape == (1152, 896, 3) for shapes, _ in calls for shape in shapes)
    peaks = [peak for _, peak in calls]
    assert max(peaks[:5]) == 1 and 2 <= max(peaks[5:]) <= 4, peaks
    assert "max_batch   4: 8 requests through InferHandler.handle" in out and "errors 0" in out
    assert "window   4: 8 requests through InferHandler.handle_record" in out
    # records are keyed as dedup keys them for this engine: no generation mismatch counted
    [tel] = made
    sample = tel.registry.get_sample_value
    assert sample("ocrstream_requests_total", {"stage": "infer", "status": "ok", "code": ""}) == n  # every page above
    assert sample("ocrstream_cache_total", {"stage": "infer", "outcome": "generation_mismatch", "tier": ""}) is None
    assert "ocrstream_cache" in {m.name for m in tel.registry.collect()}


def test_missing_lists_pinned_distributions(monkeypatch):
    from bench.gpu import missing

    monkeypatch.setitem(sys.modules, "vllm", None)
    gone = missing.missing({"vllm": "vllm", "json": "json", "aiokafka": "aiokafka"})
    assert gone[0] == "vllm==0.26.0"
    assert "aiokafka==0.12.0" not in gone  # installed here


def test_bundle_requirements_agree_with_pyproject():
    """The offline GPU bundle carries the same versions the project pins (one version of each)."""
    from bench.gpu import missing

    pairs = missing.bundle_pins()
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    bundle = dict(pairs)
    project = {k: v.split("==", 1)[1] for k, v in missing.pins().items()}
    shared = sorted(set(bundle) & set(project))
    assert {"aiokafka", "boto3", "orjson", "pydantic", "pydantic-settings", "fastapi"} <= set(shared)
    assert {n: bundle[n] for n in shared} == {n: project[n] for n in shared}
    assert "vllm" not in bundle and "torch" not in bundle  # vllm comes trimmed, torch from the image


def _bundle(root, payload: dict[str, str], parts: int, keep: int):
    """A bundle as bench/gpu/bundle.sh makes it under ``root``: tar.xz of ``payload`` split into
    ``parts`` parts, one per folder, each with a MANIFEST (count, sha256 of the whole and of each
    part); only the first ``keep`` folders are written."""
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
    step = -(-len(blob) // parts)
    chunks = [blob[i * step:(i + 1) * step] for i in range(parts)]
    manifest = f"parts={parts}\nsha256={hashlib.sha256(blob).hexdigest()}\nvllm=vllm==0.26.0\n" + "".join(
        f"part{i:02d}={hashlib.sha256(c).hexdigest()}\n" for i, c in enumerate(chunks))
    for i in range(keep):
        d = root / str(i + 1)
        d.mkdir(parents=True)
        (d / f"site.tar.xz.part{i:02d}").write_bytes(chunks[i])
        (d / "MANIFEST").write_text(manifest)
    return root


STANDIN = {"vllm/__init__.py": "__version__ = 'test'\n"}


def _gpu_check(tmp_path, bundle, site):
    import os
    import subprocess

    from bench.gpu import missing

    env = dict(os.environ, GPU_BUNDLE=str(bundle), GPU_BUNDLE_SITE=str(site), TMPDIR=str(tmp_path), HOME=str(tmp_path),
               WHEEL_DIR=str(tmp_path / "no-wheels"), PYTHON=sys.executable, PATH="/usr/bin:/bin")
    return subprocess.run(["bash", str(missing.ROOT / "bench/gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_gpu_check_refuses_an_incomplete_bundle(tmp_path):
    bundle = _bundle(tmp_path / "bundle", STANDIN, parts=2, keep=1)
    res = _gpu_check(tmp_path, bundle, tmp_path / "site")
    assert res.returncode == 1
    assert "bundle incomplete or mixed: the MANIFEST says 2 parts (part00..part01); found 1" in res.stderr
    assert "missing: site.tar.xz.part01" in res.stderr and "within\nthe machine's idle window" in res.stderr
    assert not (tmp_path / "site").exists()


def test_gpu_check_unpacks_the_bundle_first_on_the_path(tmp_path):
    """Both parts reassembled, checked and unpacked (a folder with a space in its name); what the
    bundle holds is importable (a stand-in ``vllm``; the tree is put on PYTHONPATH), so only what
    it lacks (torch) is missing. A second run reuses the unpacked tree."""
    bundle = _bundle(tmp_path / "my bundle", STANDIN, parts=2, keep=2)
    site = tmp_path / "the site"
    res = _gpu_check(tmp_path, bundle, site)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"bundle unpacked into {site}" in res.stdout
    assert (site / "vllm/__init__.py").read_text() == "__version__ = 'test'\n"
    missing_line = next(ln for ln in res.stdout.splitlines() if ln.startswith("missing for"))
    assert "torch==2.11.0" in missing_line and "vllm" not in missing_line
    assert "missing even with the bundle" in res.stderr
    again = _gpu_check(tmp_path, bundle, site)
    assert "already unpacked in" in again.stdout and "bundle unpacked into" not in again.stdout


def test_gpu_check_names_a_damaged_part_and_keeps_the_old_site(tmp_path):
    bundle = _bundle(tmp_path / "bundle", STANDIN, parts=2, keep=2)
    part = bundle / "2" / "site.tar.xz.part01"
    data = bytearray(part.read_bytes())
    data[0] ^= 0xFF
    part.write_bytes(bytes(data))
    site = tmp_path / "site"
    site.mkdir()
    earlier = "0" * 64 + "\n"  # the stamp of an earlier bundle
    (site / ".ocrstream-gpu-bundle").write_text(earlier)
    res = _gpu_check(tmp_path, bundle, site)
    assert res.returncode == 1
    assert f"bundle part {part} is damaged" in res.stderr
    assert (site / ".ocrstream-gpu-bundle").read_text() == earlier  # nothing replaced
    assert not list(tmp_path.glob("site.unpacking.*"))


def test_gpu_check_never_deletes_a_folder_that_is_not_an_unpacked_bundle(tmp_path):
    bundle = _bundle(tmp_path / "bundle", STANDIN, parts=2, keep=2)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    res = _gpu_check(tmp_path, bundle, precious)
    assert res.returncode == 1 and "is not an unpacked bundle (no .ocrstream-gpu-bundle stamp): not touching it" in res.stderr
    assert (precious / "notes.txt").read_text() == "keep me"
    res = _gpu_check(tmp_path, bundle, tmp_path)  # the folder that holds the bundle
    assert res.returncode == 1 and "holds the bundle itself" in res.stderr
    assert (bundle / "1" / "site.tar.xz.part00").exists()


def test_gpu_check_says_which_folder_holds_which_build(tmp_path):
    a = _bundle(tmp_path / "a", STANDIN, parts=2, keep=2)
    b = _bundle(tmp_path / "b", {"vllm/__init__.py": "__version__ = 'other'\n"}, parts=2, keep=2)
    (a / "2").rename(tmp_path / "a2-old")
    (b / "2").rename(a / "2")
    res = _gpu_check(tmp_path, a, tmp_path / "site")
    assert res.returncode == 1 and "holds parts of different builds of the bundle" in res.stderr
    assert f"{a / '1'}: sha256=" in res.stderr and f"{a / '2'}: sha256=" in res.stderr


# ---------------------------------------------------------------- the per-task run (--tasks)


def test_the_command_line_takes_all_tasks_a_list_or_refuses_an_unknown_one(capsys):
    import pytest

    args = throughput.parse_args(["--fake-engine", "--tasks", "all"])
    assert args.tasks == ["ocr", "doc_parse", "table", "formula", "chart", "extract", "translate"]
    assert args.batches == [1, 16] and args.windows == [256] and args.dialect == "hunyuan"
    assert args.enforce_eager in (True, False)
    assert throughput.parse_args(["--fake-engine"]).tasks == ["ocr"]  # the check as it was
    args = throughput.parse_args(["--fake-engine", "--tasks", " extract, ocr,extract ", "--batches", "1,4"])
    assert args.tasks == ["extract", "ocr"] and args.batches == [1, 4]
    for argv, why in ((["--tasks", "ocr,layout"], "--tasks: unknown task(s) layout; known: all, ocr, doc_parse"),
                      (["--tasks", ","], "--tasks: no task given"),
                      (["--batches", "1,0"], "--batches: positive integers, comma-separated, not '1,0'")):
        with pytest.raises(SystemExit) as exc:
            throughput.parse_args(["--fake-engine", *argv])
        assert exc.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--tasks", "all"])  # no --model and no --fake-engine
    assert "--model is required" in capsys.readouterr().err


def test_the_per_task_report_from_recorded_numbers():
    from bench.gpu.tasks import TaskRun, format_report, result_json, task_params

    runs = [TaskRun("ocr", 1, 24, 0, 0, 8.0, 1536), TaskRun("ocr", 8, 24, 0, 0, 2.0, 1536),
            TaskRun("ocr", 32, 64, 0, 0, 4.0, 4096),
            TaskRun("extract", 1, 0, 24, 0, 12.0, 1536), TaskRun("extract", 8, 0, 23, 1, 3.0, 1472),
            TaskRun("extract", 32, 0, 64, 0, 5.0, None)]
    assert format_report(runs).splitlines() == [
        "task         b1 pages/s    b1 tok/s   b8 pages/s    b8 tok/s  b32 pages/s   b32 tok/s    b32/b1",
        "ocr                3.00       192.0        12.00       768.0        16.00      1024.0     5.33x",
        "extract            2.00       128.0         7.67       490.7        12.80           -     6.40x",
        "  extract b1: 24 unparsable_output, 0 other errors",
        "  extract b8: 23 unparsable_output, 1 other errors",
        "  extract b32: 64 unparsable_output, 0 other errors",
    ]
    assert result_json(runs)["extract"]["b8"] == {"pages_per_s": 7.667, "output_tokens_per_s": 490.667, "ok": 0,
                                                  "unparsable": 23, "errors": 1}
    assert result_json(runs)["extract"]["b32"]["output_tokens_per_s"] is None
    assert task_params("extract").fields == ("invoice number", "date", "total", "seller")
    assert task_params("translate").target_lang == "en" and task_params("table") is None


async def test_fake_engine_per_task_run_sends_each_task_with_its_parameters(capsys, monkeypatch):
    """Each task's records reach the engine as that task (extract with the check's fields); an
    answer the parser refuses counts as answered (unparsable), and tokens are counted per page."""
    from services.infer.engines.base import UnparsableOutput

    seen = []  # per engine call: (task, fields)
    real = throughput.fake_engine_class()

    class Recording(real):
        async def page(self, image, task, timeout_s, lane="bulk"):
            seen.append((task.name, task.params.fields if task.params else None,
                         task.params.target_lang if task.params else None))
            out = await super().page(image, task, timeout_s, lane)
            if task.name == "extract":  # as a random-weight model: no JSON
                raise UnparsableOutput("not JSON", raw="garbage")
            return out

    monkeypatch.setattr(throughput, "fake_engine_class", lambda: Recording)
    args = SimpleNamespace(fake_engine=True, batches=[1, 2], windows=[], min_images=2, timeout=30.0, model=None,
                           tasks=["ocr", "extract", "translate"], dialect="hunyuan")
    assert await throughput.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1].removeprefix("RESULT "))
    assert set(result["images_per_s"]) == {"b1", "b2"} and set(result["ratios"]) == {"b2/b1"}  # ocr, as before
    got = {t: {b: (r["ok"], r["unparsable"], r["errors"]) for b, r in per.items()} for t, per in result["tasks"].items()}
    assert got == {"ocr": {"b1": (2, 0, 0), "b2": (4, 0, 0)}, "extract": {"b1": (0, 2, 0), "b2": (0, 4, 0)},
                   "translate": {"b1": (2, 0, 0), "b2": (4, 0, 0)}}
    for per in result["tasks"].values():  # 64 tokens per page: tokens/s = 64 x pages/s
        for r in per.values():
            assert abs(r["output_tokens_per_s"] - 64 * r["pages_per_s"]) <= 0.01 * r["output_tokens_per_s"]
    # every page its own call (warm-up batch + timed pages, per batch size): 1+2, 2+4 per task
    assert [name for name, *_ in seen] == ["ocr"] * 9 + ["extract"] * 9 + ["translate"] * 9
    assert {f for name, f, _ in seen if name == "extract"} == {("invoice number", "date", "total", "seller")}
    assert {lang for name, _, lang in seen if name == "translate"} == {"en"}
    assert "extract   max_batch   2: 4 requests through InferHandler.handle" in out and "unparsable 4" in out
    assert "per task (pages/s: pages the engine answered" in out
