"""Tracing, stage timings, metrics, readiness and the report on the real stack.

A pipeline of its own with the ``file`` span exporter: every stage process appends its spans
as JSON lines to one file, so one trace can be followed across the four processes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest
from PIL import Image

from services.cli.report import STAGES as REPORT_STAGES
from tests.conftest import REPO, SAMPLES
from tests.stack import JsonStubHandler, Pipeline, free_port, metric_value, namespaced_pipeline

SOURCE = f"tel-{uuid.uuid4().hex[:8]}"  # unique: the report filters on it
N_SAMPLES = 4
SERVICES = {f"ocrstream-{s}" for s in ("ingest", "dedup", "infer", "sink")}
MISS_KEYS = ("queue_ingest", "ingest", "queue_dedup", "dedup", "queue_infer", "fetch", "decode", "preprocess",
             "inference", "postprocess", "engine_wait", "queue_sink", "write", "total")


@pytest.fixture(scope="module")
def tel_pipeline(stack_env, tmp_path_factory):
    """Own topics and Redis prefix (so every image is a cache miss), spans to a JSON-lines file."""
    tmp = tmp_path_factory.mktemp("telemetry")
    extra = {"OCRSTREAM_TELEMETRY__TRACES_EXPORTER": "file", "OCRSTREAM_TELEMETRY__TRACES_FILE": str(tmp / "spans.jsonl"),
             "OCRSTREAM_TELEMETRY__PROBE_INTERVAL_S": "3"}  # each probe may take 3 s (a loaded machine)
    with namespaced_pipeline(tmp / "logs", extra, partitions=2) as p:
        yield p


@pytest.fixture(scope="module")
def run(tel_pipeline):
    """One run of a few distinct sample images: the result documents, in submission order."""
    files = sorted(p for p in SAMPLES.iterdir() if p.suffix.lower() in (".png", ".jpg"))[:N_SAMPLES]
    items = [(f.read_bytes(), f.name) for f in files]
    t0 = int(time.time() * 1000)
    docs = asyncio.run(tel_pipeline.run(items, timeout=300, source=SOURCE))
    return docs, t0


def _spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        if line.strip():
            out.append(orjson.loads(line))
    return out


def _expected_spans(p: Pipeline) -> set[tuple[str, str]]:
    """(service, span name) pairs every request's trace must hold."""
    t = p.env
    return {("ingest", "ingest"), ("dedup", "dedup"), ("infer", "infer"), ("infer", "infer.load"), ("infer", "infer.engine"),
            ("infer", "s3.get"), ("infer", "decode"), ("sink", "sink"), ("sink", "s3.put"),
            ("sink", "mysql.write_result"), ("sink", "redis.set"),
            ("sink", f"{t['OCRSTREAM_TOPICS__REQUESTS']} publish"),  # the key's settlement, to dedup
            ("ingest", f"{t['OCRSTREAM_TOPICS__REQUESTS']} publish"),
            ("dedup", f"{t['OCRSTREAM_TOPICS__INFER_INTERACTIVE']} publish"),  # single images: the interactive lane
            ("infer", f"{t['OCRSTREAM_TOPICS__RESULTS']} publish"),
            ("sink", f"{t['OCRSTREAM_TOPICS__COMPLETED']} publish")}


def _wait_for_traces(p: Pipeline, trace_ids: set[str], timeout: float = 20) -> list[dict]:
    """Spans, once every trace holds every expected span (each process exports on its own
    0.5 s schedule, and a publish span ends at the broker's acknowledgement, after its stage's
    span), or at the deadline."""
    path = Path(p.env["OCRSTREAM_TELEMETRY__TRACES_FILE"])
    expected = _expected_spans(p)
    deadline = time.time() + timeout
    while True:
        spans = _spans(path)
        names: dict[str, set[tuple[str, str]]] = {}
        for s in spans:
            names.setdefault(s["trace_id"], set()).add((s["service"].removeprefix("ocrstream-"), s["name"]))
        if all(expected <= names.get(t, set()) for t in trace_ids) or time.time() > deadline:
            return spans
        time.sleep(0.3)


