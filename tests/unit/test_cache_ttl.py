"""Which TTL a cache entry gets: per source, per task, default (SinkSettings.ttl_for)."""

from services.sink.settings import SinkSettings


def test_ttl_precedence_source_then_task_then_default():
    s = SinkSettings(cache_ttl_s=86_400, cache_ttl_by_source={"screenshot": 600}, tasks=("ocr", "table", "doc_parse"),
                     cache_ttl_by_task={"table": 7_200, "ocr": 3_600})
    assert s.ttl_for("upload", "doc_parse") == 86_400  # no override: the default
    assert s.ttl_for("upload", "table") == 7_200  # the task's override
    assert s.ttl_for("screenshot", "doc_parse") == 600  # the source's override
    assert s.ttl_for("screenshot", "table") == 600  # both apply: the source wins (even when longer, below)
    longer = SinkSettings(cache_ttl_by_source={"archive": 604_800}, cache_ttl_by_task={"ocr": 60})
    assert longer.ttl_for("archive", "ocr") == 604_800
    assert longer.ttl_for("test", "ocr") == 60


def test_default_overrides_and_env(monkeypatch):
    assert SinkSettings().ttl_for("screenshot", "ocr") == 600 and SinkSettings().ttl_for("upload", "ocr") == 86_400
    monkeypatch.setenv("OCRSTREAM_CACHE_TTL_BY_TASK", '{"ocr": 120}')
    monkeypatch.setenv("OCRSTREAM_CACHE_TTL_BY_SOURCE", '{"screenshot": 30}')
    s = SinkSettings()
    assert (s.ttl_for("screenshot", "ocr"), s.ttl_for("upload", "ocr"), s.ttl_for("upload", "table")) == (30, 120, 86_400)
