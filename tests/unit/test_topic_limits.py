"""``topic_message_limits`` with an in-memory admin client (the real broker's half is
tests/integration/test_runner_kafka.py): a topic the broker does not know yet is asked again, one
it never knows or refuses gets the broker default with one warning, and a topic read once keeps its
limit."""

from __future__ import annotations

import logging

import pytest

from services.common import kafka
from services.common.kafka import BROKER_DEFAULT_MESSAGE_BYTES, topic_message_limits
from services.common.settings import KafkaSettings

UNKNOWN, DENIED = 3, 73  # UNKNOWN_TOPIC_OR_PARTITION, TOPIC_AUTHORIZATION_FAILED


class FakeAdmin:
    """Answers DescribeConfigs from ``answers``: per topic, the error code of each successive ask
    (the last repeats); 0 answers ``limit``."""

    def __init__(self, answers: dict[str, list[int]], limit: int = 4096):
        self.answers, self.limit = answers, limit
        self.asked: list[list[str]] = []
        self.closed = False

    async def start(self):
        pass

    async def close(self):
        self.closed = True

    async def describe_configs(self, resources):
        names = [r.name for r in resources]
        self.asked.append(names)
        out = []
        for n in names:
            codes = self.answers[n]
            code = codes.pop(0) if len(codes) > 1 else codes[0]
            entries = [] if code else [("max.message.bytes", str(self.limit), False, False, False, [])]
            out.append((code, "", 2, n, entries))
        return [type("Response", (), {"resources": out})()]


@pytest.fixture
def admin(monkeypatch):
    holder: dict[str, FakeAdmin] = {}

    def use(answers: dict[str, list[int]]) -> FakeAdmin:
        holder["admin"] = FakeAdmin(answers)
        monkeypatch.setattr(kafka, "make_admin", lambda cfg, client_id: holder["admin"])
        return holder["admin"]

    return use


async def test_a_topic_not_known_yet_is_asked_again_until_it_answers(admin, caplog):
    fake = admin({"new": [UNKNOWN, UNKNOWN, 0], "old": [0]})
    with caplog.at_level(logging.WARNING, logger="services.common.kafka"):
        limits = await topic_message_limits(KafkaSettings(), ["new", "old"], unknown_waits_s=(0, 0, 0))
    assert limits == {"new": 4096, "old": 4096}
    assert fake.asked == [["new", "old"], ["new"], ["new"]] and fake.closed
    assert caplog.records == []


async def test_a_topic_never_known_gets_the_default_with_one_warning_and_other_errors_are_not_asked_again(
        admin, caplog):
    fake = admin({"missing": [UNKNOWN], "denied": [DENIED], "ok": [0]})
    with caplog.at_level(logging.WARNING, logger="services.common.kafka"):
        limits = await topic_message_limits(KafkaSettings(), ["missing", "denied", "ok"], unknown_waits_s=(0, 0))
    assert limits == {"missing": BROKER_DEFAULT_MESSAGE_BYTES, "denied": BROKER_DEFAULT_MESSAGE_BYTES, "ok": 4096}
    assert fake.asked == [["missing", "denied", "ok"], ["missing"], ["missing"]]
    assert sorted(r.getMessage().split(" (")[0] for r in caplog.records) == [
        "kafka: cannot read max.message.bytes of topic denied", "kafka: cannot read max.message.bytes of topic missing"]


async def test_with_no_waits_a_topic_is_asked_once(admin):
    fake = admin({"missing": [UNKNOWN]})
    assert await topic_message_limits(KafkaSettings(), ["missing"], unknown_waits_s=()) == {
        "missing": BROKER_DEFAULT_MESSAGE_BYTES}
    assert fake.asked == [["missing"]]
