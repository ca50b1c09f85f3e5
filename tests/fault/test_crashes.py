"""SIGKILL and SIGTERM of each stage mid-run: nothing lost, one final state per request."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request

from aiokafka import TopicPartition

from schemas.events import CompletedEvent, ResultEvent
from services.common.kafka import make_consumer
from services.common.settings import CommonSettings
from tests.documents import drained
from tests.fault.conftest import reads_as, distinct_images
from tests.stack import STAGES, db_rows, metric_value


async def _check(docs, items):
    """Every request completed ok with its own image's text, once in the database, and with one
    final state on ``ocr.completed``: replayed completions are byte-identical to the first."""
    assert len(docs) == len(items)
    for (_, name), doc in zip(items, docs):
        assert doc.status == "ok", (name, doc.error)
        assert reads_as(name, doc.text), (name, doc.text)
    ids = [d.request_id for d in docs]
    marks = ",".join(["%s"] * len(ids))
    rows = db_rows(f"SELECT request_id, status FROM requests WHERE request_id IN ({marks})", *ids)
    assert {r["request_id"]: r["status"] for r in rows} == {i: "ok" for i in ids}
    completions = await _completions(CommonSettings(), set(ids))
    assert set(completions) == set(ids)
    differing = {i: len(set(vals)) for i, vals in completions.items() if len(set(vals)) != 1}
    assert not differing, f"requests with more than one distinct completion: {differing}"


async def test_sigkill_each_stage_mid_run_loses_nothing(fault_pipeline):
    p = fault_pipeline
    items = distinct_images(120, "KILL")
    run = asyncio.create_task(p.run(items, timeout=900))
    for name in STAGES:
        await asyncio.sleep(2.0)
        [st] = [s for s in p.stages[name] if s.proc.poll() is None]
        p.stop(st, sig=signal.SIGKILL)
        await asyncio.sleep(0.5)
        p.start(name)
    await _check(await run, items)


async def test_sigterm_drains_and_exits_within_the_bound(fault_pipeline):
    p = fault_pipeline
    items = distinct_images(80, "TERM")
    run = asyncio.create_task(p.run(items, timeout=900))
    for name in STAGES:
        await asyncio.sleep(1.5)
        [st] = [s for s in p.stages[name] if s.proc.poll() is None]
        t0 = time.monotonic()
        code = p.stop(st, sig=signal.SIGTERM, timeout=60)
        took = time.monotonic() - t0
        assert code == 0, f"{name} exited {code}"
        assert took < 15 + 12, f"{name} took {took:.1f}s to stop (bound 15 s + client close)"
        assert "stopped" in st.log.read_text()
        p.start(name)
    await _check(await run, items)


def _revoked_in_flight(p, st) -> float:
    """Records of revoked partitions that ``st`` held in flight (never committed by it)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{st.port}/metrics", timeout=5) as r:
        return metric_value(r.read().decode(), "ocrstream_revoked_records_total", held="in_flight")


async def _topic_values(s: CommonSettings, topic: str) -> list[bytes]:
    """Every record value on ``topic`` (all partitions, from the beginning up to the current end)."""
    consumer = make_consumer(s.kafka, [], None, "test-rebalance-reader")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, n) for n in consumer.partitions_for_topic(topic) or set()]
        assert tps, f"no partitions known for {topic}"
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        values: list[bytes] = []
        async def behind() -> bool:
            return any([await consumer.position(tp) < end[tp] for tp in tps])

        while await behind():
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                values += [r.value for r in recs]
        return values
    finally:
        await consumer.stop()


async def _completions(s: CommonSettings, ids: set[str]) -> dict[str, list[bytes]]:
    """Every ``ocr.completed`` record value of the requests ``ids`` (replays included), per request id."""
    out: dict[str, list[bytes]] = {}
    for v in await _topic_values(s, s.topics.completed):
        ev = CompletedEvent.model_validate_json(v)
        if ev.request_id in ids:
            out.setdefault(ev.request_id, []).append(v)
    return out


async def _await_log(path, pattern: str, after: int, bound_s: float = 120) -> None:
    """Wait until ``path`` has a line matching ``pattern`` past byte ``after`` (a liveness bound)."""
    for _ in range(int(bound_s / 0.5)):
        if re.search(pattern, path.read_bytes()[after:].decode(errors="replace")):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {path} after {bound_s}s")


async def test_second_infer_joins_and_first_leaves_mid_run(fault_pipeline):
    """A second infer joins while the first has records in flight in its window, then the first
    leaves (SIGTERM).

    At the revocation the first process commits each revoked partition at its watermark (every
    record below it done), with what is done above it and nothing running; its records in flight
    finish and are produced but commit nothing. Whoever owns those partitions next reads what was
    not committed as done; a record in flight that comes back to the first process waits for its
    earlier copy instead of being read twice. Downstream the duplicates collapse: each request has
    exactly one final state (its ``requests`` row) and one distinct completion on
    ``ocr.completed`` (replays are byte-identical, same ``event_id``), with its own image's text.
    """
    p = fault_pipeline
    s = CommonSettings()
    # enough pages that the first infer is still reading when the second has loaded its engine and
    # joined (a minute on 2 busy cores; the fault pipeline reads a one-line image in ~0.2 s of CPU)
    items = distinct_images(400, "REBALANCE")
    [first] = [st for st in p.stages["infer"] if st.proc.poll() is None]
    before = _revoked_in_flight(p, first)
    log_at = first.log.stat().st_size
    run = asyncio.create_task(p.run(items, timeout=900))
    await asyncio.sleep(2.0)
    # joins the group: partitions move while the first has records in flight (in a thread: the run goes on)
    second = await asyncio.to_thread(p.start, "infer")
    await _await_log(first.log, r"revoked", log_at)
    await _await_log(first.log, r"infer: assigned", log_at)
    in_flight_first = _revoked_in_flight(p, first) - before
    # the scenario this test names: the rebalance hit the first process with records in flight
    assert in_flight_first > 0, f"no record in flight at the rebalance; see {first.log}"
    text = first.log.read_bytes()[log_at:].decode(errors="replace")
    revoke = re.compile(r"infer: partitions .* revoked: (\d+) records in flight will not be committed")
    assert (m := revoke.search(text)) and int(m.group(1)) > 0, f"no revocation with records in flight in {first.log}"
    assert await asyncio.to_thread(p.stop, first, signal.SIGTERM, 60) == 0  # leaves mid-run
    docs = await run
    await _check(docs, items)
    # the redone records may still be on their way when every request has completed once
    for topic in (s.topics.infer_interactive, s.topics.infer):
        await drained(p.env["OCRSTREAM_INFER_GROUP_ID"], topic, bound_s=180)
    await drained(p.env["OCRSTREAM_SINK_GROUP_ID"], s.topics.results, bound_s=180)
    assert second.proc.poll() is None

    ids = {d.request_id for d in docs}
    results: dict[str, int] = {}
    for v in await _topic_values(s, s.topics.results):
        ev = ResultEvent.model_validate_json(v)
        if ev.request.request_id in ids:
            results[ev.request.request_id] = results.get(ev.request.request_id, 0) + 1
    completions = await _completions(s, ids)
    assert set(results) == ids and set(completions) == ids
    # ... and the duplicates collapse: one distinct completion per request, with its own text
    for (_, name), doc in zip(items, docs):
        [one] = set(completions[doc.request_id])
        done = CompletedEvent.model_validate_json(one)
        assert done.result.status == "ok" and reads_as(name, done.result.text), (name, done.result.text)
