"""Telemetry: span helpers, trace propagation through Kafka headers, the file exporter, the report."""

from __future__ import annotations

import logging

import orjson
import pytest

from services.cli.report import parse_since, render_table, summarize, write_png
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry, TraceIdLogFilter


def test_none_exporter_has_no_processor_but_ids_propagate():
    tel = Telemetry("test", TelemetrySettings())
    assert tel.provider._active_span_processor._span_processors == ()
    with tel.span("ingest", parent_headers=[]) as root:  # no traceparent: a new trace
        headers = tel.inject([("other", b"x")])
        tid = tel.trace_id()
    assert tid and len(tid) == 32 and tid == tel.trace_id(root)
    assert ("other", b"x") in headers
    [tp] = [v.decode() for k, v in headers if k == "traceparent"]
    assert tel.trace_id_of(tp) == tid
    with tel.span("dedup", parent_headers=headers) as child:  # continued from the header
        assert tel.trace_id() == tid
        # not sampled, so not recorded: a span of its own in the same trace, nothing kept
        assert not child.is_recording() and not root.is_recording()
        assert child.get_span_context().span_id != root.get_span_context().span_id
    with tel.span("batch", root=True, links=tel.link(child)) as batch:
        assert tel.trace_id(batch) != tid
    assert tel.trace_id() is None  # nothing current outside the blocks


def test_produce_span_only_for_traced_messages():
    tel = Telemetry("test", TelemetrySettings())
    sp, headers = tel.produce_span("t", [("k", b"v")])
    assert sp is None and headers == [("k", b"v")]
    with tel.span("stage", parent_headers=[]):
        carried = tel.inject()
    sp, headers = tel.produce_span("t", carried)
    assert sp is not None and headers != carried  # re-injected with the publish span
    assert tel.trace_id_of(dict(headers)["traceparent"].decode()) == tel.trace_id(sp)
    tel.end_produce(sp, RuntimeError("broker down"))


def test_store_call_spans_only_inside_a_trace(tmp_path):
    path = tmp_path / "spans.jsonl"
    tel = Telemetry("test", TelemetrySettings(traces_exporter="file", traces_file=str(path)))
    with tel.store_call("redis", "ping"):
        pass
    with tel.span("sink", parent_headers=[]) as sp:
        with tel.store_call("mysql", "write_requests"):
            pass
    tel.close()  # flushes
    spans = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert sorted(s["name"] for s in spans) == ["mysql.write_requests", "sink"]
    child = next(s for s in spans if s["name"] == "mysql.write_requests")
    assert child["parent_span_id"] == format(sp.get_span_context().span_id, "016x")
    assert child["service"] == "ocrstream-test" and child["kind"] == "CLIENT"
    assert tel.store_seconds.labels("redis", "ping")._sum.get() >= 0


def test_store_call_opens_no_span_under_an_unsampled_parent():
    # traces_exporter=none: nothing is recorded, so a store call skips its child span (CPU only)
    # but still times the call; the trace id seen inside is the request's
    tel = Telemetry("test", TelemetrySettings())
    with tel.span("api.submit", parent_headers=[]) as sp:
        with tel.store_call("redis", "get_and_mark"):
            inside = tel.current_span()
            tid = tel.trace_id()
    assert inside is sp and tid == tel.trace_id(sp)
    assert tel.store_seconds.labels("redis", "get_and_mark")._sum.get() > 0


def test_file_exporter_needs_a_path():
    with pytest.raises(ValueError, match="TRACES_FILE"):
        Telemetry("test", TelemetrySettings(traces_exporter="file"))


def test_log_filter_adds_the_trace_id():
    tel = Telemetry("test", TelemetrySettings())
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    TraceIdLogFilter().filter(rec)
    assert rec.trace == ""
    with tel.span("s", parent_headers=[]):
        TraceIdLogFilter().filter(rec)
        assert rec.trace == f" trace_id={tel.trace_id()}"


def test_parse_since():
    now = 10_000_000_000
    assert parse_since("1h", now) == now - 3_600_000
    assert parse_since("99999999d", now) == 0  # longer than the epoch: everything, not a traceback
    assert parse_since("90s", now) == now - 90_000
    assert parse_since("1970-01-01T00:00:10", now) == 10_000
    assert parse_since("1970-01-01T01:00:10+01:00", now) == 10_000
    with pytest.raises(ValueError):
        parse_since("yesterday", now)


def test_summarize_and_render(tmp_path):
    rows = [
        {"timings_json": orjson.dumps({"queue_ingest": 10, "ingest": 20, "inference": 60, "total": 100}),
         "status": "ok", "cache_hit": 0},
        {"timings_json": orjson.dumps({"queue_ingest": 30, "ingest": 20, "total": 100}), "status": "ok", "cache_hit": 1},
        {"timings_json": None, "status": "error", "cache_hit": 0},  # no timings: skipped
    ]
    rep = summarize(rows)
    assert rep.requests == 2 and rep.cache_hits == 1
    by = {s.name: s for s in rep.stages}
    assert by["queue_ingest"].p50 == 20 and by["queue_ingest"].share == pytest.approx(0.2)
    assert by["inference"].count == 1 and by["inference"].share == pytest.approx(0.3)
    assert rep.unaccounted_share == pytest.approx(0.3)
    assert rep.total.p99 == 100
    assert render_table(rep).row_count == len(rep.stages) + 2
    png = write_png(rep, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
