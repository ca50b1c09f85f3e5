"""The CLI's own argument checks (no stack needed: they run before anything connects)."""

from typer.testing import CliRunner

from services.cli.main import app


def test_submit_refuses_a_task_or_source_the_submit_event_cannot_carry(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    runner = CliRunner()
    res = runner.invoke(app, ["submit", "--task", "x" * 65, str(tmp_path)])
    assert res.exit_code == 2 and "--task must be 1 to 64 characters, not 65" in res.output
    res = runner.invoke(app, ["submit", "--source", "", str(tmp_path)])
    assert res.exit_code == 2 and "--source must be 1 to 64 characters, not 0" in res.output


def test_submit_prints_why_task_parameters_are_refused_and_exits_non_zero(tmp_path, monkeypatch):
    monkeypatch.delenv("OCRSTREAM_TASKS", raising=False)
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    runner = CliRunner()
    cases = [(["--task", "extract"], "error: task 'extract' needs fields"),
             (["--task", "extract", "--fields", ",".join(f"f{i}" for i in range(51))],
              "error: fields: at most 50 fields (51 given)"),
             (["--task", "translate", "--to", "xx"], "error: target_lang 'xx' is not one of: en, zh"),
             (["--task", "ocr", "--to", "en"], "error: task 'ocr' takes no target_lang"),
             (["--task", "layout"], "error: task 'layout' is not one of this deployment's tasks: ocr, doc_parse")]
    for args, why in cases:
        res = runner.invoke(app, ["submit", *args, str(tmp_path)])
        assert res.exit_code == 2 and why in " ".join(res.output.split()), (args, res.output)


def test_a_folder_gives_every_regular_file_whatever_its_name(tmp_path):
    from services.cli.client import collect_files

    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    names = ["a.png", "photo.HEIC", "noextension", "notes.txt", "sub/scan.tif"]
    for n in names:
        (folder / n).write_bytes(b"x")
    (folder / ".DS_Store").write_bytes(b"x")
    (folder / ".hidden" / "b.png").write_bytes(b"x")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "c.png").write_bytes(b"x")
    (folder / "link.png").symlink_to(outside / "c.png")  # a link to a file: followed
    (folder / "linked_dir").symlink_to(outside)  # a link to a folder: not entered
    (folder / "broken.png").symlink_to(tmp_path / "missing.png")
    got = collect_files([folder])
    assert got == sorted(folder / n for n in names + ["link.png"])
    # files named directly are taken as they are, after the folder's
    assert collect_files([folder / "sub", folder / ".DS_Store"]) == [folder / "sub/scan.tif", folder / ".DS_Store"]


def test_a_partial_document_shows_its_failed_pages_and_an_error_its_code():
    from schemas.errors import ErrorCode
    from schemas.events import ErrorInfo, ResultDocument
    from services.cli.main import failure_lines

    doc = ResultDocument(request_id="d" * 32, status="partial", page_count=7, failed_pages=[2, 5])
    assert doc.error is None  # what made `submit` stop with AttributeError before
    assert failure_lines("== a.pdf  [partial]  " + "d" * 32, doc) == (
        "== a.pdf  [partial]  " + "d" * 32 + "\n   pages 2, 5 of 7 failed (ocrstream status " + "d" * 32 + ")")
    bad = ResultDocument(request_id="e" * 32, status="error",
                         error=ErrorInfo(code=ErrorCode.CORRUPT_IMAGE, message="cannot decode\x1b[2J"))
    assert failure_lines("== b.png  [error]  " + "e" * 32, bad) == (
        "== b.png  [error]  " + "e" * 32 + "\n   error corrupt_image: cannot decode␛[2J")


def test_init_says_which_generation_is_read_and_how_to_purge_the_old_engines():
    """A user with a warm cache from the engine before (PP-OCRv4) upgrades: ``init`` names the new
    generation, and the old one with the ``cache purge`` that frees it; a generation of the same
    revision (only the preprocessing changed) is purged by id, never by ``--model`` (that would
    take the current one too); a task's request options are not an old generation."""
    from schemas.keys import CacheGeneration
    from services.cli.main import generation_report

    new = [CacheGeneration(engine="rapidocr", model="PP-OCRv6-small", model_revision="rapidocr-3.10.0", task=t,
                           preprocess_version=3) for t in ("ocr", "doc_parse")]
    old = CacheGeneration(engine="rapidocr", model="PP-OCRv4-ch", model_revision="rapidocr-onnxruntime-1.4.4",
                          task="ocr", preprocess_version=2)
    same_rev = new[0].model_copy(update={"preprocess_version": 2})
    option = new[0].model_copy(update={"options": "max_side=1000"})
    assert generation_report(new, {new[0].gen_id: new[0]}) == [
        f"cache: results of rapidocr PP-OCRv6-small rapidocr-3.10.0 (preprocessing 3) under generations "
        f"{', '.join(sorted(g.gen_id for g in new))}"]
    lines = generation_report(new, {g.gen_id: g for g in (*new, old, same_rev, option)})
    assert len(lines) == 3, lines
    assert lines[1] == ("cache: 1 generation of rapidocr PP-OCRv4-ch rapidocr-onnxruntime-1.4.4 (preprocessing 2) "
                        "still in Redis, never served by these settings: every image is read again on its first "
                        "request; free them with `ocrstream cache purge --model rapidocr-onnxruntime-1.4.4`")
    assert lines[2].startswith("cache: 1 generation of rapidocr PP-OCRv6-small rapidocr-3.10.0 (preprocessing 2)")
    assert lines[2].endswith(f"`ocrstream cache purge --generation {same_rev.gen_id}`")
