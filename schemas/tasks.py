"""The task registry: what a request can ask the engine to do, its parameters and its result slot.

HunyuanOCR is one instruction-driven model for all of these: the same weights spot text lines,
parse a page to Markdown, read a table to HTML, a formula to LaTeX, a chart to Mermaid or
Markdown, extract named fields to JSON or translate, by changing the prompt (the prompts:
:mod:`services.infer.engines.dialects`). Each task fills one *result slot* of the result
(:class:`ResultSlot`); ``ocr``, text spotting, is the default and fills ``lines`` (and ``text``).

A task's parameters enter its cache key (:func:`task_variant` is the ``task`` part of the cache
generation, :class:`schemas.keys.CacheGeneration`): ``extract`` of other fields or ``translate``
to another language is another key. The same fields in another order, or with a field named
twice, are the same key (the variant lists them sorted and once); the answer's ``fields`` keep the
order the request asked for.

Which engine does which task is :data:`ENGINE_TASKS`, read by the engines, the registry and
the doors (an HTTP or CLI submission of a task the deployment's engine cannot do is refused at
once with ``unsupported_task``; :class:`UnsupportedTask`).

Adding a task: a :class:`TaskSpec` row in :data:`TASKS` (and its slot if new), the engines that
do it in :data:`ENGINE_TASKS`, its prompt and parser in each dialect that can do it
(``docs/tasks.md``).
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.errors import OcrstreamError

ResultSlot = Literal["lines", "markdown", "html", "latex", "fields", "translation"]
"""Where a task's answer goes in the result: ``lines`` (text lines with boxes, and ``text``),
``markdown``, ``html``, ``latex``, ``fields`` (field name -> value or null) or ``translation``."""

MAX_FIELDS = 50
"""Most fields one ``extract`` request may name."""

MAX_FIELD_CHARS = 100
"""Longest field name of an ``extract`` request, characters."""

LANGUAGES: dict[str, str] = {
    "en": "English", "zh": "Chinese", "ja": "Japanese", "ko": "Korean", "fr": "French", "de": "German",
    "es": "Spanish", "it": "Italian", "pt": "Portuguese", "ru": "Russian", "ar": "Arabic", "vi": "Vietnamese",
    "th": "Thai",
}
"""Target languages of ``translate``: ISO 639-1 code -> English name (the name the prompts use)."""


@dataclass(frozen=True)
class TaskSpec:
    """One task of the registry.

    Attributes:
        name: The task's name as requests give it (``task``).
        slot: The result slot its answer fills.
        needs: The parameters it requires (``fields``, ``target_lang``); any other is refused.
        summary: One line for users (docs, ``--help``).
    """

    name: str
    slot: ResultSlot
    needs: tuple[str, ...]
    summary: str


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("ocr", "lines", (), "text spotting: every text line with its bounding box (the default)"),
    TaskSpec("doc_parse", "markdown", (), "the whole page as Markdown, tables as HTML, formulas as LaTeX"),
    TaskSpec("table", "html", (), "the table(s) on the page as HTML"),
    TaskSpec("formula", "latex", (), "the formula(s) on the page as LaTeX"),
    TaskSpec("chart", "markdown", (), "a chart as Mermaid (flow charts) or a Markdown table (data charts)"),
    TaskSpec("extract", "fields", ("fields",), "the named fields as JSON (null where absent)"),
    TaskSpec("translate", "translation", ("target_lang",), "the page's text translated into target_lang"),
)}
"""Every task, by name."""

DEFAULT_TASK = "ocr"

ENGINE_TASKS: dict[str, tuple[str, ...]] = {
    "rapidocr": ("ocr", "doc_parse", "table"),
    "vllm": tuple(TASKS),
    "openai": tuple(TASKS),
}
"""Which engine does which task: engine name (``OCRSTREAM_ENGINE__ENGINE``, ``OCRSTREAM_ENGINE_KIND``;
the keys of ``services.infer.engines.registry.ENGINES``) -> the tasks it can do, in registry order.
The one table: the engines' ``tasks``, the registry's ``engines_for``, the HTTP door, the CLI and
the web page all read it. ``rapidocr`` (CPU) reads ``doc_parse`` and ``table`` with its layout and
table models; the VLM engines do every task by prompt (``docs/engines.md``)."""

CHOOSING_AN_ENGINE = "docs/engines.md#choosing-an-engine"
"""Where users read how to configure an engine (named in ``unsupported_task`` messages)."""


def engines_for(task: str) -> tuple[str, ...]:
    """The engines of :data:`ENGINE_TASKS` that can do ``task``, in table order."""
    return tuple(name for name, tasks in ENGINE_TASKS.items() if task in tasks)


def unsupported_task_message(task: str, engine: str) -> str:
    """Why ``engine`` refuses ``task`` (the message of ``unsupported_task``, at every door and at
    infer alike): the engines that can, and where to read how to run one."""
    able = engines_for(task)
    if not able:
        return f"engine {engine!r} cannot do task {task[:64]!r}; no engine of this build can"
    return (f"engine {engine!r} cannot do task {task[:64]!r}; engines that can: {', '.join(able)} "
            f"(to run one, set OCRSTREAM_ENGINE__ENGINE and its model on every stage: {CHOOSING_AN_ENGINE})")


class UnsupportedTask(OcrstreamError):
    """An engine cannot do a task (``unsupported_task``, final): raised by an infer engine asked
    for it, and by the doors that know the deployment's engine before anything is sent.

    Args:
        task: The task asked for.
        engine: The engine that cannot do it.

    Attributes:
        able: The engines that can (:func:`engines_for`; may be empty).
    """

    def __init__(self, task: str, engine: str):
        super().__init__(unsupported_task_message(task, engine))
        self.task, self.engine, self.able = task, engine, engines_for(task)


class TaskParams(BaseModel):
    """A request's task parameters (additive on the events; absent for tasks without any).

    Attributes:
        fields: ``extract``: the field names, in the order the answer lists them (1 to
            :data:`MAX_FIELDS`, each 1 to :data:`MAX_FIELD_CHARS` characters, trimmed, no control
            characters).
        target_lang: ``translate``: the target language, a code of :data:`LANGUAGES`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    fields: tuple[str, ...] | None = Field(default=None, description="extract: the field names, in answer order")
    target_lang: str | None = Field(default=None, description="translate: target language (ISO 639-1 code)")


