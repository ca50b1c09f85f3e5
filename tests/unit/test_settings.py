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


class _Section(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OCRSTREAM_DEMO_", env_nested_delimiter="__")
    origins: list[str] = []
    db: dict[str, str] = {}


def test_a_list_or_section_that_is_not_json_is_one_line_not_a_traceback(monkeypatch):
    monkeypatch.setenv("OCRSTREAM_DEMO_ORIGINS", "https://a.example")
    with pytest.raises(SystemExit) as exc:
        load_settings(_Section)
    assert str(exc.value) == ("ocrstream: invalid settings in the environment:\n"
                              "  OCRSTREAM_DEMO_ORIGINS='https://a.example': not valid JSON "
                              "(Expecting value: line 1 column 1 (char 0))")


def test_a_section_value_naming_a_secret_is_not_echoed(monkeypatch):
    monkeypatch.setenv("OCRSTREAM_DEMO_DB", '{"password": "hunter2"')  # cut short: not JSON
    with pytest.raises(SystemExit) as exc:
        load_settings(_Section)
    msg = str(exc.value)
    assert "OCRSTREAM_DEMO_DB: not valid JSON" in msg
    assert "hunter2" not in msg
    monkeypatch.setenv("OCRSTREAM_DEMO_DB", '["password", "hunter2"]')  # JSON, but not a dict
    with pytest.raises(SystemExit) as exc:
        load_settings(_Section)
    assert "OCRSTREAM_DEMO_DB: Input should be a valid dictionary" in str(exc.value)
    assert "hunter2" not in str(exc.value)


def test_the_door_started_with_a_list_setting_that_is_not_json_exits_with_one_message():
    env = {**os.environ, "OCRSTREAM_HTTP_CORS_ORIGINS": "*"}
    proc = subprocess.run([sys.executable, "-m", "services.api"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "OCRSTREAM_HTTP_CORS_ORIGINS='*': not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_or_infinite_times_are_refused(monkeypatch, value):
    from services.dedup.settings import DedupSettings

    monkeypatch.setenv("OCRSTREAM_LRU_TTL_S", value)  # a nan age would keep LRU entries forever
    monkeypatch.setenv("OCRSTREAM_SHUTDOWN_TIMEOUT_S", value)
    with pytest.raises(SystemExit) as exc:
        load_settings(DedupSettings)
    assert f"OCRSTREAM_LRU_TTL_S='{value}'" in str(exc.value)
    assert f"OCRSTREAM_SHUTDOWN_TIMEOUT_S='{value}'" in str(exc.value)


def test_tasks_come_from_the_environment_and_others_are_refused_by_name(monkeypatch):
    from services.common.settings import CommonSettings
    from services.sink.settings import SinkSettings

    monkeypatch.delenv("OCRSTREAM_TASKS", raising=False)
    monkeypatch.delenv("OCRSTREAM_CACHE_TTL_BY_TASK", raising=False)
    assert CommonSettings().tasks == ("ocr",) and CommonSettings().task_error("ocr") is None
    monkeypatch.setenv("OCRSTREAM_TASKS", '["ocr", "receipt"]')
    s = load_settings(CommonSettings)
    assert s.tasks == ("ocr", "receipt") and s.task_error("receipt") is None
    assert s.task_error("layout") == "task 'layout' is not one of this deployment's tasks: ocr, receipt"
    monkeypatch.setenv("OCRSTREAM_CACHE_TTL_BY_TASK", '{"receipt": 3600}')
    assert load_settings(SinkSettings).ttl_for("upload", "receipt") == 3600
    for bad, why in [("[]", "OCRSTREAM_TASKS='[]': Tuple should have at least 1 item"),
                     ('["receipt"]', """OCRSTREAM_TASKS='["receipt"]': Value error, must include 'ocr'"""),
                     ('["ocr", ""]', """OCRSTREAM_TASKS='["ocr", ""]': 1: String should have at least 1 character""")]:
        monkeypatch.setenv("OCRSTREAM_TASKS", bad)
        with pytest.raises(SystemExit) as exc:
            load_settings(CommonSettings)
        assert why in str(exc.value), (bad, str(exc.value))


def test_a_ttl_for_a_task_no_request_can_carry_is_refused(monkeypatch):
    from services.sink.settings import SinkSettings

    monkeypatch.delenv("OCRSTREAM_TASKS", raising=False)
    monkeypatch.setenv("OCRSTREAM_CACHE_TTL_BY_TASK", '{"ocr": 7200, "recipt": 60}')
    with pytest.raises(SystemExit) as exc:
        load_settings(SinkSettings)
    assert str(exc.value).endswith(
        """OCRSTREAM_CACHE_TTL_BY_TASK='{"ocr": 7200, "recipt": 60}': Value error, names 'recipt', """
        "not among the tasks (ocr): no request can carry it")


@pytest.mark.parametrize("name, value, line", [
    ("OCRSTREAM_CACHE_TTL_BY_TASK", '{"ocr": 0}',
     """OCRSTREAM_CACHE_TTL_BY_TASK='{"ocr": 0}': ocr: Input should be greater than or equal to 1"""),
    ("OCRSTREAM_CACHE_TTL_S", "0", "OCRSTREAM_CACHE_TTL_S='0': Input should be greater than or equal to 1"),
    ("OCRSTREAM_SINK_MAX_BATCH", "0", "OCRSTREAM_SINK_MAX_BATCH='0': Input should be greater than or equal to 1"),
    ("OCRSTREAM_REDIS__URL", "notaurl", "OCRSTREAM_REDIS__URL='notaurl': Value error, must be a redis://, rediss:// "
                                        "or unix:// URL, e.g. redis://127.0.0.1:6379/0"),
    ("OCRSTREAM_REDIS__URL", "redis//:hunter2@redis:6379/0",  # never echo the password of a URL
     "OCRSTREAM_REDIS__URL='redis//***@redis:6379/0': Value error, must be a redis://, rediss:// or unix:// URL, "
     "e.g. redis://127.0.0.1:6379/0"),
    ("OCRSTREAM_REDIS__URL", "redis://h:99999", "OCRSTREAM_REDIS__URL='redis://h:99999': Value error, "
                                                "Port out of range 0-65535"),
    ("OCRSTREAM_S3__ENDPOINT_URL", "ht!tp://", "OCRSTREAM_S3__ENDPOINT_URL='ht!tp://': Value error, must be an "
                                              "http:// or https:// URL with a host, e.g. http://127.0.0.1:9000"),
    ("OCRSTREAM_TELEMETRY__LOG_LEVEL", "LOUD",
     "OCRSTREAM_TELEMETRY__LOG_LEVEL='LOUD': Input should be 'DEBUG', 'INFO', 'WARNING' or 'ERROR'"),
])
def test_values_that_would_break_a_stage_later_are_refused_at_start(monkeypatch, name, value, line):
    """A TTL of 0 made Redis refuse every SET (the sink took it for an outage and kept the lease,
    so repeats waited for it to expire); 0 records per batch or an unusable URL failed later with
    a traceback."""
    from services.sink.settings import SinkSettings

    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        load_settings(SinkSettings)
    assert str(exc.value).splitlines()[1:] == ["  " + line]


def test_the_log_level_is_read_in_any_case_and_metrics_port_0_is_off(monkeypatch):
    from services.common.settings import CommonSettings

    monkeypatch.setenv("OCRSTREAM_TELEMETRY__LOG_LEVEL", "debug")
    monkeypatch.setenv("OCRSTREAM_TELEMETRY__METRICS_PORT", "0")  # how an image's 9090 is turned off
    s = load_settings(CommonSettings)
    assert (s.telemetry.log_level, s.telemetry.metrics_port) == ("DEBUG", 0)


def test_the_door_refuses_a_task_the_deployment_does_not_list():
    from services.common.settings import CommonSettings
    from services.api.protocol import SubmitOptions
    from services.api.errors import ApiError

    s = CommonSettings(tasks=("ocr", "receipt"))
    assert SubmitOptions.parse({"task": "receipt"}, s).task == "receipt"
    assert SubmitOptions.parse({}, s).task == "ocr"
    with pytest.raises(ApiError) as exc:
        SubmitOptions.parse({"task": "layout", "source": "form"}, s)
    assert (exc.value.status, exc.value.code) == (400, "invalid_request")
    assert exc.value.message == "task 'layout' is not one of this deployment's tasks: ocr, receipt"
