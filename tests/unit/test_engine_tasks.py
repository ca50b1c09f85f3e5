"""Which engine does which task: one table (``schemas.tasks.ENGINE_TASKS``) read by the engines, the
registry, the HTTP door and the CLI; a task the deployment's engine cannot do is refused at the
doors at once (``unsupported_task``), with the message infer would end the request with."""

from __future__ import annotations

import typing

import pytest
from typer.testing import CliRunner

from schemas.tasks import ENGINE_TASKS, TASKS, UnsupportedTask, engines_for, unsupported_task_message
from services.common.cache.keys import EngineIdentity
from services.common.cache.keys import CacheKeySettings

EXTRACT_ON_CPU = ("engine 'rapidocr' cannot do task 'extract'; engines that can: vllm, openai (to run one, set "
                  "OCRSTREAM_ENGINE__ENGINE and its model on every stage: docs/engines.md#choosing-an-engine)")


def test_the_table_names_every_registered_engine_and_only_registry_tasks():
    from services.infer.engines.registry import ENGINES

    assert list(ENGINE_TASKS) == list(ENGINES) == list(typing.get_args(EngineIdentity.model_fields["engine"].annotation))
    assert ENGINE_TASKS == {"rapidocr": ("ocr", "doc_parse", "table"), "vllm": tuple(TASKS), "openai": tuple(TASKS)}
    for tasks in ENGINE_TASKS.values():
        assert "ocr" in tasks and set(tasks) <= set(TASKS)


def test_each_engine_class_and_the_registry_read_the_table():
    from services.infer.engines import registry
    from services.infer.engines.base import UnsupportedTask as EngineUnsupported

    for name in registry.ENGINES:
        assert registry.engine_class(name).tasks == frozenset(ENGINE_TASKS[name]), name
    assert registry.engines_for("extract") == engines_for("extract") == ("vllm", "openai")
    assert registry.engines_for("table") == ("rapidocr", "vllm", "openai")
    assert EngineUnsupported is UnsupportedTask  # infer's refusal and the doors' are one class, one message
    refused = UnsupportedTask("extract", "rapidocr")
    assert str(refused) == EXTRACT_ON_CPU and refused.able == ("vllm", "openai")
    assert unsupported_task_message("layout", "vllm") == "engine 'vllm' cannot do task 'layout'; no engine of this build can"


def test_the_deployment_runs_the_listed_tasks_its_engine_can_do():
    cpu = CacheKeySettings()
    assert (cpu.infer_engine, cpu.runnable_tasks) == ("rapidocr", ("ocr", "doc_parse", "table"))
    assert CacheKeySettings(engine=EngineIdentity(engine="vllm")).runnable_tasks == tuple(TASKS)
    assert CacheKeySettings(engine_kind="openai", tasks=("ocr", "extract")).runnable_tasks == ("ocr", "extract")
    # the engine infer runs: engine_kind, else engine.engine
    assert CacheKeySettings(engine=EngineIdentity(engine="vllm"), engine_kind="rapidocr").infer_engine == "rapidocr"
    # the list of a refused task's message is what runs here
    assert cpu.task_error("layout") == "task 'layout' is not one of this deployment's tasks: ocr, doc_parse, table"


def test_check_task_refuses_what_the_engine_cannot_do_only_where_asked():
    from schemas.tasks import TaskError, TaskParams

    cpu = CacheKeySettings()
    for task, params in [("extract", {"fields": ["total"]}), ("extract", None), ("translate", {"target_lang": "en"}),
                         ("formula", None), ("chart", None)]:
        with pytest.raises(UnsupportedTask) as exc:
            cpu.check_task(task, params, engine=True)  # before its parameters: extract without fields too
        assert str(exc.value) == unsupported_task_message(task, "rapidocr"), task
    # ingest and dedup (no engine=True) leave it to infer, which ends the request unsupported_task
    assert cpu.check_task("extract", {"fields": ["total"]}) == TaskParams(fields=("total",))
    assert cpu.check_task("table", None, engine=True) is None
    with pytest.raises(TaskError, match="is not one of this deployment's tasks: ocr, doc_parse, table$"):
        cpu.check_task("layout", None, engine=True)  # not listed: invalid_request first
    assert CacheKeySettings(engine_kind="openai").check_task("extract", {"fields": ["total"]}, engine=True) == \
        TaskParams(fields=("total",))


def test_the_door_answers_422_unsupported_task_and_lists_the_deployments_tasks():
    from services.api.errors import ApiError
    from services.api.protocol import SubmitOptions, deployment_tasks

    with pytest.raises(ApiError) as exc:
        SubmitOptions.parse({"task": "extract", "fields": "total"}, CacheKeySettings())
    assert (exc.value.status, exc.value.code, exc.value.message) == (422, "unsupported_task", EXTRACT_ON_CPU)
    listed = deployment_tasks(CacheKeySettings(tasks=("ocr", "table", "extract"))).model_dump()
    assert listed["engine"] == "rapidocr" and listed["default"] == "ocr"
    assert [(t["name"], t["runs"], t["reason"]) for t in listed["tasks"]] == [
        ("ocr", True, None), ("doc_parse", False, "task 'doc_parse' is not one of this deployment's tasks: ocr, table"),
        ("table", True, None), ("formula", False, "task 'formula' is not one of this deployment's tasks: ocr, table"),
        ("chart", False, "task 'chart' is not one of this deployment's tasks: ocr, table"),
        ("extract", False, EXTRACT_ON_CPU),
        ("translate", False, "task 'translate' is not one of this deployment's tasks: ocr, table")]
    assert listed["tasks"][5] == {"name": "extract", "summary": TASKS["extract"].summary, "parameters": ["fields"],
                                  "engines": ["vllm", "openai"], "runs": False, "reason": EXTRACT_ON_CPU}


@pytest.mark.parametrize("args", [["--task", "extract", "--fields", "total"], ["--task", "extract"],
                                  ["--task", "formula", "--no-wait"]])
def test_submit_refuses_a_task_the_engine_cannot_do_with_exit_2_and_sends_nothing(tmp_path, monkeypatch, args):
    """No stack is up for unit tests: a submission that got past the check would fail to connect
    (exit 1 and a traceback), not exit 2 with the door's code and message."""
    from services.cli.main import app

    for var in ("OCRSTREAM_TASKS", "OCRSTREAM_ENGINE_KIND", "OCRSTREAM_ENGINE__ENGINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OCRSTREAM_KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9")  # nothing listens there
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    res = CliRunner().invoke(app, ["submit", *args, str(tmp_path)])
    task = args[1]
    assert res.exit_code == 2, res.output
    assert res.output == f"error: unsupported_task: {unsupported_task_message(task, 'rapidocr')}\n"
