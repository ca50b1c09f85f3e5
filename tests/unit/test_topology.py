"""The topic table (schemas/topics.py TOPOLOGY) against the code: each runner stage's handler
consumes exactly the topics the table says it consumes, each folder under services/ names exactly
the topics the table gives it (as producer or consumer), and docs/architecture.md shows the table."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas.topics import TOPOLOGY, Topics, topology_markdown
from services.dedup.handler import DedupHandler
from services.dedup.settings import DedupSettings
from services.infer.handler import InferHandler
from services.infer.settings import InferSettings
from services.ingest.handler import IngestHandler
from services.ingest.settings import IngestSettings
from services.jobs.handler import JobsHandler
from services.jobs.settings import JobsSettings
from services.sink.handler import SinkHandler
from services.sink.settings import SinkSettings

REPO = Path(__file__).resolve().parents[2]
FIELDS = set(Topics.model_fields)
TOPIC_REF = re.compile(r"\btopics\.([a-z_]+)\b")


def _names(stage: str, role: str) -> set[str]:
    return {u.field for u in TOPOLOGY if stage in getattr(u, role)}


def test_the_table_names_every_topic_once():
    assert sorted(u.field for u in TOPOLOGY) == sorted(Topics.model_fields)


@pytest.mark.parametrize("stage,handler,settings", [
    ("ingest", IngestHandler, IngestSettings), ("dedup", DedupHandler, DedupSettings),
    ("infer", InferHandler, InferSettings), ("sink", SinkHandler, SinkSettings),
    ("jobs", JobsHandler, JobsSettings)])
def test_each_handler_consumes_what_the_table_says(stage, handler, settings):
    s = settings()
    t = s.topics
    consumed = set(handler.consumes(SimpleNamespace(s=s)))  # consumes() reads self.s only
    # a state changelog is read by its owner partition for partition on assignment, not by the group
    assert consumed == {getattr(t, f) for f in _names(stage, "consumers")} - set(t.compacted())


@pytest.mark.parametrize("folder", ["ingest", "dedup", "infer", "sink", "jobs", "webhooks", "api", "cli", "common"])
def test_each_folder_names_the_topics_the_table_gives_it(folder):
    """A stage that starts producing to (or reading) a topic names it in its code: the table must
    say so; a topic the table gives it that its code never names is a stale row."""
    named: set[str] = set()
    for path in (REPO / "services" / folder).rglob("*.py"):
        if path.name == "settings.py":
            continue
        named |= {m for m in TOPIC_REF.findall(path.read_text()) if m in FIELDS}
    expected = _names(folder, "producers") | _names(folder, "consumers")
    assert named == expected, (sorted(named - expected), sorted(expected - named))


def test_docs_architecture_shows_the_table():
    page = (REPO / "docs" / "architecture.md").read_text()
    assert topology_markdown() in page, "paste schemas.topics.topology_markdown() into docs/architecture.md"
