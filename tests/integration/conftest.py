"""Integration fixtures: a namespaced pipeline of real stage processes on the local stack."""

from __future__ import annotations

import os
import subprocess
import sys

import boto3
import pytest
from botocore.config import Config

from services.common.settings import CommonSettings
from tests.stack import API, REPO, TEST_ENV, WEBHOOKS, Pipeline, namespace_env, require_stack

API_MAX_BYTES = 1_000_000
WEBHOOK_SECRET = "test-webhook-secret"
WEBHOOK_RETRY_FOR_S = 8
#: Settings of the session's HTTP door (tests starting another door start from these).
API_BODY_TIMEOUT_S = 6
API_ENV = {
    "OCRSTREAM_LIMITS__MAX_IMAGE_BYTES": str(API_MAX_BYTES),
    "OCRSTREAM_WEBHOOK_ALLOWED_HOSTS": '["127.0.0.1", "localhost"]',
    "OCRSTREAM_WEBHOOK_ALLOW_PRIVATE": "true",
    "OCRSTREAM_WEBHOOK_SECRET": WEBHOOK_SECRET,
    # (the door reads the first three; the webhooks stage, started beside it, all of them)
    # retries within a test's patience: ~0.2 s apart, given up 8 s after the completion
    "OCRSTREAM_WEBHOOK_BACKOFF_BASE_S": "0.2",
    "OCRSTREAM_WEBHOOK_BACKOFF_MAX_S": "1",
    "OCRSTREAM_WEBHOOK_RETRY_FOR_S": str(WEBHOOK_RETRY_FOR_S),
    "OCRSTREAM_WEBHOOK_POLL_INTERVAL_S": "0.2",
    "OCRSTREAM_WEBHOOK_TIMEOUT_S": "5",
    "OCRSTREAM_HTTP_BODY_TIMEOUT_S": str(API_BODY_TIMEOUT_S),
}


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory):
    """Namespace env for this session, applied to this process too; topics and schema created."""
    require_stack()
    env = {**namespace_env(), **TEST_ENV}
    os.environ.update(env)
    subprocess.run([sys.executable, "-m", "services.cli", "init"], cwd=REPO, env=dict(os.environ), check=True,
                   capture_output=True)
    return env


@pytest.fixture(scope="session")
def pipeline(stack_env, tmp_path_factory):
    """The four stages running (one process each), shared by the integration tests."""
    p = Pipeline(env=stack_env, logdir=tmp_path_factory.mktemp("stage-logs"))
    p.start_all()
    yield p
    p.stop_all()


@pytest.fixture(scope="session")
def api(pipeline):
    """The HTTP front door (one process) in front of the session's pipeline, and the webhooks stage
    that delivers the namespace's callbacks; the door's base URL in ``.url``, the webhooks stage in
    ``.webhooks``.

    Uploads are limited to 1 MB here so the over-size tests stay small; webhooks may go to loopback
    and are retried quickly, for a short time.
    """
    hooks = pipeline.start(WEBHOOKS, extra_env=API_ENV)
    st = pipeline.start(API, extra_env=API_ENV)
    st.webhooks = hooks
    st.url = f"http://127.0.0.1:{st.port}"
    return st


@pytest.fixture(scope="module")
def s3():
    """A boto3 client of the local S3 server (path-style), with the project bucket in ``.bucket``."""
    cfg = CommonSettings().s3
    client = boto3.client("s3", endpoint_url=cfg.endpoint_url, aws_access_key_id=cfg.access_key,
                          aws_secret_access_key=cfg.secret_key.get_secret_value(), region_name=cfg.region,
                          config=Config(s3={"addressing_style": "path"}))
    client.bucket = cfg.bucket
    return client
