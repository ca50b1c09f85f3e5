"""Dedup's changelog topic: restore a partition's state from it, write the state's changes to it.

The topic is compacted (``cleanup.policy=compact``, created by ``ocrstream init``) and has as many
partitions as ``ocr.requests``; partition p holds the state of partition p, written to that
partition explicitly (not by key hash), as Kafka Streams writes a task's changelog. Records are
:mod:`services.dedup.state`'s: small JSON values under ``f|``, ``w|`` and ``s|`` keys, None for a
removed entry (a tombstone, which compaction later drops).
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import TopicPartition

from services.common.errors import OcrstreamError
from services.common.kafka import RenewingProducer, make_consumer
from services.common.settings import KafkaSettings

log = logging.getLogger(__name__)


class ChangelogUnavailable(OcrstreamError):
    """Kafka did not answer a restore within its time budget (the stage retries)."""

    retriable = True


class Changelog:
    """Reads and writes dedup's changelog topic.

    Args:
        cfg: Kafka connection settings.
        topic: The changelog topic (``OCRSTREAM_TOPICS__DEDUP_CHANGELOG``).
        producer: The stage's started producer (``acks=all``).
        restore_timeout_s: Bound on restoring one assignment's partitions, s.
    """

    def __init__(self, cfg: KafkaSettings, topic: str, producer: RenewingProducer, restore_timeout_s: float = 120.0):
        self.cfg = cfg
        self.topic = topic
        self.producer = producer
        self.restore_timeout_s = restore_timeout_s

    async def restore(self, partitions: list[int]) -> dict[int, dict[bytes, bytes]]:
        """Read ``partitions`` of the changelog from their first offset to the end offset they have
        now; the latest value of each key, tombstones applied.

        Returns:
            Partition -> changelog key -> value.

        Raises:
            ChangelogUnavailable: Kafka did not answer within ``restore_timeout_s``.
        """
        out: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}
        if not partitions:
            return out
        consumer = make_consumer(self.cfg, [], None, "ocrstream-dedup-restore")  # no group: assigned by hand
        try:
            async with asyncio.timeout(self.restore_timeout_s):
                await consumer.start()
                tps = [TopicPartition(self.topic, p) for p in partitions]
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                ends = await consumer.end_offsets(tps)
                todo = {tp for tp in tps if ends[tp] > await consumer.position(tp)}
                while todo:
                    got = await consumer.getmany(*todo, timeout_ms=500, max_records=10_000)
                    for tp, recs in got.items():
                        state = out[tp.partition]
                        for r in recs:
                            if r.value is None:
                                state.pop(r.key, None)
                            else:
                                state[r.key] = r.value
                    for tp in list(todo):
                        if await consumer.position(tp) >= ends[tp]:
                            todo.discard(tp)
        except TimeoutError as exc:
            raise ChangelogUnavailable(f"restoring {self.topic} {partitions} took over {self.restore_timeout_s}s") from exc
        finally:
            await consumer.stop()
        return out

    async def write(self, partition: int, records: list[tuple[bytes, bytes | None]]) -> None:
        """Send ``records`` (key, value or None) to ``partition`` in order and wait for every acknowledgement.

        Raises:
            KafkaError: The broker refused or did not acknowledge (the runner retries transient ones).
        """
        if not records:
            return
        futures = [await self.producer.send(self.topic, value, key=key, partition=partition) for key, value in records]
        # every send settles before an error is raised, so none lands after the retry's records
        errors = [r for r in await asyncio.gather(*futures, return_exceptions=True) if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
