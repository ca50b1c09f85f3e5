"""SIGKILL of infer with a full window, and a poison page among a full window (docs/delivery.md,
"The window"): every request ends once, the committed offsets never pass a record that was not
done, and only the page that kills the process goes to the DLQ.

Infer runs its ``openai`` engine (4 requests in flight: a window of 4 + 2 + 1 = 7 records)
against a small OpenAI-compatible server on loopback (a thread of this process) that answers
every page after ``DELAY_S`` (so the window stays full, as on a busy GPU) and never answers a
red page: a stand-in for a page that kills or wedges the process reading it, so that only
killing the process ends it. Everything else (Kafka, Redis, MariaDB, S3, the four stage
processes) is the real stack.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from schemas.errors import ErrorCode
from schemas.events import InferEvent, ResultEvent
from services.common.settings import CommonSettings
from tests.fault.conftest import FAULT_ENV
from tests.conftest import solid_image
from tests.stack import LoopbackOcrServer, db_rows, is_red_image, namespaced_pipeline
from tests.topics import committed, dlq_events, topic_records

pytestmark = pytest.mark.stack

ANSWER = "IN A FULL WINDOW 5150"
DELAY_S = 0.4
CONCURRENCY = 4
WINDOW = 7  # 4 slots + 2 decoded ahead + 1 reserved for interactive pages (InferSettings.window)


def whites(n: int, tag: int) -> list[tuple[bytes, str]]:
    """``n`` distinct near-white pages (distinct bytes: distinct content hashes)."""
    return [(solid_image((255, 255, 250 - tag), size=(200 + i, 100 + tag)), f"w{tag}-{i}.png") for i in range(n)]


@pytest.fixture(scope="module")
def slow_server():
    srv = LoopbackOcrServer(ANSWER, hangs_on=is_red_image, delay_s=DELAY_S)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def window_pipeline(slow_server, tmp_path_factory):
    extra = {**FAULT_ENV, "OCRSTREAM_ENGINE_KIND": "openai", "OCRSTREAM_OPENAI_BASE_URL": slow_server.url,
             "OCRSTREAM_OPENAI_READY_TIMEOUT_S": "60", "OCRSTREAM_OPENAI_MAX_CONCURRENCY": str(CONCURRENCY),
             "OCRSTREAM_KAFKA__SESSION_TIMEOUT_MS": "6000"}
    with namespaced_pipeline(tmp_path_factory.mktemp("window-fault-logs"), extra) as p:
        yield p


async def _until(cond, what: str, bound_s: float = 120) -> None:
    for _ in range(int(bound_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def _no_commit_past_an_unfinished_record(group: str) -> None:
    """Every record below each committed offset of ``group`` has its result on ``ocr.results``."""
    s = CommonSettings()
    produced = {ResultEvent.model_validate_json(r.value).request.request_id for r in await topic_records(s.topics.results)}
    for topic in (s.topics.infer_interactive, s.topics.infer):
        marks = await committed(group, topic)
        for r in await topic_records(topic):
            if r.offset < marks[r.partition]:
                rid = InferEvent.model_validate_json(r.value).request.request_id
                assert rid in produced, f"{topic}[{r.partition}] committed at {marks[r.partition]} past {r.offset} " \
                                        f"({rid}), whose result was never produced"


def _one_final_state_each(docs) -> None:
    ids = [d.request_id for d in docs]
    rows = db_rows(f"SELECT request_id, status FROM requests WHERE request_id IN ({','.join(['%s'] * len(ids))})", *ids)
    assert sorted(r["request_id"] for r in rows) == sorted(ids)  # one row each
    assert {r["status"] for r in rows} == {"ok"}


async def test_sigkill_with_a_full_window_commits_nothing_past_an_unfinished_record(window_pipeline, slow_server):
    p = window_pipeline
    items = whites(60, 1)
    posts = slow_server.posts
    run = asyncio.create_task(p.run(items, timeout=600))
    await _until(lambda: slow_server.in_flight >= CONCURRENCY and slow_server.posts - posts >= 12,
                 "a full window on the engine, some pages done")
    [infer] = [st for st in p.stages["infer"] if st.proc.poll() is None]
    assert await asyncio.to_thread(p.stop, infer, signal.SIGKILL) == -signal.SIGKILL
    await _no_commit_past_an_unfinished_record(p.env["OCRSTREAM_INFER_GROUP_ID"])
    await asyncio.to_thread(p.start, "infer")
    docs = await run
    assert [(d.status, d.text) for d in docs] == [("ok", ANSWER)] * len(items)
    _one_final_state_each(docs)
    # each page read once, but those in flight at the kill (a window at most) and those done since
    # the last commit (at most 0.1 s of them) read again
    read = slow_server.posts - posts - 1  # the restarted engine's warm-up
    assert len(items) <= read <= len(items) + 2 * WINDOW, read


async def test_a_poison_page_in_a_full_window_goes_to_the_dlq_alone(window_pipeline, slow_server):
    """The red page wedges the engine: infer is SIGKILLed while it and a full window of other pages
    are in flight, restarted; every record that was in flight is then read alone, so the red page
    wedges it again alone; a second SIGKILL and it goes to the DLQ as ``stage_crash``, unread.
    Every other request ends ok, once.

    The window is made full on purpose, not by timing: the poison goes first and stays on the
    engine, and the server holds every other page it receives until the first kill, so the
    engine's other slots fill with pages of ``others`` however slowly they reach infer."""
    p = window_pipeline
    s = CommonSettings()
    slow_server.holding.clear()
    poison = solid_image((230, 20, 20))
    poison_run = asyncio.create_task(p.run([(poison, "poison.png")], timeout=600))
    assert await asyncio.to_thread(slow_server.holding.wait, 180), "the poison never reached the engine"
    slow_server.holds_on = lambda body: True  # the poison's hangs_on is checked first: it still hangs
    others = [asyncio.create_task(p.run(whites(10, tag), timeout=600)) for tag in (2, 3)]
    await _until(lambda: slow_server.in_flight >= CONCURRENCY, "a full window beside the poison", 180)
    assert slow_server.held == 1
    for death in (1, 2):
        [infer] = [st for st in p.stages["infer"] if st.proc.poll() is None]
        assert await asyncio.to_thread(p.stop, infer, signal.SIGKILL) == -signal.SIGKILL
        if death == 1:  # the held pages are answered to the dead process; later ones after DELAY_S
            slow_server.holds_on = None
            slow_server.let_go()
        await asyncio.to_thread(p.start, "infer")
        if death == 1:  # read again alone (a suspect): it wedges infer again, with nothing else in flight
            await _until(lambda: slow_server.held == 2, "the poison read again", 180)
            await asyncio.sleep(2 * DELAY_S)
            assert slow_server.in_flight == slow_server.held == 2  # the two reads of the poison, nothing else
    [bad] = await poison_run
    assert bad.status == "error" and bad.error.code is ErrorCode.STAGE_CRASH, (bad.status, bad.error)
    assert bad.error.message == "infer: stage_crash: in progress when the infer stage died 2 times"
    good = [d for run in others for d in await run]
    assert [(d.status, d.text) for d in good] == [("ok", ANSWER)] * 20
    _one_final_state_each(good)
    dlq = [ev for ev in await dlq_events() if ev.stage == "infer"]
    assert [(ev.request_id, ev.error_code) for ev in dlq] == [(bad.request_id, ErrorCode.STAGE_CRASH)]
    assert dlq[0].topic == s.topics.infer_interactive and dlq[0].attempts == 2
    assert slow_server.held == 2  # the third infer never sent it to the engine
