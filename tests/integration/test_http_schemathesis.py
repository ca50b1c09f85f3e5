"""Property-based tests of the HTTP door with schemathesis, against the running door.

The first test asserts that the spec the running ``api`` fixture serves at ``/openapi.json`` is
the committed ``schemas/openapi.json``; the cases are then generated from that spec (loaded at
collection time: schemathesis' lazy ``from_fixture`` loader breaks on pytest 9.2's node ids) and
sent to the running door. Every route gets its documented examples, schemathesis' coverage
cases (boundary and schema-violating values) and a bounded number of generated cases, each
checked for: no 5xx, a documented status code, a documented content type and a body that
validates against the documented schema for that status.

Bounded so it stays fast: long-polls and event streams are capped at 1 s (a generated ``wait`` or
``timeout`` of hours would only hold a connection; ``GET /v1/events`` without ``timeout`` is given
one, and its generated ids are unknown, so it answers 404 at once anyway; ``GET
/v1/jobs/{job_id}/events`` gets one too: an unknown job is waited for, up to the stream's end), and generated bodies cannot decode as images, so none of them reaches the
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
#: The longest long-poll or event stream a generated GET may ask for, seconds.
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
    assert served.json() == json.loads(SPEC_FILE.read_text()), "run python -m services.api.openapi"


def _cap_wait(case) -> None:
    """Clamp a numeric ``wait`` or ``timeout`` to :data:`WAIT_CAP_S` (an event stream without one
    gets it); keep non-numeric values (they must get 400)."""
    streams = ("/v1/events", "/v1/jobs/{job_id}/events")
    if case.path in streams and isinstance(case.query, dict) and "timeout" not in case.query:
        case.query["timeout"] = WAIT_CAP_S
    elif case.path in streams and case.query is None:
        case.query = {"timeout": WAIT_CAP_S}
    for name in ("wait", "timeout"):
        if not case.query or name not in case.query:
            continue
        try:
            value = float(case.query[name])
        except (TypeError, ValueError):
            continue
        if value == value and value > WAIT_CAP_S:  # not NaN, over the cap
            case.query[name] = WAIT_CAP_S


#: Longest query value sent, characters: a generated value of 100 KB makes a request line that the
#: HTTP server (uvicorn's parser, before the app) refuses with its own text/plain 400; the door's
#: own limits on every query field are far below this.
QUERY_VALUE_CAP = 2_000


def _cap_query(case) -> None:
    """Cut every generated query string (or each string of a list), and every generated header
    value, to :data:`QUERY_VALUE_CAP`: a request head over ``http_max_head_bytes`` (16 KiB) is
    refused with 431 by the HTTP protocol before any route (tests/integration/test_http_heads.py)."""
    if isinstance(case.headers, dict):
        for name, value in case.headers.items():
            if isinstance(value, str):
                case.headers[name] = value[:QUERY_VALUE_CAP]
    if not isinstance(case.query, dict):
        return
    for name, value in case.query.items():
        if isinstance(value, str):
            case.query[name] = value[:QUERY_VALUE_CAP]
        elif isinstance(value, list):
            case.query[name] = [v[:QUERY_VALUE_CAP] if isinstance(v, str) else v for v in value]


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_every_route_conforms_to_its_spec(case, api):
    _cap_wait(case)
    _cap_query(case)
    case.call_and_validate(base_url=api.url, checks=CHECKS, timeout=30)
