"""Unit tests run on the settings' defaults: the stack tiers' session fixture
(tests/integration/conftest.py ``stack_env``) puts its namespace (``OCRSTREAM_TOPICS__*``,
``OCRSTREAM_REDIS__KEY_PREFIX``, ...) into this process's environment for the rest of the session,
and the unit tier runs after it in a whole-suite run; each unit test gets an environment without
any ``OCRSTREAM_`` setting (``OCRSTREAM_TEST_STRICT`` kept: it is the tests' own switch; a test
may still set its own with ``monkeypatch``)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _default_settings_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("OCRSTREAM_") and k != "OCRSTREAM_TEST_STRICT"]:
        monkeypatch.delenv(name)