class TaskError(OcrstreamError, ValueError):
    """A task name or its parameters are not valid; the message says why (for ``invalid_request``)."""


def task_spec(task: str) -> TaskSpec:
    """The registry row of ``task``.

    Raises:
        TaskError: ``task`` is not in :data:`TASKS`.
    """
    spec = TASKS.get(task)
    if spec is None:
        raise TaskError(f"unknown task {task[:64]!r}; the tasks are: {', '.join(TASKS)}")
    return spec


def validate_task(task: str, params: TaskParams | dict | None) -> TaskParams | None:
    """Check ``task`` and its parameters; returns the parameters normalised (field names
    trimmed, duplicates dropped keeping the first; None for a task without parameters).

    Raises:
        TaskError: unknown task, a missing or unexpected parameter, an empty or over-long field
            list or field name, a field name with a control character (a line break, ``\\x1f``:
            the separator of the names in :func:`task_variant`), or a target language not in
            :data:`LANGUAGES`.
    """
    spec = task_spec(task)
    if params is None:
        p = TaskParams()
    elif isinstance(params, TaskParams):
        p = params
    else:
        try:
            p = TaskParams.model_validate(params)
        except ValueError as exc:
            raise TaskError(f"task parameters of {task!r}: {exc}") from None
    given = {k for k in ("fields", "target_lang") if getattr(p, k) is not None}
    extra, missing = given - set(spec.needs), set(spec.needs) - given
    if extra:
        raise TaskError(f"task {task!r} takes no {', '.join(sorted(extra))}")
    if missing:
        raise TaskError(f"task {task!r} needs {', '.join(sorted(missing))}")
    if p.fields is not None:
        names = [f.strip() for f in p.fields]
        if not names:
            raise TaskError("fields: name at least one field")
        if len(names) > MAX_FIELDS:
            raise TaskError(f"fields: at most {MAX_FIELDS} fields ({len(names)} given)")
        for f in names:
            if not f:
                raise TaskError("fields: a field name is empty")
            if len(f) > MAX_FIELD_CHARS:
                raise TaskError(f"fields: {f[:20]!r}... is longer than {MAX_FIELD_CHARS} characters")
            if any(unicodedata.category(ch) == "Cc" for ch in f):  # \x1f joins the names in the cache key
                raise TaskError(f"fields: {f[:20]!r} holds a control character")
        return TaskParams(fields=tuple(dict.fromkeys(names)))
    if p.target_lang is not None:
        if p.target_lang not in LANGUAGES:
            raise TaskError(f"target_lang {p.target_lang[:16]!r} is not one of: {', '.join(LANGUAGES)}")
        return p
    return None


def task_variant(task: str, params: TaskParams | None) -> str:
    """The ``task`` part of the cache generation: the task name, and its parameters in one
    canonical form (``extract:<12 hex of the sorted field names>``, ``translate:en``), so a
    task's parameters are part of the cache key and the same set of fields in any order is one key."""
    if params is None:
        return task
    if params.fields is not None:
        digest = hashlib.sha256("\x1f".join(sorted(set(params.fields))).encode()).hexdigest()[:12]
        return f"{task}:{digest}"
    if params.target_lang is not None:
        return f"{task}:{params.target_lang}"
    return task


def parse_fields(text: str) -> tuple[str, ...]:
    """Field names from a comma-separated list (the CLI's ``--fields`` and the HTTP form's
    ``fields``): ``"invoice number, date,total"`` -> ``("invoice number", "date", "total")``."""
    return tuple(f.strip() for f in text.split(",") if f.strip())
