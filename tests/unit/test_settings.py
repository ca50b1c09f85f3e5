"""Settings from the environment: a bad value is one clear line naming the variable, not a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]


class _Demo(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OCRSTREAM_DEMO_", env_nested_delimiter="__")
    workers: int = 1
    api_key: int = 0


def test_bad_values_name_each_variable_and_hide_secrets(monkeypatch):
    monkeypatch.setenv("OCRSTREAM_DEMO_WORKERS", "two")
    monkeypatch.setenv("OCRSTREAM_DEMO_API_KEY", "hunter2")
    with pytest.raises(SystemExit) as exc:
        load_settings(_Demo)
    msg = str(exc.value)
    assert "OCRSTREAM_DEMO_WORKERS='two': Input should be a valid integer" in msg
    assert "OCRSTREAM_DEMO_API_KEY: Input should be a valid integer" in msg
    assert "hunter2" not in msg


def test_a_stage_started_with_a_bad_value_exits_with_one_message():
    env = {**os.environ, "OCRSTREAM_MAX_BATCH": "abc", "OCRSTREAM_REDIS__TIMEOUT_MS": "soon"}
    proc = subprocess.run([sys.executable, "-m", "services.infer"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "OCRSTREAM_MAX_BATCH='abc': Input should be a valid integer" in proc.stderr
    assert "OCRSTREAM_REDIS__TIMEOUT_MS='soon': Input should be a valid integer" in proc.stderr
    assert "Traceback" not in proc.stderr
