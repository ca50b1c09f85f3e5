"""``ocrstream status`` on the real stack: a result as a person reads it and as one line of JSON,
and the exit code of each state: 0 ok, 1 error, 2 unknown, 3 pending, 4 a store did not answer."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid

import orjson

from schemas.events import RequestEvent, ResultDocument, now_ms
from schemas.jobs import JobEvent
from services.cli.report import STAGES
from services.common.documents import state as documents
from services.common.cache.entries import ResultCache
from services.common.requests.claims import RequestClaim, claim
from services.common.db import Database
from services.common.jobs.store import JobStore
from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.documents import make_pdf, page_image
from tests.stack import REPO, db_rows, free_port


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 360) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def submitted(out: str, name: str, status: str) -> str:
    """The request id on ``submit``'s result line of ``name`` (``== name  [status]  ID  ...``)."""
    [rid] = [m.group(1) for ln in out.splitlines()
             if (m := re.match(rf"== {re.escape(name)}  \[{status}(?: cache hit)?\]  (\S+)", ln))]
    return rid


def timings(doc: ResultDocument) -> str:
    t = doc.timings_ms
    keys = [k for k in STAGES if k in t] + sorted(k for k in t if k not in STAGES and k != "total")
    return f"timings:  {t['total']:.0f} ms in all: " + ", ".join(f"{k} {t[k]:.0f}" for k in keys)


def json_of(rid: str) -> tuple[ResultDocument, dict]:
    """The document ``status --json`` prints (checked to be one line equal to the stored row)."""
    res = cli("status", rid, "--json")
    assert res.returncode in (0, 1) and res.stdout.endswith("}\n") and res.stdout.count("\n") == 1, res
    [row] = db_rows("SELECT document_json FROM requests WHERE request_id = %s", rid)
    assert json.loads(res.stdout) == json.loads(row["document_json"])
    return ResultDocument.model_validate_json(res.stdout), json.loads(res.stdout)


def test_an_ok_result_reads_as_labelled_lines_then_its_text_and_json_is_one_line(pipeline, tmp_path):
    path = tmp_path / "status-card.png"
    path.write_bytes(text_image(["STATUS CARD 17", "SECOND ROW 42"]))
    sub = cli("submit", str(path), "--timeout", "300")
    assert sub.returncode == 0, sub.stdout + sub.stderr
    rid = submitted(sub.stdout, "status-card.png", "ok")
    doc, raw = json_of(rid)
    assert raw["request_id"] == rid and len(raw["lines"]) == 2 and raw["lines"][0]["box"]  # the whole document
    res = cli("status", rid)
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout.splitlines() == [
        f"request:  {rid}", "file:     status-card.png", "status:   ok", "task:     ocr", "lines:    2", timings(doc),
        "", "STATUS CARD 17", "SECOND ROW 42"]


def test_an_error_shows_its_code_and_message_and_exits_1(pipeline, tmp_path):
    path = tmp_path / "status-notes.txt"
    path.write_bytes(b"plain words, no image\n")
    sub = cli("submit", str(path), "--timeout", "300")
    assert sub.returncode == 1, sub.stdout + sub.stderr
    rid = submitted(sub.stdout, "status-notes.txt", "error")
    doc, _ = json_of(rid)
    assert doc.error.code.value == "unsupported_format"
    res = cli("status", rid)
    assert (res.returncode, res.stderr) == (1, "")
    assert res.stdout.splitlines() == [
        f"request:  {rid}", "file:     status-notes.txt", "status:   error",
        f"error:    unsupported_format: {doc.error.message}", "task:     ocr", timings(doc)]


def test_a_document_shows_its_pages_and_a_page_its_document(pipeline, tmp_path):
    path = tmp_path / "status-doc.pdf"
    path.write_bytes(make_pdf([page_image("STATUS PAGE 01"), page_image("STATUS PAGE 02")]))
    sub = cli("submit", str(path), "--timeout", "300")
    assert sub.returncode == 0, sub.stdout + sub.stderr
    rid = submitted(sub.stdout, "status-doc.pdf", "ok")
    doc, _ = json_of(rid)
    res = cli("status", rid)
    assert res.returncode == 0
    assert res.stderr.splitlines() == [f"{rid}: 2/2 pages final (0 failed); ok, {doc.result_uri}"]
    assert res.stdout.splitlines() == [
        f"request:  {rid}", "file:     status-doc.pdf", "status:   ok", "task:     ocr", "pages:    2", "lines:    2",
        timings(doc), "", "STATUS PAGE 01", "", "STATUS PAGE 02"]
    page = cli("status", f"{rid}:p2")
    assert (page.returncode, page.stderr) == (0, "")
    lines = page.stdout.splitlines()
    assert lines[0] == f"request:  {rid}:p2"
    assert f"document: page 2 of 2 of {rid} (ocrstream status {rid})" in lines
    assert lines[-2:] == ["", "STATUS PAGE 02"]


