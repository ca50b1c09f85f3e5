"""The instructions sent to the VLM engines (vllm, openai), defined once.

They live in shared code because a prompt is part of the cache key: dedup and the HTTP door
compute the key (:meth:`services.common.cache.keys.CacheKeySettings.generation`) as infer does, and
the settings' defaults are these. How a prompt is wrapped for the model (chat messages, raw
template) is the engine's: :mod:`services.infer.engines.hunyuan_prompts`.

Prompts are the official ones of tencent/HunyuanOCR (Tencent-Hunyuan/HunyuanOCR,
``inference/utils/tasks.py``: ``spotting_hunyuan`` and ``spotting_json``; the English wording
of the first is the README's "Text Spotting" row). The answers they get are parsed by
:mod:`services.infer.engines.hunyuan`.
"""

from __future__ import annotations

#: Official text-spotting prompt (``spotting_hunyuan``); answers ``text(x1,y1),(x2,y2)``. The
#: default of ``OCRSTREAM_VLLM_PROMPT`` and ``OCRSTREAM_OPENAI_PROMPT``.
SPOTTING_PROMPT = "检测并识别图片中的文字，将文本坐标格式化输出。"
#: English wording of the same task, from the model card's prompt table.
SPOTTING_PROMPT_EN = "Detect and recognize text in the image, and output the text coordinates in a formatted manner."
#: Official JSON spotting prompt (``spotting_json``, HunyuanOCR-1.5); answers a JSON array.
SPOTTING_JSON_PROMPT = (
    "检测并识别图中所有的文字行，请按从上到下、从左到右的阅读顺序进行识别。 "
    "输出格式为 JSON 数组，每个元素必须包含："
    '"box": [xmin, ymin, xmax, ymax]（坐标需归一化到 [0, 1000] 范围内）；'
    '"text": "识别出的文字内容"。 '
    "注意：请直接输出 JSON 数组，不要包含任何多余的描述性文字。"
)


DIALECTS = ("hunyuan", "generic")
"""The VLM dialects (prompts, sampling and parsers of the tasks other than ``ocr``:
:mod:`services.infer.engines.dialects`); ``OCRSTREAM_VLM_DIALECT`` names one, or ``auto``."""


def is_hunyuan(model: str) -> bool:
    """True for a model named like HunyuanOCR (any case, ``-``/``_`` ignored)."""
    return "hunyuanocr" in model.lower().replace("-", "").replace("_", "")


def resolve_dialect(name: str, model: str) -> str:
    """The dialect ``name`` names; ``auto``: ``hunyuan`` when ``model`` (the model the engine
    runs) is named like HunyuanOCR, else ``generic``. The cache key of the tasks other than ``ocr``
    names the dialect as configured (``OCRSTREAM_VLM_DIALECT``), next to the model."""
    if name == "auto":
        return "hunyuan" if is_hunyuan(model) else "generic"
    return name
