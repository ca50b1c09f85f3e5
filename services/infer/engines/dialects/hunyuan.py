"""HunyuanOCR's own task prompts and sampling (tencent/HunyuanOCR, 1B).

Sources (Tencent-Hunyuan/HunyuanOCR):

* ``inference/utils/tasks.py`` (``TASK_PROMPTS``, HunyuanOCR-1.5's official prompts):
  ``doc_parse``, ``table``, ``formula``, ``chart_parse`` -> this module's ``doc_parse``,
  ``table``, ``formula``, ``chart``, word for word;
* ``README.md``, the prompt table: "Information Extraction" (``提取图片中的: ['key1','key2', ...]
  的字段内容，并按照 JSON 格式返回。``, the field list written as a Python list) -> ``extract``;
  "Translation" (``先提取文字，再将文字内容翻译为英文。若是文档，则其中页眉、页脚忽略。公式用latex格式表示，表格用html格式表示。``)
  -> ``translate``, the language name (英文) replaced by the target's Chinese name;
* ``inference/vLLM/infer_vllm_client.py`` (the official client): ``temperature`` 0.0,
  ``top_p`` 1.0, ``top_k`` -1 (off), ``repetition_penalty`` 1.08, ``max_tokens`` 4096, and
  the answer cleaned of repeated tails (``output_utils.clean_repeated_substrings``; here the
  project's own stricter guard, :func:`services.infer.engines.hunyuan.trim_repeated_tail`,
  and the vLLM engine's streaming early stop, as ``output_utils.infer_stream`` does).

Per-task ``max_tokens`` (ours; the client's 4096 for the long answers): 4096 for ``doc_parse``,
``table``, ``chart``, ``translate``; 2048 for ``formula`` and ``extract``, whose answers are short
(50 fields of a few words each are under 1,500 tokens), so a looping answer costs less. The
official ``normalize_doc_parse_markdown`` (aligning Markdown to the OmniDocBench ground truth for
scoring) is not applied: it rewrites formulas for a benchmark, not for a reader.

Task ``ocr`` keeps the engines' spotting path (:mod:`services.common.cache.prompts`,
:mod:`services.infer.engines.hunyuan`), with vLLM's recipe sampling (no repetition penalty).
"""

from __future__ import annotations

from schemas.tasks import LANGUAGES
from services.infer.engines.base import EngineTask
from services.infer.engines.dialects import Dialect, Sampling

PROMPTS: dict[str, str] = {
    "doc_parse": "提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，表格用html格式表达，"
                 "文档中公式用latex格式表示，按照阅读顺序组织进行解析。",
    "table": "把图中的表格解析为HTML。",
    "formula": "识别图片中的公式，用LaTeX格式表示。",
    "chart": "解析图中的图表，对于流程图使用Mermaid格式表示，其他图表使用Markdown格式表示。",
    "extract": "提取图片中的: {fields} 的字段内容，并按照 JSON 格式返回。",
    "translate": "先提取文字，再将文字内容翻译为{language}。若是文档，则其中页眉、页脚忽略。公式用latex格式表示，表格用html格式表示。",
}
"""Instruction per task (``{fields}``, ``{language}`` filled in per request)."""

LANGUAGE_NAMES: dict[str, str] = {
    "en": "英文", "zh": "中文", "ja": "日文", "ko": "韩文", "fr": "法文", "de": "德文", "es": "西班牙文",
    "it": "意大利文", "pt": "葡萄牙文", "ru": "俄文", "ar": "阿拉伯文", "vi": "越南文", "th": "泰文",
}
"""Chinese names of :data:`schemas.tasks.LANGUAGES` (the README's prompt says 英文 for English)."""
assert set(LANGUAGE_NAMES) == set(LANGUAGES), "a language of schemas.tasks has no Chinese name here"

MAX_TOKENS: dict[str, int] = {"doc_parse": 4096, "table": 4096, "chart": 4096, "translate": 4096,
                              "formula": 2048, "extract": 2048}
"""Generation cap per task, tokens (module docstring)."""
REPETITION_PENALTY = 1.08
"""The official client's ``--repetition-penalty`` default (``infer_vllm_client.py``)."""
TOP_K = -1
"""The official client's ``--top-k`` default (off; temperature 0 is greedy anyway)."""


def field_list(fields: tuple[str, ...]) -> str:
    """Fields as the README's prompt writes them, a Python list without spaces:
    ``['invoice number','date']`` (a quote or backslash in a name is escaped)."""
    return "[" + ",".join("'" + f.replace("\\", "\\\\").replace("'", "\\'") + "'" for f in fields) + "]"


class HunyuanDialect(Dialect):
    """HunyuanOCR (module docstring for every source)."""

    name = "hunyuan"
    source = "Tencent-Hunyuan/HunyuanOCR: inference/utils/tasks.py, README.md, inference/vLLM/infer_vllm_client.py"

    def sampling(self, task: EngineTask) -> Sampling:
        """See :meth:`Dialect.sampling`."""
        prompt = PROMPTS[task.name]
        p = task.params
        if task.name == "extract":
            prompt = prompt.format(fields=field_list(tuple(p.fields or ()) if p else ()))
        elif task.name == "translate":
            prompt = prompt.format(language=LANGUAGE_NAMES[(p.target_lang if p else None) or "en"])
        return Sampling(prompt=prompt, max_tokens=MAX_TOKENS[task.name], temperature=0.0, top_p=1.0, top_k=TOP_K,
                        repetition_penalty=REPETITION_PENALTY)
