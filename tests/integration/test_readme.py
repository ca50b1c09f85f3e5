"""The README's Kafka snippets, run as a new user runs them (``.venv/bin/python FILE`` from the
repository root) against the session's pipeline: the producer's event is read and completed, and
the consumer prints the result's status and text. Only the names are this session's (its topics,
a fresh request id and consumer group); every other line runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from schemas.events import ResultDocument
from services.common.settings import CommonSettings
from tests.conftest import SAMPLES
from tests.stack import REPO, db_rows

pytestmark = pytest.mark.stack


def _snippets() -> list[str]:
    """The README's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def _as_this_session(code: str, rid: str, group: str) -> str:
    topics = CommonSettings().topics
    for name, topic in (('"ocr.submit"', topics.submit), ('"ocr.completed"', topics.completed)):
        code = code.replace(name, f'"{topic}"')
    return code.replace("my-first-receipt", rid).replace("my-downstream-system", group)


def test_the_readme_producer_and_consumer_run_as_written(pipeline, tmp_path):
    producer, consumer = _snippets()
    assert '"ocr.submit"' in producer and '"ocr.completed"' in consumer
    assert "../shared/samples/sroie_007.jpg" in producer and (SAMPLES / "sroie_007.jpg").is_file()
    rid, group = f"readme-{uuid.uuid4().hex[:10]}", f"readme-{uuid.uuid4().hex[:8]}"
    for name, code in (("produce.py", producer), ("consume.py", consumer)):
        (tmp_path / name).write_text(_as_this_session(code, rid, group))
    sent = subprocess.run([sys.executable, tmp_path / "produce.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert sent.returncode == 0, sent.stderr
    read = subprocess.run([sys.executable, tmp_path / "consume.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert read.returncode == 0, read.stderr
    out = read.stdout.splitlines()
    mine = out.index(f"{rid} ok")  # its own completion, among the session's others
    [row] = db_rows("SELECT document_json FROM requests WHERE request_id = %s", rid)
    stored = ResultDocument.model_validate_json(row["document_json"])
    assert stored.status == "ok" and stored.text  # the receipt's text, as the sink stored it
    assert "\n".join(out[mine + 1:]) == stored.text