async def _accept_without_finishing(s: CommonSettings, claimed: str, marked: str, doc_id: str, job_id: str) -> None:
    """What the doors write when they accept an id, with no stage to finish it: ingest's claim of a
    chosen id, the HTTP door's mark in Redis, ingest's registration of a split document; and the
    jobs stage's row of a created job."""
    db = Database(s.mysql, pool_size=1)
    await claim(db, RequestClaim(request_id=claimed, content_sha256="ab" * 32, task="ocr", door="kafka",
                                 origin=f"status-test/0/{now_ms()}"))
    cache = ResultCache(s.redis)
    try:
        await cache.mark_accepted(marked, orjson.dumps({"key": None, "sha": "cd" * 32}), 600)
    finally:
        await cache.close()
    await documents.register(db, RequestEvent(request_id=doc_id, content_sha256="ef" * 32), 3, now_ms())
    await JobStore(db).record([JobEvent(action="create", job_id=job_id, name="status-test")], [])


def test_pending_unknown_and_a_silent_store_each_have_their_exit_code(stack_env):
    tag = uuid.uuid4().hex
    claimed, marked, doc_id, job_id, typo = (f"status-claimed-{tag}", f"status-marked-{tag}", f"status-doc-{tag}",
                                              uuid.uuid4().hex, f"status-typo-{tag}")
    asyncio.run(_accept_without_finishing(CommonSettings(), claimed, marked, doc_id, job_id))

    def ran(rid: str, *more: str, env: dict[str, str] | None = None) -> tuple[int, str, list[str]]:
        res = cli("status", rid, *more, env=env, timeout=60)
        return res.returncode, res.stdout, res.stderr.splitlines()

    for rid in (claimed, marked):
        assert ran(rid) == (3, "", [f"{rid}: pending: accepted, not final yet"])
        assert ran(rid, "--json") == (3, "", [f"{rid}: pending: accepted, not final yet"])
    assert ran(doc_id) == (3, "", [f"{doc_id}: 0/3 pages final (0 failed); assembled when all are final",
                                   f"{doc_id}: pending: accepted, not final yet"])
    assert ran(f"{doc_id}:p3") == (3, "", [
        f"{doc_id}:p3: pending: page 3 of the document {doc_id}, not final yet (ocrstream status {doc_id})"])
    unknown = ("none was accepted under this id (a request sent to ocr.submit is known once ingest has read it)")
    assert ran(f"{doc_id}:p4") == (2, "", [f"error: no request '{doc_id}:p4': {unknown}"])
    assert ran(typo) == (2, "", [f"error: no request '{typo}': {unknown}"])
    assert ran(job_id) == (2, "", [f"error: no request '{job_id}': it is a job's id (ocrstream job status {job_id})"])
    # Redis silent: an id MariaDB knows is still pending; one it does not cannot be told
    no_redis = {"OCRSTREAM_REDIS__URL": f"redis://127.0.0.1:{free_port()}/0"}
    assert ran(claimed, env=no_redis)[:2] == (3, "")
    code, out, err = ran(typo, env=no_redis)
    assert (code, out, len(err)) == (4, "", 1)
    assert err[0].startswith(f"error: the state of '{typo}' cannot be told: it has no final state, and Redis "
                             "(OCRSTREAM_REDIS__URL), which holds the HTTP door's accepted ids, did not answer: "
                             "redis get: ")
    # MariaDB silent: nothing can be told
    code, out, err = ran(claimed, env={"OCRSTREAM_MYSQL__PORT": str(free_port())})
    assert (code, out, len(err)) == (4, "", 1)
    assert err[0].startswith(f"error: the state of '{claimed}' cannot be told: MariaDB (OCRSTREAM_MYSQL__HOST, "
                             "OCRSTREAM_MYSQL__PORT) did not answer: (2003, ")
