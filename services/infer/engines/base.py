"""The engine interface the infer stage talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from services.common.textlines import Segment


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

    ``warnings`` says why the segments may be incomplete (values in :mod:`schemas.events`:
    ``truncated_repetition``, ``truncated_max_tokens``); they reach the request's result.
    """

    segments: list[Segment]
    inference_ms: float
    warnings: tuple[str, ...] = field(default=())


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

    @abstractmethod
    async def start(self) -> None:
        """Load the model and run a warm-up request; set ``ready``."""

    @abstractmethod
    async def ocr(self, images: list[np.ndarray], timeout_s: float) -> list[EngineOutput | BaseException]:
        """Recognise text in every image.

        Args:
            images: ``uint8`` RGB arrays, shape ``(height, width, 3)``.
            timeout_s: Per-image time limit in seconds.

        Returns:
            One entry per image, in order: its output (boxes in pixels of that image), or the
            exception that image raised (:class:`EngineTimeout` on timeout). One image failing
            never fails the others.

        Raises:
            EngineUnavailable: the engine cannot answer any image now (retriable: the batch is
                run again later, nothing is committed).
        """

    async def health(self) -> bool:
        """True when the engine can take work (polled in the background for ``/readyz``)."""
        return self.ready

    async def close(self) -> None:
        """Release the model and its threads."""
