"""Property-based tests of the HTTP door with schemathesis, against the running door.

The first test asserts that the spec the running ``api`` fixture serves at ``/openapi.json`` is
the committed ``schemas/openapi.json``; the cases are then generated from that spec (loaded at
collection time: schemathesis' lazy ``from_fixture`` loader breaks on pytest 9.2's node ids) and
sent to the running door. Every route gets its documented examples, schemathesis' coverage
cases (boundary and schema-violating values) and a bounded number of generated cases, each
checked for: no 5xx, a documented status code, a documented content type and a body that
validates against the documented schema for that status.

Bounded so it stays fast: long-polls are capped at 1 s (a generated ``wait`` of hours would only
hold a connection), and generated bodies cannot decode as images, so none of them reaches the
OCR engine (they stop at the header check with 415/422, or earlier with 400/413).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_schema_conformance, status_code_conformance,
)

pytestmark = pytest.mark.stack

SPEC_FILE = Path(__file__).resolve().parents[2] / "schemas" / "openapi.json"
#: Generated cases per route in the fuzzing phase (examples and coverage cases come on top).
MAX_EXAMPLES = 100
#: The longest long-poll a generated GET may ask for, seconds.
WAIT_CAP_S = 1.0
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]

# PDF bodies are bytes like application/octet-stream (schemathesis has no serializer of its own for them)
schemathesis.serializer.alias("application/pdf", "application/octet-stream")
schema = schemathesis.openapi.from_dict(json.loads(SPEC_FILE.read_text()), config=SchemathesisConfig())
schema.config.phases.update(phases=["examples", "coverage", "fuzzing"])
schema.config.generation.update(max_examples=MAX_EXAMPLES, database="none")


def test_served_spec_is_the_committed_one(api):
    served = httpx.get(f"{api.url}/openapi.json", timeout=30)
    assert served.status_code == 200
    assert served.json() == json.loads(SPEC_FILE.read_text()), "run python -m services.ingest.api.openapi"


def _cap_wait(case) -> None:
    """Clamp a numeric ``wait`` to :data:`WAIT_CAP_S`; keep non-numeric values (they must get 400)."""
    if not case.query or "wait" not in case.query:
        return
    try:
        wait = float(case.query["wait"])
    except (TypeError, ValueError):
        return
    if wait == wait and wait > WAIT_CAP_S:  # not NaN, over the cap
        case.query["wait"] = WAIT_CAP_S


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_every_route_conforms_to_its_spec(case, api):
    _cap_wait(case)
    case.call_and_validate(base_url=api.url, checks=CHECKS, timeout=30)
