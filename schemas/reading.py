"""What a page was read as: text lines, page sizes, a failure's code, a task's answer and the
warnings of an incomplete result (pydantic v2, frozen).

The parts the result models of :mod:`schemas.events` (and the stored documents) are made of,
defined once here; their JSON Schema is generated with the events' (``python -m schemas.generate``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.errors import ErrorCode


#: ``warnings`` values: the result is ``ok`` but incomplete. The VLM engines set them when a
#: page's generation was stopped early: by the runaway-repetition guard, or at the
#: generation cap (``max_tokens``; vLLM's ``finish_reason`` "length"). The lines before the
#: cut are kept; what the page held after it is missing.
WARNING_TRUNCATED_REPETITION = "truncated_repetition"
WARNING_TRUNCATED_MAX_TOKENS = "truncated_max_tokens"
#: The VLM answered text with no readable ``text(box)`` entry: the answer's text is kept as one
#: line whose box is the whole page (or tile), confidence 0.
WARNING_UNPARSED_OUTPUT = "unparsed_output"
#: Task ``table`` on the CPU engine: its layout model found no table region on a page, so that
#: page answers no table (an empty ``html``), never one made up from the whole page.
WARNING_NO_TABLE_FOUND = "no_table_found"
#: The ``warnings`` field's description on every result model.
WARNINGS_DOC = ("why an ok result may be incomplete: 'truncated_repetition' (generation stopped by the "
                "runaway-repetition guard), 'truncated_max_tokens' (generation hit its token cap), "
                "'unparsed_output' (the model's answer had no text-with-box entry: its text is one line "
                "boxing the whole page, confidence 0) or 'no_table_found' (task table on the CPU engine: no "
                "table region on a page, which answers no table); empty when complete")


# The task answer fields (schemas/tasks.py): on the result event, the result document and the
# stored output.
Markdown = Annotated[str | None, Field(
    description="doc_parse, chart: the page as Markdown (tables as HTML, formulas as LaTeX)")]
Html = Annotated[str | None, Field(description="table: the table(s) as HTML")]
Latex = Annotated[str | None, Field(description="formula: the formula(s) as LaTeX")]
Fields = Annotated[dict[str, str | None] | None, Field(
    description="extract: each requested field, in the order asked, its value or null where absent")]
Translation = Annotated[str | None, Field(description="translate: the text in task_params.target_lang")]

RawOutput = Annotated[str | None, Field(
    description="the model's answer as it came, kept when it could not be parsed (unparsable_output)")]


class FrozenModel(BaseModel):
    """The base of every event and result model: immutable, unknown fields ignored (additive changes)."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class LineSegment(FrozenModel):
    """One piece of text as the engine found it: a part of a :class:`Line`.

    Attributes:
        text: The segment's text (for RapidOCR: the recogniser's, with the spaces it dropped
            between words put back, see ``docs/lines.md``).
        box: 4 corner points (x, y) in pixels of the upright page, as the engine's detector
            drew them (rotated with the text), clockwise from top-left.
        confidence: The engine's confidence score in [0, 1].
    """

    text: str
    box: list[list[float]] = Field(min_length=4, max_length=4)
    confidence: float = Field(ge=0.0, le=1.0)


class Line(FrozenModel):
    """One recognised text line.

    Attributes:
        text: The line's text, words joined by single spaces.
        box: 4 corner points (x, y) in pixels of the upright page, clockwise from top-left.
        confidence: Confidence score in [0, 1] (the engine's, averaged over merged segments).
        page: 1-based page (or frame) number the line is on.
        segments: The engine's segments the line was assembled from, left to right, so a
            consumer can assemble lines its own way (``docs/lines.md``); null in results made
            before segments were kept.
    """

    text: str
    box: list[list[float]] = Field(min_length=4, max_length=4)
    confidence: float = Field(ge=0.0, le=1.0)
    page: int = Field(default=1, ge=1)
    segments: list[LineSegment] | None = Field(
        default=None, description="the engine's segments this line was assembled from, left to right "
        "(docs/lines.md); null in results made before they were kept")


class Page(FrozenModel):
    """Size of one page or frame of the input, in pixels of the upright image.

    ``alpha_background`` is the colour the page's transparent pixels were flattened onto
    before OCR: ``black`` under light content (a white logo on a transparent PNG), ``white``
    under dark content; null for a page without transparency (``docs/images.md``).
    """

    index: int = Field(ge=1)
    width: int = Field(ge=1)
    height: int = Field(ge=1)
    alpha_background: Literal["white", "black"] | None = Field(
        default=None, description="colour the page's transparency was flattened onto, chosen to contrast with "
        "its opaque content (black under light content, white under dark); null when the page has none")


class ErrorInfo(FrozenModel):
    """Why a request failed: a stable ``code`` and a human-readable ``message``."""

    code: ErrorCode
    message: str


class TaskAnswer(FrozenModel):
    """A task's answer (schemas/tasks.py: each task's result slot), defined once for the models
    that carry it: :class:`ResultEvent`, :class:`ResultDocument`, :class:`OcrOutput` and
    :class:`DocumentPage`. ``ocr`` fills none (its answer is the lines and ``text``); a task fills
    its slot. Each of those models is ``class Model(TaskAnswer, _ModelBody)``: pydantic orders
    fields base by base from the last, so on the wire a model's own fields come first and its
    task answer after them.
    """

    markdown: Markdown = None
    html: Html = None
    latex: Latex = None
    fields: Fields = None
    translation: Translation = None


#: The names of :class:`TaskAnswer`'s fields, in order.
TASK_ANSWER_FIELDS: tuple[str, ...] = tuple(TaskAnswer.model_fields)
#: Its answers that are text (all but ``fields``, an object): a result's ``text`` repeats the one it holds.
TASK_TEXT_ANSWERS: tuple[str, ...] = tuple(k for k in TASK_ANSWER_FIELDS if k != "fields")