def test_one_trace_per_request_across_all_four_services(tel_pipeline, run):
    docs, _ = run
    assert [d.status for d in docs] == ["ok"] * N_SAMPLES, [d.error for d in docs]
    trace_ids = [d.trace_id for d in docs]
    assert all(t and len(t) == 32 and int(t, 16) for t in trace_ids), trace_ids
    assert len(set(trace_ids)) == N_SAMPLES  # one trace per request
    spans = _wait_for_traces(tel_pipeline, set(trace_ids))
    by_id = {s["span_id"]: s for s in spans}
    for doc in docs:
        mine = [s for s in spans if s["trace_id"] == doc.trace_id]
        assert {s["service"] for s in mine} == SERVICES, (doc.request_id, {s["service"] for s in mine})
        names = {(s["service"].removeprefix("ocrstream-"), s["name"]) for s in mine}
        for expected in sorted(_expected_spans(tel_pipeline)):
            assert expected in names, (expected, sorted(names))
        assert any(svc == "ingest" and n.startswith("s3.") for svc, n in names)  # head (+ put if new)
        assert any(svc == "dedup" and n.startswith("redis.") for svc, n in names)
        # one connected tree rooted at ingest: ingest's span is the root, or its parent is the
        # submitter's span (sent when the test process has a tracer configured, not exported to
        # the file); every other span's parent is in the same trace
        ids = {s["span_id"] for s in mine}
        roots = [s for s in mine if s["parent_span_id"] is None or s["parent_span_id"] not in ids]
        assert [r["name"] for r in roots] == ["ingest"], roots
        for s in mine:
            if s["parent_span_id"] in ids:
                assert by_id[s["parent_span_id"]]["trace_id"] == doc.trace_id, s
        # the request's time on the engine is one span, a child of its infer span, naming its lane
        infer_span = next(s for s in mine if s["name"] == "infer")
        [engine] = [s for s in mine if s["name"] == "infer.engine"]
        assert engine["parent_span_id"] == infer_span["span_id"], engine
        assert engine["attributes"]["ocrstream.lane"] == "interactive" and engine["attributes"]["ocrstream.tiles"] == 1
        # the batched MySQL insert links to the request's sink span
        assert any(s["name"] == "sink.write_requests" and any(lk["trace_id"] == doc.trace_id for lk in s["links"])
                   for s in spans)


def test_log_lines_carry_the_trace_id(tel_pipeline, run):
    docs, _ = run
    for stage in ("ingest", "dedup", "infer", "sink"):
        text = "".join(st.log.read_text() for st in tel_pipeline.stages[stage])
        for doc in docs:
            lines = [ln for ln in text.splitlines() if doc.request_id in ln]
            assert lines, (stage, doc.request_id)
            assert any(f"trace_id={doc.trace_id}" in ln for ln in lines), (stage, lines)


def test_stage_timings_present_and_sum_to_the_total(run):
    """Every stage reports its time; the parts add up to the submit-to-completion total.

    The parts are disjoint intervals of a request's life (each queue wait runs from the
    Kafka timestamp of the record to the moment the stage starts on it, and infer's
    ``engine_wait`` is its wait for pixel room and an engine slot), so their sum never exceeds
    the total by more than ms rounding (``total`` is whole ms; 5 hops, 1 ms each). What they
    do not cover is each hand-off: the time from a request's own work ending to its
    message being sent (the rest of its ingest/dedup batch finishing, the produce call) and
    the submitter building its event. Measured: 1-5 ms with batches of a few records; allow
    200 ms plus 5 % of the total (a loaded machine stretches the hand-offs with everything else;
    a missing part fails the key check above, a part measured from the wrong moment this bound).
    """
    docs, _ = run
    for d in docs:
        t = d.timings_ms
        missing = [k for k in MISS_KEYS if k not in t]
        assert not missing, (d.request_id, missing, t)
        assert all(v >= 0 for v in t.values()), t
        for k in ("fetch", "decode", "inference", "write", "total"):
            assert t[k] > 0, (k, t)
        assert t["inference"] < t["total"]
        parts = sum(v for k, v in t.items() if k != "total")
        assert parts <= t["total"] + 5, (parts, t)
        assert t["total"] - parts <= 200 + 0.05 * t["total"], (t["total"] - parts, t)
        assert d.completed_at_ms - d.submitted_at_ms == pytest.approx(t["total"], abs=1)


