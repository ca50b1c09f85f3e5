"""Integration fixtures: a namespaced pipeline of real stage processes on the local stack."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.stack import REPO, Pipeline, namespace_env, stack_reachable


@pytest.fixture(scope="session")
def stack_env(tmp_path_factory):
    """Namespace env for this session, applied to this process too; topics and schema created."""
    missing = stack_reachable()
    if missing:
        pytest.fail(f"local stack not reachable ({missing}): run deploy/local/up.sh first", pytrace=False)
    env = namespace_env()
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
