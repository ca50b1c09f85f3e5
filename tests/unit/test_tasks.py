"""The task registry (schemas/tasks.py): validation, normalisation and the cache-key variant."""

from __future__ import annotations

import pytest

from schemas.tasks import MAX_FIELDS, TASKS, TaskError, TaskParams, parse_fields, task_variant, validate_task


def test_every_task_has_a_slot_and_ocr_is_default():
    assert list(TASKS) == ["ocr", "doc_parse", "table", "formula", "chart", "extract", "translate"]
    assert {t: s.slot for t, s in TASKS.items()} == {
        "ocr": "lines", "doc_parse": "markdown", "table": "html", "formula": "latex", "chart": "markdown",
        "extract": "fields", "translate": "translation"}


def test_extract_fields_are_trimmed_and_deduplicated_in_order():
    p = validate_task("extract", {"fields": [" total", "date ", "total", "seller"]})
    assert p == TaskParams(fields=("total", "date", "seller"))
    assert parse_fields("invoice number, date,total,,") == ("invoice number", "date", "total")


@pytest.mark.parametrize("task,params,reason", [
    ("spot", None, "unknown task 'spot'"),
    ("extract", None, "task 'extract' needs fields"),
    ("extract", {"fields": []}, "fields: name at least one field"),
    ("extract", {"fields": ["a", "  "]}, "fields: a field name is empty"),
    ("extract", {"fields": ["x" * 101]}, "is longer than 100 characters"),
    ("extract", {"fields": [f"f{i}" for i in range(MAX_FIELDS + 1)]}, "at most 50 fields (51 given)"),
    ("translate", {"target_lang": "xx"}, "target_lang 'xx' is not one of: en, zh"),
    ("translate", None, "task 'translate' needs target_lang"),
    ("ocr", {"fields": ["a"]}, "task 'ocr' takes no fields"),
    ("extract", {"fields": ["a"], "colour": "red"}, "task parameters of 'extract'"),
])
def test_bad_parameters_say_why(task, params, reason):
    with pytest.raises(TaskError) as exc:
        validate_task(task, params)
    assert reason in str(exc.value)


def test_variant_puts_parameters_in_the_key_and_ignores_field_order():
    a = validate_task("extract", {"fields": ["date", "total"]})
    b = validate_task("extract", {"fields": ["total", "date", "date"]})
    c = validate_task("extract", {"fields": ["date"]})
    assert task_variant("extract", a) == task_variant("extract", b) != task_variant("extract", c)
    assert task_variant("extract", a).startswith("extract:") and len(task_variant("extract", a)) == 20
    assert task_variant("translate", validate_task("translate", {"target_lang": "en"})) == "translate:en"
    assert task_variant("ocr", validate_task("ocr", None)) == "ocr"
    assert validate_task("doc_parse", None) is None


@pytest.mark.parametrize("name", ["a\x1fb", "a\nb", "a\tb", "a\x00"])
def test_a_field_name_with_a_control_character_is_refused(name):
    """The variant joins the sorted names with \\x1f: ``["a\\x1fb"]`` and ``["a", "b"]`` would be one
    cache key (one caller's answer served to the other); a line break or NUL would also reach the
    prompt. Control characters are refused."""
    with pytest.raises(TaskError) as exc:
        validate_task("extract", {"fields": [name, "c"]})
    assert "control character" in str(exc.value)
