"""The PP-OCR builds the ``rapidocr`` engine runs, loaded from their wheels with no network.

``engine.model`` picks one (:data:`services.common.cache.keys.RAPIDOCR_MODELS`):

* ``PP-OCRv6-small`` (the default): ``rapidocr`` 3.10.0 (RapidAI, Apache-2.0), whose wheel bundles
  ``PP-OCRv6_det_small.onnx``, ``PP-OCRv6_rec_small.onnx`` (its character list in the ONNX
  metadata) and the PP-OCR mobile direction classifier ``ch_ppocr_mobile_v2.0_cls_mobile.onnx``;
* ``PP-OCRv4-ch``: the engine before it, ``rapidocr-onnxruntime`` 1.4.4 and the PP-OCRv4 models in
  its wheel, called as before (same inputs, same options), under a cache generation of its own.

**Nothing is downloaded.** rapidocr 3.x downloads a model (or a recogniser's character list)
from ModelScope when it is given no model path; each model here is given by its explicit path
inside the installed wheel, the recogniser carries its characters, and rapidocr's one downloader
(``rapidocr.utils.download_file.DownloadFile``) is replaced in this process by one that raises
(:func:`refuse_downloads`), so a code path we did not foresee fails loudly instead of reaching
the network. ``tests/unit/test_rapid_offline.py`` reads pages with every socket refused.

Both readers answer :class:`Row` lists, so the engine adapter (spaces, segments) is one code path.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from services.common.cache.keys import RAPIDOCR_MODELS, RapidOcrModels


@dataclass(frozen=True)
class Row:
    """One text segment as a RapidOCR build found it.

    Attributes:
        box: 4 corner points ``[[x, y], ...]`` (clockwise from top-left) in pixels of the image read.
        text: The recognised text.
        score: The recogniser's confidence in [0, 1].
        chars: One 4-point box per character of ``text``, spaces included (a space's box is its
            left neighbour's: only the non-space characters' positions are used), in reading
            order; None when the build gave none that match ``text``.
    """

    box: list[list[float]]
    text: str
    score: float
    chars: list | None = None


Reader = Callable[[np.ndarray], list[Row]]
"""Reads one RGB ``uint8`` image ``(h, w, 3)``: its segments as :class:`Row` s (thread-safe)."""


def models_for(model: str) -> RapidOcrModels:
    """The build that runs ``engine.model`` = ``model``.

    Raises:
        ValueError: not a model the rapidocr engine knows (the message lists them).
    """
    try:
        return RAPIDOCR_MODELS[model]
    except KeyError:
        raise ValueError(f"the rapidocr engine runs {' or '.join(RAPIDOCR_MODELS)}, not engine.model={model!r} "
                         "(OCRSTREAM_ENGINE__MODEL)") from None


def model_dir(models: RapidOcrModels) -> Path:
    """The ``models/`` folder of the installed wheel of ``models.package``, checked to be its pinned version.

    Raises:
        RuntimeError: the package is missing or another version is installed (the cache key names
            the version: results of other models must not be stored under it).
        FileNotFoundError: a model file is not in the wheel.
    """
    module = models.package.replace("-", "_")
    try:
        found = importlib.metadata.version(models.package)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"{models.package} is not installed; the rapidocr engine needs {models.package}=="
                           f"{models.version} (pyproject.toml)") from None
    if found != models.version:
        raise RuntimeError(f"{models.package} {found} is installed; the rapidocr engine needs {models.version}")
    folder = Path(importlib.util.find_spec(module).origin).parent / "models"
    for name in (models.det, models.cls, models.rec):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is not in the {models.package} wheel")
    return folder


def refuse_downloads() -> None:
    """Make rapidocr 3.x's downloader raise instead of fetching (this process, every instance).

    Every model and font rapidocr fetches goes through ``DownloadFile.run``; with explicit model
    paths it is never called, and if it were, the page fails with this error, naming the URL."""
    from rapidocr.utils.download_file import DownloadFile

    def refuse(cls, params) -> None:
        raise RuntimeError(f"rapidocr tried to download {params.file_url}: ocrstream loads its models from the "
                           "wheel only (services/infer/engines/rapid_models.py)")

    DownloadFile.run = classmethod(refuse)


def load(model: str, *, threads: int, max_side: int, det_limit_side_len: int) -> Rapid3Reader | LegacyReader:
    """Load ``model``'s build from its wheel (a few seconds) and return its :data:`Reader`.

    Args:
        model: ``engine.model`` (:data:`services.common.cache.keys.RAPIDOCR_MODELS`).
        threads: ONNX Runtime intra-op threads of each model.
        max_side: Longest side handed to the detector, larger images downscaled (px).
        det_limit_side_len: The detector scales an image up until its short side has this many px.

    Raises:
        ValueError: an unknown model. RuntimeError, FileNotFoundError: see :func:`model_dir`.
    """
    models = models_for(model)
    folder = model_dir(models)
    reader = LegacyReader if models.package == "rapidocr-onnxruntime" else Rapid3Reader
    return reader(folder, models, threads, max_side, det_limit_side_len)


class Rapid3Reader:
    """rapidocr 3.x: every model by path, characters' boxes on (``return_single_char_box``), the
    three models loaded now (rapidocr would load each on its first page). ``ocr`` is the
    ``rapidocr.RapidOCR`` object; calling the reader reads one RGB image (:data:`Reader`)."""

    def __init__(self, folder: Path, models: RapidOcrModels, threads: int, max_side: int, det_limit: int):
        from rapidocr import RapidOCR

        refuse_downloads()
        self.ocr = RapidOCR(params={
            "Global.log_level": "error",  # not a warning per blank page
            "Global.max_side_len": max_side,
            "Global.model_root_dir": str(folder),
            # set here, never per call: a call's arguments are stored on the shared object
            "Global.return_word_box": True,
            "Global.return_single_char_box": True,
            "Det.model_path": str(folder / models.det),
            "Det.limit_side_len": det_limit,
            "Cls.model_path": str(folder / models.cls),
            "Rec.model_path": str(folder / models.rec),
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        })
        self.ocr._load_det_model(), self.ocr._load_cls_model(), self.ocr._load_rec_model()

    def __call__(self, image: np.ndarray) -> list[Row]:
        # an array is taken as BGR, as PaddleOCR's models were trained (rapidocr converts files itself)
        out = self.ocr(np.ascontiguousarray(image[:, :, ::-1]))
        if out.boxes is None or out.txts is None or len(out.txts) == 0:
            return []
        words = out.word_results if len(out.word_results or ()) == len(out.txts) else [None] * len(out.txts)
        return [Row(np.asarray(box, dtype=float).tolist(), str(text), float(score), _char_boxes(str(text), w))
                for box, text, score, w in zip(out.boxes, out.txts, out.scores, words)]


def _char_boxes(text: str, words) -> list | None:
    """rapidocr 3.x's single-character boxes (one ``(char, score, box)`` per character that is not
    a space) as one box per character of ``text``, spaces included; None when they do not match."""
    if not words:
        return None
    solid = [w for w in words if str(w[0]).strip()]
    if "".join(str(w[0]) for w in solid) != "".join(text.split()):
        return None
    out, it, last = [], iter(solid), None
    for ch in text:
        if ch.isspace():
            out.append(last if last is not None else solid[0][2])
        else:
            last = next(it)[2]
            out.append(last)
    return out


class LegacyReader:
    """rapidocr-onnxruntime 1.4.4 as ocrstream ran it before PP-OCRv6 (the RGB array as given,
    ``return_word_box`` per call: its options then take the config's values, the same from every
    thread). ``ocr`` is its ``RapidOCR`` object."""

    def __init__(self, folder: Path, models: RapidOcrModels, threads: int, max_side: int, det_limit: int):
        from rapidocr_onnxruntime import RapidOCR

        self.ocr = RapidOCR(intra_op_num_threads=threads, inter_op_num_threads=1, max_side_len=max_side,
                            det_limit_side_len=det_limit, print_verbose=False,
                            det_model_path=str(folder / models.det), cls_model_path=str(folder / models.cls),
                            rec_model_path=str(folder / models.rec))

    def __call__(self, image: np.ndarray) -> list[Row]:
        result, _ = self.ocr(image, return_word_box=True)
        rows = []
        for r in result or []:
            text = str(r[1])
            chars = r[3] if len(r) > 3 and r[3] and len(r[3]) == len(text) else None
            rows.append(Row([[float(x), float(y)] for x, y in r[0]], text, float(r[2]), chars))
        return rows
