"""One error tree: every exception class under services/ and schemas/ derives from OcrstreamError and says
whether it is retriable; is_transient tells a dependency being down from bad input by class."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import botocore.exceptions
import pymysql.err
import pytest
import redis.exceptions

from services.common.errors import OcrError, OcrstreamError, StoreUnavailable, is_transient
from schemas.errors import ErrorCode

REPO = Path(__file__).resolve().parents[2]


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class name) of every top-level class under services/ and schemas/ whose bases name
    an exception class."""
    found = []
    for path in sorted([*(REPO / "services").rglob("*.py"), *(REPO / "schemas").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if bases & {"Exception", "ValueError", "ConnectionError", "RuntimeError", "OcrstreamError", "OcrError",
                        "EngineTimeout", "TimeoutError"}:
                found.append((module, node.name))
    return found


def test_there_are_exception_classes_to_check():
    assert len(_exception_classes()) >= 14


@pytest.mark.parametrize("module,name", _exception_classes())
def test_every_exception_class_derives_from_the_root_and_says_if_it_is_retriable(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, OcrstreamError), f"{module}.{name} does not derive from OcrstreamError"
    assert isinstance(cls.retriable, bool)


def test_is_transient_by_class_not_by_name():
    assert is_transient(StoreUnavailable("s3 down"))
    assert not is_transient(OcrError(ErrorCode.CORRUPT_IMAGE, "bad bytes"))
    assert is_transient(botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(pymysql.err.OperationalError(2003, "Can't connect"))
    assert is_transient(redis.exceptions.ConnectionError("refused"))
    assert is_transient(redis.exceptions.BusyLoadingError("loading"))
    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    slow = botocore.exceptions.ClientError({"Error": {"Code": "SlowDown"}}, "PutObject")
    missing = botocore.exceptions.ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")
    assert is_transient(slow) and not is_transient(missing)
    assert not is_transient(ValueError("bad")) and not is_transient(pymysql.err.IntegrityError(1062, "dup"))

    class Named(Exception):  # a class that only shares a library error's name is not one
        pass

    Named.__name__ = "OperationalError"
    Named.__module__ = "pymysql.err"
    assert not is_transient(Named())
