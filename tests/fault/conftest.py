"""Fault-test fixtures: a pipeline of their own, helpers to stop and start stack services."""

from __future__ import annotations

import os
import subprocess

import pymysql
import pytest

from services.common.settings import CommonSettings
from tests.conftest import text_image
from tests.stack import REPO, namespaced_pipeline, require_stack


FAULT_ENV = {"OCRSTREAM_RETRY_MAX_BACKOFF_S": "2", "OCRSTREAM_SHUTDOWN_TIMEOUT_S": "15",
             "OCRSTREAM_KAFKA__SESSION_TIMEOUT_MS": "10000", "OCRSTREAM_KAFKA__HEARTBEAT_INTERVAL_MS": "1000"}
"""Settings of the fault tests' stages: short retry backoff and drain bound, a dead member gone in 10 s."""


@pytest.fixture(scope="module")
def fault_pipeline(tmp_path_factory):
    """Stages in a fresh namespace with :data:`FAULT_ENV`."""
    require_stack()
    with namespaced_pipeline(tmp_path_factory.mktemp("fault-logs"), FAULT_ENV) as p:
        yield p


def stack(action: str, service: str) -> None:
    """``deploy/local/up.sh SERVICE`` or ``down.sh SERVICE``.

    A restarted Kafka loads every partition of every test namespace before it listens (thousands,
    late in a run), which took over a minute on 2 busy cores: up.sh may wait 4 minutes here.

    Raises:
        AssertionError: the script failed, with its output.
    """
    script = {"up": "up.sh", "down": "down.sh"}[action]
    out = subprocess.run(["bash", f"deploy/local/{script}", service], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OCRSTREAM_READY_TIMEOUT": "240"})
    assert out.returncode == 0, f"{script} {service} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


def distinct_images(n: int, tag: str) -> list[tuple[bytes, str]]:
    """``n`` small distinct printed-text images named by their text."""
    return [(text_image([f"{tag} {i:04d}"]), f"{tag} {i:04d}") for i in range(n)]


def reads_as(name: str, text: str) -> bool:
    """True if ``text`` is the OCR of the image named ``name`` (its unique 4-digit number is there).

    Plumbing tests check that each request got *its own* image's result; the engine's
    occasional slip on a letter (O/0, a stray character) is not what they test.
    """
    number = name.split()[-1]
    squashed = text.upper().replace(" ", "").replace("O", "0").replace("I", "1").replace("L", "1")
    return number in squashed


def db_count(request_ids: list[str]) -> dict[str, int]:
    """Rows per request id in MariaDB ``requests``."""
    s = CommonSettings().mysql
    conn = pymysql.connect(host=s.host, port=s.port, user=s.user, password=s.password.get_secret_value(),
                           database=s.database)
    try:
        with conn.cursor() as cur:
            marks = ",".join(["%s"] * len(request_ids))
            cur.execute(f"SELECT request_id, COUNT(*) FROM requests WHERE request_id IN ({marks}) GROUP BY request_id",
                        request_ids)
            return dict(cur.fetchall())
    finally:
        conn.close()
