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
from urllib.parse import quote

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
#: Bytes of the request head that generated values may take, all together, as sent (a query or path
#: value percent-encoded, up to 12 bytes a character; a header value UTF-8): a head over
#: ``http_max_head_bytes`` (16 KiB) is refused with 431 by the HTTP protocol before any route
#: (tests/integration/test_http_heads.py), so a case over it would test the protocol, not the route.
HEAD_BUDGET_BYTES = 12_000
#: Most items of a repeated query parameter sent (each repeats its name in the request line; the
#: door takes at most 50 ``fields``, so a longer list is refused the same).
QUERY_LIST_CAP = 100


def _encoded(value: str) -> int:
    return len(quote(value.encode("utf-8", "surrogatepass"), safe=""))


def _utf8(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _fit(value: str, budget: int, size, keep: int = 0) -> str:
    """The longest prefix of ``value`` (at most :data:`QUERY_VALUE_CAP` characters, at least ``keep``)
    whose size as sent is within ``budget`` bytes."""
    value = value[:QUERY_VALUE_CAP]
    used = 0
    for i, ch in enumerate(value):
        used += size(ch)
        if used > budget and i >= keep:
            return value[:i]
    return value


def _cap_head(case) -> None:
    """Cut generated query strings (each string of a list too), path parameters and header values so
    that together they fit :data:`HEAD_BUDGET_BYTES` (an equal share each) and none is over
    :data:`QUERY_VALUE_CAP` characters, a list at most :data:`QUERY_LIST_CAP` items. A path parameter
    keeps one character (empty, the path would change)."""
    headers = case.headers if isinstance(case.headers, dict) else {}
    query = case.query if isinstance(case.query, dict) else {}
    for name, value in query.items():
        if isinstance(value, list):
            query[name] = value[:QUERY_LIST_CAP]
    path = case.path_parameters if isinstance(case.path_parameters, dict) else {}
    count = sum(isinstance(v, str) for v in (*headers.values(), *path.values()))
    count += sum(isinstance(x, str) for v in query.values() for x in (v if isinstance(v, list) else [v]))
    share = HEAD_BUDGET_BYTES // max(count, 1)
    for name, value in headers.items():
        if isinstance(value, str):
            headers[name] = _fit(value, share, _utf8)
    for name, value in path.items():
        if isinstance(value, str):
            path[name] = _fit(value, share, _encoded, keep=1)
    for name, value in query.items():
        if isinstance(value, str):
            query[name] = _fit(value, share, _encoded)
        elif isinstance(value, list):
            query[name] = [_fit(v, share, _encoded) if isinstance(v, str) else v for v in value]


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_every_route_conforms_to_its_spec(case, api):
    _cap_wait(case)
    _cap_head(case)
    case.call_and_validate(base_url=api.url, checks=CHECKS, timeout=30)
