"""An idempotent producer whose sequence numbers the broker no longer accepts is renewed, and what
failed is sent again (services/common/kafka.py, ``RenewingProducer``; docs/delivery.md, "Failures").

A broker restart can lose a producer's state (aio-libs/aiokafka#1017); the broker then answers
every later batch of the partition with ``OUT_OF_ORDER_SEQUENCE_NUMBER``. The same answer is made
here on purpose and at once: the producer's next sequence number for the partition is moved past
the one the broker expects (aiokafka's own bookkeeping, the only state a test can reach), and the
real broker refuses the batch.
"""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import OutOfOrderSequenceNumber

from services.common.kafka import Outgoing, RenewingProducer, create_topics, make_producer
from services.common.runner import StageRunner
from services.common.settings import CommonSettings, TelemetrySettings
from services.common.telemetry import Telemetry
from tests.integration.test_runner_kafka import SlowFirstBatch
from tests.topics import topic_records

pytestmark = pytest.mark.stack


def _open_a_sequence_gap(producer: RenewingProducer, tp: TopicPartition) -> None:
    """Move the producer's next sequence number for ``tp`` 5 past what the broker expects."""
    producer.current._txn_manager.increment_sequence_number(tp, 5)


async def _topic(stack_env, name: str) -> str:
    s = CommonSettings()
    topic = f"{stack_env['OCRSTREAM_REDIS__KEY_PREFIX']}.{name}"
    await create_topics(s.kafka.model_copy(update={"partitions": 1}), [topic])
    return topic


async def test_a_sequence_gap_fails_one_send_and_the_next_goes_on_a_fresh_producer(stack_env):
    topic = await _topic(stack_env, "renewal")
    producer = make_producer(CommonSettings().kafka, "test-renewal")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"before", key=b"k")
        first_id = producer.current._txn_manager.producer_id
        _open_a_sequence_gap(producer, TopicPartition(topic, 0))
        with pytest.raises(OutOfOrderSequenceNumber):
            await producer.send_and_wait(topic, b"refused", key=b"k")
        await producer.send_and_wait(topic, b"after", key=b"k")
        await producer.send_and_wait(topic, b"and after", key=b"k")
        assert producer.renewals == 1
        assert producer.current._txn_manager.producer_id != first_id
    finally:
        await producer.stop()
    assert [r.value for r in await topic_records(topic)] == [b"before", b"after", b"and after"]


async def test_the_runner_sends_a_refused_batch_again_and_goes_on(stack_env):
    """Before renewal, the runner tried ``max_attempts`` rounds on the broken producer and the
    stage exited (``runner failed``); now the second round goes on the fresh producer."""
    s = CommonSettings()
    topic, dlq = await _topic(stack_env, "renewal-runner"), await _topic(stack_env, "renewal-dlq")
    producer = make_producer(s.kafka, "test-renewal-runner")
    await producer.start()
    runner = StageRunner(stage="test", consumer=None, producer=producer, handler=SlowFirstBatch(),  # type: ignore[arg-type]
                         telemetry=Telemetry("test", TelemetrySettings()), dlq_topic=dlq, size_limits={})
    try:
        await runner._produce([Outgoing(topic, "k", b"one", [])])
        _open_a_sequence_gap(producer, TopicPartition(topic, 0))
        await runner._produce([Outgoing(topic, "k", b"two", []), Outgoing(topic, "k", b"three", [])])
        await runner._produce([Outgoing(topic, "k", b"four", [])])
        assert producer.renewals == 1
    finally:
        await producer.stop()
    assert [r.value for r in await topic_records(topic)] == [b"one", b"two", b"three", b"four"]
