"""``RenewingProducer``'s own logic with an in-memory producer (the real broker's half is
tests/integration/test_producer_renewal.py): one renewal however many sends fail at once, sends
during a renewal go to the fresh producer, a renewal that cannot start leaves the old producer in
place and tries again later, and ``stop()`` closes every producer it ever made."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import OutOfOrderSequenceNumber, ProducerClosed, RequestTimedOutError

from services.common.errors import PRODUCER_STATE_ERRORS, is_transient
from services.common.kafka import RenewingProducer


class FakeProducer:
    """An ``AIOKafkaProducer`` stand-in: ``send`` returns a future the test settles; ``stop``
    acknowledges what is still pending. ``start_error``/``start_hangs`` make ``start`` fail or never
    return; while ``gate`` is clear, ``send`` waits in it (metadata, a full buffer)."""

    def __init__(self, start_error: Exception | None = None, start_hangs: bool = False,
                 gate: asyncio.Event | None = None):
        self.start_error, self.start_hangs, self.gate = start_error, start_hangs, gate
        self.started = self.stopped = False
        self.pending: list[asyncio.Future] = []
        self.sent: list[bytes] = []

    async def start(self):
        if self.start_hangs:
            await asyncio.Event().wait()
        if self.start_error is not None:
            raise self.start_error
        self.started = True

    async def stop(self):
        self.stopped = True
        for f in self.pending:
            if not f.done():
                f.set_result("acked")

    async def send(self, topic, value=None, key=None, partition=None, headers=None):
        if self.gate is not None:
            await self.gate.wait()
        if self.stopped:
            raise ProducerClosed()
        self.sent.append(value)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        return fut

    def refuse_pending(self, exc=OutOfOrderSequenceNumber) -> None:
        for f in self.pending:
            if not f.done():
                f.set_exception(exc())


class Factory:
    """Makes the producers in ``plan`` in turn (plain ones after it), keeping every one made."""

    def __init__(self, *plan: FakeProducer):
        self.plan = list(plan)
        self.made: list[FakeProducer] = []

    def __call__(self) -> FakeProducer:
        p = self.plan.pop(0) if self.plan else FakeProducer()
        self.made.append(p)
        return p


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _started(factory: Factory, **kw) -> RenewingProducer:
    rp = RenewingProducer(factory, "test", **kw)
    await rp.start()
    return rp


async def test_many_sends_refused_at_once_make_one_renewal_and_later_sends_go_to_the_fresh_producer():
    factory = Factory()
    rp = await _started(factory)
    futures = [await rp.send("t", b"m%d" % i) for i in range(50)]
    old = factory.made[0]
    old.refuse_pending()
    await _settle()  # the loop runs the futures' callbacks (a broker's answer arrives through it)
    for f in futures:
        with pytest.raises(OutOfOrderSequenceNumber):
            await f
    await rp.send("t", b"next")  # waits for the renewal
    assert rp.renewals == 1 and len(factory.made) == 2
    assert factory.made[1].sent == [b"next"] and rp.current is factory.made[1]
    await _settle()
    assert old.stopped
    await rp.stop()
    assert all(p.stopped for p in factory.made)


async def test_renewals_are_exported_per_producer_at_scrape_time():
    from prometheus_client import generate_latest

    from services.common.settings import TelemetrySettings
    from services.common.telemetry import Telemetry

    tel = Telemetry("test", TelemetrySettings())
    factory, quiet_factory = Factory(), Factory()
    rp, quiet = await _started(factory), RenewingProducer(quiet_factory, "quiet")
    rp.name = "ocrstream-sink"
    tel.watch_producer(rp)
    tel.watch_producer(quiet)
    fut = await rp.send("t", b"m")
    factory.made[0].refuse_pending()
    await _settle()  # the loop runs the future's callbacks: the renewal starts
    with pytest.raises(OutOfOrderSequenceNumber):
        await fut
    await rp.send("t", b"next")  # waits for the renewal
    assert rp.renewals == 1
    text = generate_latest(tel.registry).decode()
    assert 'ocrstream_producer_renewals_total{producer="ocrstream-sink"} 1.0' in text
    assert 'ocrstream_producer_renewals_total{producer="quiet"} 0.0' in text
    await rp.stop()


async def test_an_error_that_is_not_about_sequence_numbers_renews_nothing():
    factory = Factory()
    rp = await _started(factory)
    fut = await rp.send("t", b"m")
    factory.made[0].refuse_pending(RequestTimedOutError)
    with pytest.raises(RequestTimedOutError):
        await fut
    await _settle()
    assert rp.renewals == 0 and len(factory.made) == 1
    await rp.stop()


async def test_a_refusal_from_a_retired_producer_renews_nothing_more():
    factory = Factory()
    rp = await _started(factory)
    first, second = await rp.send("t", b"a"), await rp.send("t", b"b")
    first.set_exception(OutOfOrderSequenceNumber())
    await rp.send("t", b"c")
    second.set_exception(OutOfOrderSequenceNumber())  # the old producer's, after the swap
    await _settle()
    assert rp.renewals == 1 and len(factory.made) == 2
    await rp.stop()


@pytest.mark.parametrize("failure", ["factory raises", "start raises", "start hangs"])
async def test_a_renewal_that_cannot_start_keeps_the_old_producer_and_the_next_refusal_tries_again(failure):
    plan = {"factory raises": None, "start raises": FakeProducer(start_error=ConnectionError("refused")),
            "start hangs": FakeProducer(start_hangs=True)}[failure]
    made: list[FakeProducer] = []

    def factory():
        if len(made) == 1 and plan is None:
            made.append(None)  # type: ignore[arg-type]
            raise FileNotFoundError("ca.pem")
        p = plan if len(made) == 1 else FakeProducer()
        made.append(p)
        return p

    rp = RenewingProducer(factory, "test", start_timeout_s=0.05)
    await rp.start()
    old = made[0]
    fut = await rp.send("t", b"a")
    fut.set_exception(OutOfOrderSequenceNumber())
    await _settle()
    await rp.send("t", b"b")  # waits for the failed renewal, then goes to the old producer
    assert rp.current is old and rp.renewals == 0 and old.sent == [b"a", b"b"]
    old.refuse_pending()
    await _settle()
    await rp.send("t", b"c")  # the second refusal renews
    assert rp.renewals == 1 and rp.current is made[2] and made[2].sent == [b"c"]
    await rp.stop()
    assert all(p.stopped for p in made if p is not None and p.started)
    if failure != "factory raises":
        assert made[1].stopped  # a half-started producer is closed too


async def test_a_send_waiting_in_the_old_producer_when_it_is_retired_goes_to_the_fresh_one():
    gate = asyncio.Event()
    factory = Factory(FakeProducer(gate=gate))
    rp = await _started(factory)
    gate.set()
    earlier = await rp.send("t", b"earlier")
    gate.clear()
    waiting = asyncio.ensure_future(rp.send("t", b"waiting"))  # blocked inside old.send
    await _settle()
    earlier.set_exception(OutOfOrderSequenceNumber())
    for _ in range(20):
        await _settle()
    assert rp.renewals == 1 and factory.made[0].stopped
    gate.set()
    await waiting
    assert factory.made[1].sent == [b"waiting"]
    await rp.stop()


async def test_stop_cancels_a_renewal_under_way_and_starts_none():
    factory = Factory(FakeProducer(), FakeProducer(start_hangs=True))
    rp = await _started(factory, start_timeout_s=60)
    fut = await rp.send("t", b"a")
    fut.set_exception(OutOfOrderSequenceNumber())
    await _settle()
    assert len(factory.made) == 2  # the renewal's fresh producer is starting (and hangs)
    await asyncio.wait_for(rp.stop(), 5)
    assert factory.made[0].stopped and rp.current is factory.made[0]
    assert factory.made[1].stopped  # the half-started one is closed too
    # a refusal that lands while stopping (the final flush) starts nothing
    factory2 = Factory()
    rp2 = await _started(factory2)
    late = await rp2.send("t", b"late")
    stopping = asyncio.ensure_future(rp2.stop())
    late.set_exception(OutOfOrderSequenceNumber())
    await _settle()
    assert rp2._renewal is None  # none started once stop() began
    await stopping
    assert len(factory2.made) == 1 and rp2.renewals == 0


def test_sequence_state_errors_are_transient_so_the_runner_sends_again():
    for cls in PRODUCER_STATE_ERRORS:
        assert is_transient(cls()), cls
