"""Plain English task instructions for any OpenAI-compatible OCR VLM (a model with no dialect of
its own): the answers are asked for in the result slot's format (Markdown, HTML, LaTeX, one JSON
object, the translation alone) and read by the same parsers as HunyuanOCR's
(:mod:`services.infer.engines.dialects.parsers`).

Sampling: greedy (temperature 0, top_p 1); ``top_k`` and ``repetition_penalty`` are not sent
(they are vLLM extras a plain OpenAI-compatible server may refuse). The prompts are ours.
"""

from __future__ import annotations

import json

from schemas.tasks import LANGUAGES
from services.infer.engines.base import EngineTask
from services.infer.engines.dialects import Dialect, Sampling

PROMPTS: dict[str, str] = {
    "doc_parse": "Convert this document page to Markdown in reading order. Write tables as HTML and formulas as "
                 "LaTeX, and leave out page headers and footers. Answer with the Markdown only.",
    "table": "Convert the table in this image to HTML. Answer with the HTML table only.",
    "formula": "Write the formula in this image in LaTeX. Answer with the LaTeX only.",
    "chart": "Convert the chart in this image: a flowchart as Mermaid, any other chart as a Markdown table. "
             "Answer with that only.",
    "extract": "Extract these fields from the image: {fields}. Answer with one JSON object whose keys are exactly "
               "these field names and whose values are the text found in the image, or null for a field that is "
               "not there. Answer with the JSON only.",
    "translate": "Read all the text in this image and translate it into {language}. Answer with the translation only.",
}
"""Instruction per task (``{fields}`` as a JSON list, ``{language}`` the English name)."""

MAX_TOKENS: dict[str, int] = {"doc_parse": 4096, "table": 4096, "chart": 4096, "translate": 4096,
                              "formula": 2048, "extract": 2048}
"""Generation cap per task, tokens (as :mod:`.hunyuan`'s)."""


class GenericDialect(Dialect):
    """Any OpenAI-compatible OCR VLM (module docstring)."""

    name = "generic"
    source = "ocrstream's own (services/infer/engines/dialects/generic.py)"

    def sampling(self, task: EngineTask) -> Sampling:
        """See :meth:`Dialect.sampling`."""
        prompt = PROMPTS[task.name]
        p = task.params
        if task.name == "extract":
            prompt = prompt.format(fields=json.dumps(list(p.fields or ()) if p else [], ensure_ascii=False))
        elif task.name == "translate":
            prompt = prompt.format(language=LANGUAGES[(p.target_lang if p else None) or "en"])
        return Sampling(prompt=prompt, max_tokens=MAX_TOKENS[task.name], temperature=0.0, top_p=1.0)