def test_metrics_count_every_request(tel_pipeline, run):
    docs, _ = run
    n = len(docs)
    env = tel_pipeline.env
    m = {st: tel_pipeline.metrics(st) for st in ("ingest", "dedup", "infer", "sink")}
    # single images: infer reads them on the interactive lane's topic
    inputs = {"ingest": "SUBMIT", "dedup": "REQUESTS", "infer": "INFER_INTERACTIVE", "sink": "RESULTS"}
    for st in m:
        topic = env[f"OCRSTREAM_TOPICS__{inputs[st]}"]
        # dedup also reads, on the same topic, the settlements of the keys it sent to inference
        # (one per computed request)
        extra = sum(not d.cache_hit for d in docs) if st == "dedup" else 0
        assert metric_value(m[st], "ocrstream_messages_in_total", stage=st, topic=topic) == n + extra, st
        assert metric_value(m[st], "ocrstream_messages_in_total", stage=st) == n + extra, st
        if st != "infer":  # the batch runner's stages; infer runs a window (below)
            assert metric_value(m[st], "ocrstream_batch_size_count", stage=st) >= 1
            assert metric_value(m[st], "ocrstream_batch_size_sum", stage=st) == n + extra
            assert metric_value(m[st], "ocrstream_batch_seconds_count", stage=st) >= 1
        assert "ocrstream_consumer_lag{" in m[st], st
        # the gauge is refreshed at most once a second: it may still show the last record in flight
        deadline = time.monotonic() + 10
        while metric_value(m[st], "ocrstream_consumer_lag", stage=st) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            m[st] = tel_pipeline.metrics(st)
        assert metric_value(m[st], "ocrstream_consumer_lag", stage=st) == 0, st
        assert metric_value(m[st], "ocrstream_dependency_up", dependency="kafka") == 1
        assert f'ocrstream_producer_renewals_total{{producer="ocrstream-{st}"}} 0.0' in m[st], st
    assert metric_value(m["ingest"], "ocrstream_messages_out_total", topic=env["OCRSTREAM_TOPICS__REQUESTS"]) == n
    assert metric_value(m["dedup"], "ocrstream_messages_out_total", topic=env["OCRSTREAM_TOPICS__INFER_INTERACTIVE"]) == n
    assert metric_value(m["dedup"], "ocrstream_cache_total", outcome="miss") == n
    assert metric_value(m["dedup"], "ocrstream_cache_total", outcome="hit") == 0
    assert metric_value(m["infer"], "ocrstream_messages_out_total", topic=env["OCRSTREAM_TOPICS__RESULTS"]) == n
    assert metric_value(m["infer"], "ocrstream_engine_images_total") == n
    assert metric_value(m["infer"], "ocrstream_engine_seconds_count") == n
    # the window: its size, every record started on the interactive lane, nothing left in it
    assert metric_value(m["infer"], "ocrstream_window_slots", kind="max_in_flight") == 5  # rapidocr: 2 workers + 2 + 1
    assert metric_value(m["infer"], "ocrstream_window_slots", kind="interactive_reserve") == 1
    assert metric_value(m["infer"], "ocrstream_lane_queue_wait_seconds_count", lane="interactive") == n
    assert metric_value(m["infer"], "ocrstream_lane_queue_wait_seconds_count", lane="bulk") == 0
    assert metric_value(m["infer"], "ocrstream_window_in_flight") == 0
    assert metric_value(m["infer"], "ocrstream_engine_slots", engine="rapidocr") == 2
    assert metric_value(m["infer"], "ocrstream_engine_slots_busy", engine="rapidocr") == 0
    assert metric_value(m["infer"], "ocrstream_requests_total", stage="infer", status="ok") == n
    assert metric_value(m["sink"], "ocrstream_messages_out_total", topic=env["OCRSTREAM_TOPICS__COMPLETED"]) == n
    assert metric_value(m["sink"], "ocrstream_requests_total", stage="sink", status="ok") == n
    assert metric_value(m["sink"], "ocrstream_requests_total", status="error") == 0
    for st in m:
        assert metric_value(m[st], "ocrstream_errors_total") == 0
    # store call latency
    assert metric_value(m["infer"], "ocrstream_store_call_seconds_count", store="s3", op="get") >= n
    assert metric_value(m["sink"], "ocrstream_store_call_seconds_count", store="mysql", op="write_requests") >= 1
    # each distinct image: one Redis lookup, then one HEAD of its result document (the S3 tier)
    assert metric_value(m["dedup"], "ocrstream_store_call_seconds_count", store="redis", op="get") == n
    assert metric_value(m["dedup"], "ocrstream_store_call_seconds_count", store="s3", op="head") == n
    assert metric_value(m["sink"], "ocrstream_messages_out_total", topic=env["OCRSTREAM_TOPICS__REQUESTS"]) == n  # settlements
    for dep in ("s3", "mysql", "redis"):
        assert metric_value(m["sink"], "ocrstream_dependency_up", dependency=dep) == 1, dep


