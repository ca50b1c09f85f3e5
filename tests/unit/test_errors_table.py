"""The one error vocabulary (schemas/errors.py ERRORS): every code has a row, statuses live only there,
and docs/errors.md is generated from it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from schemas.errors import ERRORS, ErrorCode, HttpErrorCode, http_status
from services.api.errors import ApiError

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("errors_table", REPO / "scripts" / "errors_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_code_of_both_enums_has_exactly_one_row():
    assert list(ERRORS) == [c.value for c in ErrorCode] + [c.value for c in HttpErrorCode]
    assert not {c.value for c in ErrorCode} & {c.value for c in HttpErrorCode}
    assert all(row.meaning.strip() for row in ERRORS.values())


def test_the_door_takes_its_status_from_the_table():
    assert ApiError(HttpErrorCode.RATE_LIMITED, "x").status == 429
    assert ApiError("too_many_uploads", "x").status == 429
    assert ApiError(ErrorCode.REQUEST_ID_CONFLICT, "x").status == 409
    assert ApiError(ErrorCode.DECODE_TIMEOUT, "x").status == 422
    assert ApiError(HttpErrorCode.CLIENT_CLOSED, "x").status == 499
    assert ApiError(HttpErrorCode.HTTP_ERROR, "x", status=418).status == 418
    assert http_status(ErrorCode.ENGINE_CRASH) is None
    with pytest.raises(ValueError, match="never an HTTP answer"):
        ApiError(ErrorCode.ENGINE_CRASH, "only ends a request")
    with pytest.raises(KeyError):
        ApiError("no_such_code", "x")


def test_no_status_is_mapped_outside_the_table():
    """The door names codes, never a status next to one: ``ApiError(<digits>, ...)`` nowhere in services/."""
    pattern = re.compile(r"ApiError\(\s*\d{3}")
    hits = [f"{p.relative_to(REPO)}" for p in (REPO / "services").rglob("*.py") if pattern.search(p.read_text())]
    assert hits == []


def test_committed_docs_errors_md_is_up_to_date():
    page = REPO / "docs" / "errors.md"
    assert page.read_text() == _script().render(), "run python scripts/errors_table.py --write docs/errors.md"
    for code in ERRORS:
        assert f"| `{code}` |" in page.read_text()
