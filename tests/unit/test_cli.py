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
    monkeypatch.setenv("OCRSTREAM_ENGINE_KIND", "openai")  # an engine that does extract and translate
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
    from schemas.events import ResultDocument
    from schemas.reading import ErrorInfo
    from services.cli.main import failure_lines

    doc = ResultDocument(request_id="d" * 32, status="partial", page_count=7, failed_pages=[2, 5])
    assert doc.error is None  # what made `submit` stop with AttributeError before
    assert failure_lines("== a.pdf  [partial]  " + "d" * 32, doc) == (
        "== a.pdf  [partial]  " + "d" * 32 + "\n   pages 2, 5 of 7 failed (ocrstream status " + "d" * 32 + ")")
    bad = ResultDocument(request_id="e" * 32, status="error",
                         error=ErrorInfo(code=ErrorCode.CORRUPT_IMAGE, message="cannot decode\x1b[2J"))
    assert failure_lines("== b.png  [error]  " + "e" * 32, bad) == (
        "== b.png  [error]  " + "e" * 32 + "\n   error corrupt_image: cannot decode␛[2J")


def test_counts_take_the_singular_for_one_and_the_plural_otherwise():
    from services.common.wording import plural

    assert [plural(n, "request") for n in (0, 1, 2)] == ["0 requests", "1 request", "2 requests"]
    assert [plural(n, "cache entry", "cache entries") for n in (1, 4)] == ["1 cache entry", "4 cache entries"]
    assert [plural(n, "page", number=False) for n in (1, 2)] == ["page", "pages"]


def test_every_cli_line_with_a_count_of_one_says_it_in_the_singular():
    from schemas.events import ResultDocument
    from schemas.jobs import JobProgress
    from services.cli.jobs import progress_line
    from services.cli.main import failure_lines
    from services.cli.report import render_table, summarize
    from services.common.documents.state import Progress

    one = JobProgress(job_id="j", state="completed", total=1, done=1, ok=1, cache_hits=1, pages=1)
    assert progress_line(one) == "completed: 1/1 done, 1 ok, 0 failed, 1 cache hit, 1 page"
    doc = ResultDocument(request_id="d" * 32, status="partial", page_count=7, failed_pages=[3])
    assert failure_lines("== a.pdf  [partial]  " + "d" * 32, doc).splitlines()[1] == (
        "   page 3 of 7 failed (ocrstream status " + "d" * 32 + ")")
    assert Progress("doc-1", 1, 0, 0, None, None).line() == (
        "doc-1: 0/1 page final (0 failed); assembled when all are final")
    rep = summarize([{"timings_json": '{"total": 12.0}', "status": "ok", "cache_hit": 1}], since_ms=0)
    assert render_table(rep).title == ("1 request completed since 1970-01-01 00:00:00 UTC (1 ok, 1 cache hit); "
                                       "times in ms")


BOUNDED = [  # (command line, what the error says): every numeric option of the CLI, refused before it runs
    (["job", "status", "j1", "--interval", "1e308"], "'--interval': 1e308 is not a number from 0.05 to 3,600 s"),
    (["job", "status", "j1", "--interval", "nan"], "'--interval': nan is not a number from 0.05 to 3,600 s"),
    (["job", "status", "j1", "--timeout", "1e400"], "'--timeout': 1e400 is not a number from 1 to 604,800 s"),
    (["job", "status", "j1", "--timeout", "-1"], "'--timeout': -1 is not a number from 1 to 604,800 s"),
    (["submit", "--timeout", "1e400", "."], "'--timeout': 1e400 is not a number from 1 to 604,800 s"),
    (["submit", "--timeout", "0", "."], "'--timeout': 0 is not a number from 1 to 604,800 s"),
    (["run", "--infer", "0"], "'--infer': 0 is not an integer from 1 to 64"),
    (["run", "--infer", "1.5"], "'--infer': 1.5 is not an integer from 1 to 64"),
    (["keys", "create", "--name", "k", "--rate", "inf"],
     "'--rate': inf is not a number from 0 to 1,000,000 requests/s"),
    (["keys", "create", "--name", "k", "--rate", "-0.5"],
     "'--rate': -0.5 is not a number from 0 to 1,000,000 requests/s"),
    (["keys", "create", "--name", "k", "--burst", "99999999999"],
     "'--burst': 99999999999 is not an integer from 1 to 1,000,000 requests"),
    (["keys", "create", "--name", "k", "--quota-per-day", "-1"],
     "'--quota-per-day': -1 is not an integer from 0 to 1,000,000,000 submissions"),
]