def test_readyz_names_what_it_checks(tel_pipeline):
    for stage, sts in tel_pipeline.stages.items():
        for st in sts:
            with urllib.request.urlopen(f"http://127.0.0.1:{st.port}/readyz", timeout=5) as r:
                assert r.status == 200 and r.read() == b"ready\n", stage


class LoadingOcrServer:
    """An OpenAI-compatible OCR server on loopback that is still starting, as ``vllm serve`` is
    while it loads a model: ``/health`` and ``/v1/models`` answer 503 until ``loaded`` is set;
    then chat completions (the engine's warm-up) are held until ``warm`` is set."""

    def __init__(self):
        self.loaded, self.warm = threading.Event(), threading.Event()
        self.health_calls = self.posts = 0
        srv = self

        class Handler(JsonStubHandler):
            def do_GET(self):
                srv.health_calls += 1
                if not srv.loaded.is_set():
                    return self._send(503, {"error": "loading"})
                self._send(200, {"data": [{"id": "tencent/HunyuanOCR"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                srv.posts += 1
                srv.warm.wait(120)
                self._send(200, {"choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "WARM UP"}}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.loaded.set()
        self.warm.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def _readyz(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _wait(cond, what: str, bound_s: float = 60) -> None:
    """Poll ``cond()``; fail naming ``what`` after ``bound_s`` (a liveness bound)."""
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"never happened in {bound_s}s: {what}"
        time.sleep(0.1)


def test_infer_readyz_is_503_until_its_engine_is_loaded_and_warm(tel_pipeline):
    """One more infer process whose engine is an OCR server still starting: its ``/readyz``
    answers 503 while the server loads the model and while the warm-up image is being read,
    and 200 only once the warm-up answered. It consumes a topic and group of its own, so it
    takes no partitions from the pipeline's infer."""
    srv = LoadingOcrServer()
    env = {**tel_pipeline.env, "OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_OPENAI_BASE_URL": srv.url,
           "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "120",
           "OCRSTREAM_TOPICS__INFER": tel_pipeline.env["OCRSTREAM_TOPICS__INFER"] + "-readyz",
           "OCRSTREAM_INFER_GROUP_ID": tel_pipeline.env["OCRSTREAM_INFER_GROUP_ID"] + "-readyz"}
    # its topic exists (the broker does not create topics on demand): `init` creates the missing ones
    subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, env=dict(os.environ, **env), check=True,
                   capture_output=True, timeout=120)
    (tel_pipeline.logdir / "readyz").mkdir(exist_ok=True)
    probe = Pipeline(env=env, logdir=tel_pipeline.logdir / "readyz")
    st = probe.start("infer", wait_ready=False)
    try:
        # loading: the engine has asked the server twice (it polls every 2 s) and been told 503
        _wait(lambda: srv.health_calls >= 2, "the engine polling the loading server")
        status, body = _readyz(st.port)
        assert status == 503 and body.startswith(b"not ready"), (status, body)
        # warming up: the server is up, the warm-up image is being read
        srv.loaded.set()
        _wait(lambda: srv.posts >= 1, "the engine's warm-up request")
        for _ in range(5):
            status, body = _readyz(st.port)
            assert status == 503 and body.startswith(b"not ready"), (status, body)
            time.sleep(0.2)
        assert st.proc.poll() is None
        srv.warm.set()
        probe.wait_ready(st, timeout=60)
        assert _readyz(st.port) == (200, b"ready\n")
    finally:
        srv.close()
        probe.stop_all()


def test_report_prints_the_table_and_writes_a_png(tel_pipeline, run, tmp_path):
    docs, t0 = run
    png = tmp_path / "report.png"
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t0 / 1000 - 1))
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "report", "--since", since, "--source", SOURCE, "--png", str(png)],
        cwd=REPO, env=dict(os.environ, COLUMNS="160"), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{len(docs)} requests completed since" in out, out
    for name in ("p50", "p95", "p99", "share", "total", *[k for k in REPORT_STAGES if k in docs[0].timings_ms]):
        assert name in out, (name, out)
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size[0] > 0 and img.size[1] > 0
    # a duration window works too and includes the same requests
    proc = subprocess.run([sys.executable, "-m", "services.cli", "report", "--since", "1h", "--source", SOURCE],
                          cwd=REPO, env=dict(os.environ, COLUMNS="160"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"{len(docs)} requests completed" in proc.stdout, proc.stdout
