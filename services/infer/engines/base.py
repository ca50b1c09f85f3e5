"""The engine interface the infer stage talks to: ``ocr(images, task, timeout_s)``.

A call names one :class:`EngineTask` (a task of :data:`schemas.tasks.TASKS` and its
parameters) for all its images; each image answers an :class:`EngineOutput` (``segments`` for
``ocr``, ``answer`` for the other tasks) or its own exception, among them
:class:`UnsupportedTask` and :class:`UnparsableOutput` (final: not retried). Which engine does
which task: each engine class's :attr:`OcrEngine.tasks`, collected by
:mod:`services.infer.engines.registry` (``docs/engines.md``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from schemas.tasks import DEFAULT_TASK, TaskParams
from services.common.textlines import Segment


@dataclass(frozen=True)
class EngineTask:
    """What an ``ocr`` call asks of each of its images.

    Attributes:
        name: A task of :data:`schemas.tasks.TASKS` (``ocr``, ``doc_parse``, ``table``,
            ``formula``, ``chart``, ``extract``, ``translate``).
        params: Its parameters as validated at the door (``fields`` for ``extract``,
            ``target_lang`` for ``translate``), None for a task without any.
    """

    name: str = DEFAULT_TASK
    params: TaskParams | None = None


OCR = EngineTask()
"""Text spotting, the default task (lines with boxes)."""


class UnsupportedTask(Exception):
    """This engine cannot do the task (``unsupported_task``, final): the message names the
    engines that can (:func:`services.infer.engines.registry.engines_for`).

    Args:
        task: The task asked for.
        engine: The engine asked.
        able: Names of the engines that can do it (may be empty).
    """

    def __init__(self, task: str, engine: str, able: tuple[str, ...] = ()):
        where = f"; engines that can: {', '.join(able)}" if able else "; no engine of this build can"
        super().__init__(f"engine {engine!r} cannot do task {task!r}{where}")
        self.task, self.engine, self.able = task, engine, tuple(able)


class UnparsableOutput(Exception):
    """The model answered, but not in the task's format (``unparsable_output``, final): e.g.
    ``extract`` answered with prose, not JSON. ``raw`` is the answer as it came (kept in the
    result's ``raw_output``); ``warnings`` the generation's own (``truncated_max_tokens``, ...).
    """

    def __init__(self, message: str, raw: str, warnings: tuple[str, ...] = ()):
        super().__init__(message)
        self.raw = raw
        self.warnings = tuple(warnings)


class EngineTimeout(Exception):
    """One image took longer than the per-image inference timeout (or, for the ``openai``
    engine, than one HTTP attempt's own socket timeout: the message says which)."""


class EngineUnavailable(Exception):
    """The engine cannot take work at all right now (its model server is unreachable, its
    engine core died): no image of the call has a result.

    ``OcrEngine.ocr`` *raises* it instead of returning it per image, so nothing is committed:
    ``retriable`` makes the runner back off and run the whole batch again, for as long as it
    lasts (see :func:`services.common.errors.is_transient` and README "Delivery: the runner").

    Args:
        message: What happened.
        took_down: True when the engine went away while it held one of the call's images (the
            server dropped a connection carrying it, then refused the retry), False when it was
            already gone or the engine cannot tell: the infer handler counts only the former
            against an image (:meth:`services.infer.handler.InferHandler._infer`).
    """

    retriable = True

    def __init__(self, message: str = "", took_down: bool = False):
        super().__init__(message)
        self.took_down = took_down


@dataclass(frozen=True)
class EngineOutput:
    """What the engine found in one image and how long that image took (ms of engine time).

    ``segments``: task ``ocr``, the text segments (boxes in pixels of the image). ``answer``:
    any other task, its answer for the task's result slot (:class:`schemas.tasks.TaskSpec`):
    a string (``markdown``, ``html``, ``latex``, ``translation``) or, for ``extract``, a dict of
    every requested field in request order, its value as a string or None where absent.
    ``warnings`` says why the output may be incomplete (values in :mod:`schemas.events`:
    ``truncated_repetition``, ``truncated_max_tokens``); they reach the request's result.
    """

    segments: list[Segment]
    inference_ms: float
    warnings: tuple[str, ...] = field(default=())
    answer: str | dict[str, str | None] | None = None


class OcrEngine(ABC):
    """A batch of decoded images in, one list of text segments per image out.

    Lifecycle: ``await start()`` (load the model, answer a warm-up request), then any number
    of ``ocr`` calls, then ``await close()``. ``ready`` turns True only after the warm-up.

    Attributes:
        name: Engine name as in the cache key (``rapidocr``, ``vllm``, ``openai``).
        max_side: Longest image side in pixels the engine reads well; larger inputs are
            downscaled by the infer stage and boxes mapped back.
    """

    name: str = "engine"
    max_side: int = 2000
    ready: bool = False
    tasks: frozenset[str] = frozenset({DEFAULT_TASK})
    """The tasks this engine can do; any other answers :class:`UnsupportedTask` per image."""

    def supports(self, task: EngineTask) -> bool:
        """True when :attr:`tasks` holds ``task.name``."""
        return task.name in self.tasks

    def unsupported(self, task: EngineTask) -> UnsupportedTask:
        """The :class:`UnsupportedTask` for ``task``, naming the registered engines that can do it."""
        from services.infer.engines.registry import engines_for  # the registry imports the engines

        return UnsupportedTask(task.name, self.name, engines_for(task.name))

    @abstractmethod
    async def start(self) -> None:
        """Load the model and run a warm-up request; set ``ready``."""

    @abstractmethod
    async def ocr(self, images: list[np.ndarray], task: EngineTask,
                  timeout_s: float) -> list[EngineOutput | BaseException]:
        """Do ``task`` on every image.

        Args:
            images: ``uint8`` RGB arrays, shape ``(height, width, 3)``.
            task: What to do (:data:`OCR`: text spotting).
            timeout_s: Per-image time limit in seconds.

        Returns:
            One entry per image, in order: its output (boxes in pixels of that image, or the
            task's answer), or the exception that image raised (:class:`EngineTimeout` on
            timeout, :class:`UnsupportedTask` for a task not in :attr:`tasks`,
            :class:`UnparsableOutput` for an answer not in the task's format). One image
            failing never fails the others.

        Raises:
            EngineUnavailable: the engine cannot answer any image now (retriable: the batch is
                run again later, nothing is committed).
        """

    async def health(self) -> bool:
        """True when the engine can take work (polled in the background for ``/readyz``)."""
        return self.ready

    async def close(self) -> None:
        """Release the model and its threads."""