def test_every_numeric_option_refuses_values_out_of_its_range_naming_the_range():
    runner = CliRunner()
    for args, why in BOUNDED:
        res = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert res.exit_code == 2, (args, res.output)
        [line] = [ln.strip("│ ") for ln in res.output.splitlines() if "Invalid value" in ln]
        assert line == f"Invalid value for {why}", (args, res.output)


def test_the_numeric_options_keep_values_in_range_and_say_the_range_in_their_help():
    from services.cli.options import parse_bounded

    assert parse_bounded("0.05", float, 0.05, 3600, "0.05 to 3,600 s") == 0.05
    assert parse_bounded("3600", float, 0.05, 3600, "0.05 to 3,600 s") == 3600.0
    assert parse_bounded("64", int, 1, 64, "1 to 64") == 64
    runner = CliRunner()
    res = runner.invoke(app, ["job", "status", "--help"], env={"COLUMNS": "200"})
    assert "How long the live bar waits between two reads of MariaDB, 0.05 to 3,600 s." in res.output
    assert "How long the live bar waits for the job to complete, 1 to 604,800 s." in res.output


def _commands(cmd, path=()):
    """Every command and group of the CLI, with the words that name it (``("job", "status")``)."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_text_is_whole_sentences_and_shown_whole():
    import typer.main

    root = typer.main.get_command(app)
    runner = CliRunner()
    seen = []
    for path, cmd in _commands(root):
        seen.append(" ".join(path))
        paragraphs = cmd.help.split("\n\n")
        for para in paragraphs:  # one line each (rich wraps it), a full stop at the end
            assert "\n" not in para and para.endswith(".") and para[0].isupper(), (path, para)
        assert len(paragraphs[0]) <= 100, (path, paragraphs[0])  # the command list shows it: one short sentence
        for param in cmd.params:
            text = getattr(param, "help", None) or ""
            assert text.endswith(".") and text[0].isupper(), (path, param.name, text)
        for width in ("60", "200"):
            res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": width})
            shown = " ".join(" ".join(ln.strip(" │").split()) for ln in res.output.splitlines())
            assert res.exit_code == 0 and all(" ".join(p.split()) in shown for p in paragraphs), (path, width, shown)
            if path:  # the parent's command list: the first paragraph, whole
                parent = runner.invoke(app, [*path[:-1], "--help"], env={"COLUMNS": width})
                listed = " ".join(" ".join(ln.strip(" │").split()) for ln in parent.output.splitlines())
                assert " ".join(paragraphs[0].split()) in listed, (path, width, listed)
    assert sorted(seen) == ["", "cache", "cache purge", "init", "job", "job report", "job status", "keys",
                            "keys create", "keys list", "keys revoke", "report", "run", "status", "submit"]


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
        f"{new[0].gen_id} (ocr), {new[1].gen_id} (doc_parse), one per task"]
    lines = generation_report(new, {g.gen_id: g for g in (*new, old, same_rev, option)})
    assert len(lines) == 3, lines
    assert lines[1] == ("cache: 1 generation of rapidocr PP-OCRv4-ch rapidocr-onnxruntime-1.4.4 (preprocessing 2) "
                        "still in Redis, never served by these settings: every image is read again on its first "
                        "request; free them with `ocrstream cache purge --model rapidocr-onnxruntime-1.4.4`")
    assert lines[2].startswith("cache: 1 generation of rapidocr PP-OCRv6-small rapidocr-3.10.0 (preprocessing 2)")
    assert lines[2].endswith(f"`ocrstream cache purge --generation {same_rev.gen_id}`")
