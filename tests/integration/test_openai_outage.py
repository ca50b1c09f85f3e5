"""The ``openai`` engine's model server goes down while the pipeline runs.

Infer runs its ``openai`` engine against a small OpenAI-compatible OCR server on loopback
(stdlib, a thread of this process) that is stopped after start-up and started again on the same
port. While it is down, a request must not become an ``engine_error`` result: the engine raises
``EngineUnavailable`` (retriable), the infer runner backs off and retries the batch without
committing, and infer's ``/readyz`` says not ready. Once the server is back the same request
ends ``ok`` with the server's text. Everything else (Kafka, Redis, MariaDB, S3, the four stage
processes) is the real stack.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import text_image
from tests.stack import LoopbackOcrServer, Pipeline, metric_value, namespaced_pipeline


@pytest.fixture(scope="module")
def ocr_server():
    srv = LoopbackOcrServer("BACK ONLINE 4242")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def outage_pipeline(stack_env, ocr_server, tmp_path_factory):
    extra = {
        "OCRSTREAM_ENGINE_KIND": "openai",
        "OCRSTREAM_OPENAI_BASE_URL": ocr_server.url,
        "OCRSTREAM_OPENAI_RETRIES": "2",
        "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60",
        "OCRSTREAM_TELEMETRY__PROBE_INTERVAL_S": "1",
        "OCRSTREAM_RETRY_MAX_BACKOFF_S": "1",
    }
    with namespaced_pipeline(tmp_path_factory.mktemp("openai-outage-logs"), extra) as p:
        yield p


def readyz(p: Pipeline, name: str) -> tuple[int, str]:
    """Status and body of ``/readyz`` of the (one) live process of stage ``name``."""
    [st] = [s for s in p.stages[name] if s.proc.poll() is None]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{st.port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def until(cond, what: str, timeout: float = 120) -> None:
    """Poll ``cond()`` until true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def engine_retries(p: Pipeline) -> float:
    return metric_value(p.metrics("infer"), "ocrstream_dependency_retries_total", stage="infer",
                        error="EngineUnavailable")


async def test_server_down_mid_run_retries_the_batch_and_ends_ok(outage_pipeline, ocr_server):
    p = outage_pipeline
    await until(lambda: readyz(p, "infer")[0] == 200, "infer ready")  # a probe slower than 1 s reads as down
    ocr_server.stop()
    # the engine's health probe notices the outage between batches
    await until(lambda: readyz(p, "infer") == (503, "not ready: engine\n"), "infer not ready")
    posts, retries = ocr_server.posts, engine_retries(p)
    run = asyncio.create_task(p.run([(text_image(["BACK ONLINE 4242"]), "outage.png")], timeout=300))
    # the batch fails as a whole, retriable: the runner backs off and runs it again (no result)
    await until(lambda: engine_retries(p) >= retries + 2, "the infer runner to retry the batch")
    assert not run.done() and readyz(p, "infer")[0] == 503
    ocr_server.start()
    [doc] = await run
    assert doc.status == "ok" and doc.error is None, doc.error
    assert doc.text == "BACK ONLINE 4242" and [line.text for line in doc.lines] == ["BACK ONLINE 4242"]
    assert doc.warnings == []
    assert ocr_server.posts == posts + 1  # one successful inference, nothing answered while down
    await until(lambda: readyz(p, "infer")[0] == 200, "infer ready again")
