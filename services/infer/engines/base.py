"""The engine interface the infer stage talks to: ``page(image, task, timeout_s, lane)``.

One call is one page (or one tile of a long page) for one :class:`EngineTask` (a task of
:data:`schemas.tasks.TASKS` and its parameters); it answers an :class:`EngineOutput`
(``segments`` for ``ocr``, ``answer`` for the other tasks) or raises that page's error, among
them :class:`UnsupportedTask` and :class:`UnparsableOutput` (final: not retried). The infer stage
keeps many pages in flight at once (its window, docs/delivery.md); whatever batching an engine
does (vLLM's continuous batching, a pool of CPU workers) it does itself across those concurrent
calls. Which engine does which task is one table, :data:`schemas.tasks.ENGINE_TASKS`: each
engine class's :attr:`OcrEngine.tasks` is its row (:func:`tasks_of`), and the doors refuse what the
deployment's engine cannot do from the same table (``docs/engines.md``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from schemas.lanes import Priority
# UnsupportedTask is defined with the table in schemas/tasks.py (the doors raise it too) and imported from here
from schemas.tasks import DEFAULT_TASK, ENGINE_TASKS, TaskParams, UnsupportedTask
from services.common.errors import OcrstreamError
from services.infer.textlines import Segment


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


def tasks_of(engine: str) -> frozenset[str]:
    """Engine ``engine``'s tasks: its row of :data:`schemas.tasks.ENGINE_TASKS` (an engine class's
    :attr:`OcrEngine.tasks`).

    Raises:
        KeyError: the table has no row for ``engine`` (add one with the engine).
    """
    return frozenset(ENGINE_TASKS[engine])


class UnparsableOutput(OcrstreamError):
    """The model answered, but not in the task's format (``unparsable_output``, final): e.g.
    ``extract`` answered with prose, not JSON. ``raw`` is the answer as it came (kept in the
    result's ``raw_output``); ``warnings`` the generation's own (``truncated_max_tokens``, ...).
    """

    def __init__(self, message: str, raw: str, warnings: tuple[str, ...] = ()):
        super().__init__(message)
        self.raw = raw
        self.warnings = tuple(warnings)


class EngineTimeout(OcrstreamError):
    """One page took longer than its time limit (or, for the ``openai`` engine, than one HTTP
    attempt's own socket timeout: the message says which)."""


class EngineUnavailable(OcrstreamError):
    """The engine cannot take work at all right now (its model server is unreachable, its
    engine core died): the page has no result.

    ``retriable`` makes the infer window back off and read the record again, for as long as it
    lasts; nothing past it is committed (see :func:`services.common.errors.is_transient` and
    docs/delivery.md).

    Args:
        message: What happened.
        took_down: True when the engine went away while it held this page (the server dropped
            the connection carrying it, then refused the retry), False when it was already gone
            or the engine cannot tell: the infer handler counts only the former against an
            image (:meth:`services.infer.handler.InferHandler._guarded`).
    """

    retriable = True

    def __init__(self, message: str = "", took_down: bool = False):
        super().__init__(message)
        self.took_down = took_down


@dataclass(frozen=True)
class EngineOutput:
    """What the engine found in one page and how long that page took (ms of engine time).

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
    """One decoded page in, its text segments (or a task's answer) out; many pages at once.

    Lifecycle: ``await start()`` (load the model, answer a warm-up request), then any number
    of concurrent :meth:`page` calls, then ``await close()``. ``ready`` turns True only after
    the warm-up.

    Attributes:
        name: Engine name as in the cache key (``rapidocr``, ``vllm``, ``openai``).
        max_side: Longest image side in pixels the engine reads well; larger inputs are
            downscaled by the infer stage and boxes mapped back (unless :attr:`shrinks_large_pages`).
        shrinks_large_pages: The engine shrinks an image longer than ``max_side`` itself, and
            answers boxes in the pixels of the image it was given: the infer stage then hands it
            tiles at full resolution (still slicing long pages), so the page is resampled once.
        tasks: The tasks this engine can do, its row of :data:`schemas.tasks.ENGINE_TASKS`
            (:func:`tasks_of`); any other answers :class:`UnsupportedTask`.
    """

    name: str = "engine"
    max_side: int = 2000
    shrinks_large_pages: bool = False
    ready: bool = False
    tasks: frozenset[str] = frozenset({DEFAULT_TASK})

    @property
    def slots(self) -> int:
        """Pages this engine can usefully work on at once (its worker threads, the server's
        requests in flight, twice vLLM's ``max_num_seqs``); the infer window is sized from it
        (:meth:`services.infer.settings.InferSettings.window`). Default 1."""
        return 1

    @property
    def busy(self) -> int:
        """Pages on the engine now (the ``ocrstream_engine_slots_busy`` gauge). Default 0."""
        return 0

    def supports(self, task: EngineTask) -> bool:
        """True when :attr:`tasks` holds ``task.name``."""
        return task.name in self.tasks

    def unsupported(self, task: EngineTask) -> UnsupportedTask:
        """The :class:`UnsupportedTask` for ``task``, naming the engines that can do it
        (:func:`schemas.tasks.engines_for`)."""
        return UnsupportedTask(task.name, self.name)

    @abstractmethod
    async def start(self) -> None:
        """Load the model and run a warm-up request; set ``ready``."""

    @abstractmethod
    async def page(self, image: np.ndarray, task: EngineTask, timeout_s: float,
                   lane: Priority = "bulk") -> EngineOutput:
        """Do ``task`` on one page.

        Many calls run at once (the infer window); an engine with bounded concurrency serves
        waiting interactive pages before bulk ones (:class:`~services.infer.engines.slots.PrioritySlots`)
        and a VLM engine passes ``lane`` on as the request's priority where its scheduler has one.

        Args:
            image: ``uint8`` RGB array, shape ``(height, width, 3)``.
            task: What to do (:data:`OCR`: text spotting).
            timeout_s: Time limit in seconds, counted from when the page gets an engine slot.
            lane: ``interactive`` or ``bulk`` (:data:`schemas.events.Priority`).

        Returns:
            The page's output: boxes in pixels of ``image``, or the task's answer.

        Raises:
            EngineTimeout: past ``timeout_s``.
            UnsupportedTask: a task not in :attr:`tasks` (no work done).
            UnparsableOutput: an answer not in the task's format.
            EngineUnavailable: the engine cannot answer now (retriable: the record is read again
                later, nothing past it is committed).
            Exception: any other failure of this page (``engine_error``); other pages go on.
        """

    async def health(self) -> bool:
        """True when the engine can take work (polled in the background for ``/readyz``)."""
        return self.ready

    async def close(self) -> None:
        """Release the model and its threads."""
