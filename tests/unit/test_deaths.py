"""Pure logic of the death ledger (commit metadata) and of the row bound; no broker, no database.

The behaviour against the real broker and real processes is in
tests/integration/test_runner_deaths.py and tests/fault/test_poison_restarts.py.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from schemas.events import ResultDocument
from schemas.reading import Line
from services.common.results.rows import bound_document, cut_utf8
from services.common.deaths import METADATA_MAX_BYTES, DeathLedger, decode, encode
from services.common.kafka import Outgoing
from services.common.records import RecordParser, Record
from services.common.runner import Handler, StageRunner
from services.common.settings import TelemetrySettings
from services.common.telemetry import Telemetry
from tests.unit.test_runner_rebalance import FakeConsumer, P0

TP = TopicPartition("t", 0)


def rec(offset: int, tp: TopicPartition = TP) -> Record:
    return RecordParser({})(ConsumerRecord(topic=tp.topic, partition=tp.partition, offset=offset, timestamp=0,
                                      timestamp_type=0, key=None, value=b"v", checksum=None, serialized_key_size=0,
                                      serialized_value_size=1, headers=()))


def test_metadata_round_trips_as_runs_and_stays_under_its_bound():
    deaths = {10: 1, 11: 1, 12: 1, 13: 2, 20: 1}
    text = encode((10, 13), deaths)
    assert orjson.loads(text) == {"ocrstream": 1, "in_progress": [10, 13], "deaths": [[10, 12, 1], [13, 13, 2], [20, 20, 1]]}
    assert decode(text) == ((10, 13), deaths)
    assert encode(None, {}) == "" and decode("") == (None, {})
    assert decode("some other tool's metadata") == (None, {}) and decode('{"ocrstream": [') == (None, {})
    # alternating counts make one run each: the highest offsets are left out until it fits
    many = {off: 1 + off % 2 for off in range(1000, 3000)}
    text = encode((1000, 1063), many)
    assert len(text) <= METADATA_MAX_BYTES
    in_progress, kept = decode(text)
    assert in_progress == (1000, 1063) and kept and all(many[o] == n for o, n in kept.items())
    assert min(kept) == 1000 and max(kept) < 2999


def ledger_over(committed: dict[TopicPartition, OffsetAndMetadata], poison_after: int = 2) -> DeathLedger:
    async def read(tps):
        return {tp: committed[tp] for tp in tps if tp in committed}

    return DeathLedger("test", poison_after, read)


async def test_a_mark_left_behind_is_one_death_for_each_record_it_names():
    committed = {TP: OffsetAndMetadata(5, encode((5, 8), {5: 1}))}
    ledger = ledger_over(committed)
    await ledger.load({TP})
    assert [ledger.deaths(rec(o)) for o in range(4, 10)] == [0, 2, 1, 1, 1, 0]
    assert ledger.any_suspect([rec(9), rec(6)]) and not ledger.any_suspect([rec(9)])
    # marking one record alone keeps the deaths counted so far in what is committed
    [(tp, om)] = ledger.mark([rec(6)]).items()
    assert tp == TP and om.offset == 6 and decode(om.metadata) == ((6, 6), {5: 2, 6: 1, 7: 1, 8: 1})
    # the commit after it: the next offset, only deaths still ahead
    assert decode(ledger.done({TP: 7})[TP].metadata) == (None, {7: 1, 8: 1})
    ledger.committed({TP: 7})
    assert ledger.snapshot() == {TP: {7: 1, 8: 1}}


async def test_a_revoked_partition_is_committed_back_with_nothing_in_progress():
    ledger = ledger_over({TP: OffsetAndMetadata(3, encode(None, {3: 1}))})
    await ledger.load({TP})
    ledger.mark([rec(3), rec(4), rec(5)])
    [(tp, om)] = ledger.unmark({TP, TopicPartition("t", 1)}).items()  # only the marked one
    assert tp == TP and om.offset == 3 and decode(om.metadata) == (None, {3: 1})
    assert ledger.snapshot() == {}  # forgotten until the next assignment reads it again


async def test_an_unreadable_group_starts_with_no_deaths():
    async def broken(tps):
        raise OSError("coordinator down")

    ledger = DeathLedger("test", 2, broken)
    await asyncio.wait_for(ledger.load({TP}, attempts=2), 5)
    assert ledger.snapshot() == {}
    with pytest.raises(ValueError):
        DeathLedger("test", 0, broken)


class FailsTransiently(Handler):
    """Fails every batch with a retriable-looking error until ``ok_after`` calls; ``deps`` is
    what :meth:`dependencies_ok` answers."""

    def __init__(self, deps: bool | None, ok_after: int):
        self.deps, self.ok_after, self.calls, self.poisoned = deps, ok_after, 0, []

    async def handle(self, records):
        self.calls += 1
        if self.calls <= self.ok_after:
            raise ConnectionResetError("connection reset by peer")
        return []

    async def dependencies_ok(self):
        return self.deps

    def poison(self, record, exc, attempts):
        self.poisoned.append((record.offset, type(exc).__name__, attempts))
        return [Outgoing("dlq", None, b"x")]


class NoProducer:
    async def send(self, *a, **k):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def runner_for(handler: Handler) -> StageRunner:
    return StageRunner(stage="test", consumer=FakeConsumer(n=1, partitions=(P0,)), producer=NoProducer(),  # type: ignore[arg-type]
                       handler=handler, telemetry=Telemetry("test", TelemetrySettings()), max_batch=1,
                       max_attempts=3, max_backoff_s=0.01)


@pytest.mark.parametrize("deps", [False, None])
async def test_an_outage_is_retried_for_as_long_as_it_lasts(deps):
    handler = FailsTransiently(deps, ok_after=6)
    runner = runner_for(handler)
    assert await asyncio.wait_for(runner._process([rec(0, P0)]), 10) == []
    assert handler.calls == 7 and handler.poisoned == []


async def test_the_same_failure_while_every_dependency_answers_ends_in_the_dlq():
    handler = FailsTransiently(True, ok_after=100)
    runner = runner_for(handler)
    out = await asyncio.wait_for(runner._process([rec(0, P0)]), 10)
    assert out == [Outgoing("dlq", None, b"x")]
    assert handler.calls == 3 and handler.poisoned == [(0, "ConnectionResetError", 3)]


def test_a_document_over_the_row_bound_keeps_its_summary_and_the_longest_text_that_fits():
    box = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]
    texts = [f'{i:05d} "q" é字\x01 ' + "x" * 60 for i in range(3000)]
    doc = ResultDocument(request_id="r", status="ok", lines=[Line(text=t, box=box, confidence=0.5) for t in texts],
                         text="\n".join(texts), result_uri="s3://b/results/x.json")
    limit = 65_536
    cut, raw = bound_document(doc, limit)
    assert len(raw.encode()) <= limit and ResultDocument.model_validate_json(raw) == cut
    assert cut.lines == [] and cut.lines_omitted == 3000 and cut.text_truncated and doc.text.startswith(cut.text)
    one_more = cut.model_copy(update={"text": doc.text[:len(cut.text) + 1]})
    assert len(one_more.model_dump_json(by_alias=True).encode()) > limit  # the longest prefix that fits
    assert cut.result_uri == doc.result_uri
    # lines out is enough when the text alone fits: the text stays whole
    short = doc.model_copy(update={"text": "short"})
    kept, _ = bound_document(short, limit)
    assert kept.lines_omitted == 3000 and not kept.text_truncated and kept.text == "short"
    # within the bound: the same object
    assert bound_document(kept, limit)[0] is kept
    assert cut_utf8("aé字", 4) == "aé" and cut_utf8("aé字", 6) == "aé字"
