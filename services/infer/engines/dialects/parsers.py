"""Reading a VLM's answer to a task other than ``ocr``: Markdown, HTML, LaTeX and translations
(text), and ``extract``'s JSON fields. Shared by every dialect; plain text, no network.

What is done to every answer: a Markdown code fence around the whole answer is removed
(```` ```markdown ... ``` ````, ```` ```html ````, ...; a ```` ```mermaid ```` fence is kept, since
inside Markdown it is what says the block is a Mermaid diagram and how renderers draw one), and a runaway loop at its end is cut to
one copy with the repeat guard of the spotting parser
(:func:`services.infer.engines.hunyuan.trim_repeated_tail`: a unit of 3+ distinct characters
repeated 8+ times over 256+ characters, or 12 identical last lines), which adds the warning
``truncated_repetition``.

Answers cut at ``max_tokens`` (the generation's warning ``truncated_max_tokens``) are
*returned marked*, not failed: what the model wrote before the cut is its real reading of the
page (the Markdown of the first part of a long page, the fields it had already written), greedy
decoding would write the same again on a retry with the same limit, and the warning tells the
user (and the stored result) that the answer is incomplete. Only a cut answer from which
nothing can be read at all (an ``extract`` answer with no complete field) ends with
:class:`~services.infer.engines.base.UnparsableOutput`, keeping the raw text.
"""

from __future__ import annotations

import ast
import json
import re

from schemas.reading import WARNING_TRUNCATED_MAX_TOKENS, WARNING_TRUNCATED_REPETITION
from services.infer.engines.base import UnparsableOutput
from services.infer.engines.hunyuan import trim_repeated_tail

_OPEN_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n?")
_CLOSE_FENCE = re.compile(r"\n?[ \t]*```\s*$")
_FENCED = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n?(.*?)(?:\n?[ \t]*```|$)", re.S)
# one complete "key": value pair (value a string, number, true/false/null), for a cut answer
_PAIR = re.compile(r'"((?:[^"\\]|\\.)*)"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)'
                   r"(?=\s*[,}\n])")


def strip_fence(text: str) -> str:
    """``text`` without a code fence around the whole of it (the opening fence may name a
    language; a missing closing fence, as in an answer cut short, is fine); otherwise as is.
    A ```` ```mermaid ```` fence stays: it is the Markdown that marks a Mermaid diagram."""
    m = _OPEN_FENCE.match(text)
    if not m or m.group(0).strip().lower() == "```mermaid":
        return text
    body = _OPEN_FENCE.sub("", text, count=1)
    return _CLOSE_FENCE.sub("", body)


def _add(warnings: tuple[str, ...], w: str) -> tuple[str, ...]:
    return warnings if w in warnings else (*warnings, w)


def parse_text(text: str, warnings: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """A text answer (``markdown``, ``html``, ``latex``, ``translation``): fence stripped, a
    repeated tail trimmed (warning ``truncated_repetition``), outer blank space removed.

    Never raises: any text is a text answer (an empty one too: a blank page has no Markdown).

    Returns:
        ``(text, warnings)``: ``warnings`` are the given ones plus this parser's.
    """
    body, trimmed = trim_repeated_tail(text or "")
    if trimmed:
        warnings = _add(warnings, WARNING_TRUNCATED_REPETITION)
    return strip_fence(body.strip()).strip(), warnings


def _as_value(v) -> str | None:
    """A field's value as the result holds it: None stays None, strings as they are, numbers
    and booleans as JSON writes them, lists and objects as compact JSON text, a Python literal JSON
    cannot write (bytes, a set, complex, a tuple key) as its ``str``."""
    if v is None:
        return None
    if isinstance(v, str):
        return v
    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):  # a Python literal JSON cannot write (bytes, a set, a tuple key): its text
        return str(v)


def _norm(key: str) -> str:
    return "".join(str(key).split()).casefold()


def _candidates(body: str) -> list[str]:
    """Where a JSON value may be in ``body``: each fenced block, then the span from the first
    ``{`` (or ``[``) to the last ``}`` (or ``]``), then the whole."""
    out = [m.group(1) for m in _FENCED.finditer(body)]
    for o, c in (("{", "}"), ("[", "]")):
        i, j = body.find(o), body.rfind(c)
        if i >= 0 and j > i:
            out.append(body[i:j + 1])
    out.append(body)
    return out


def _load(candidate: str):
    """``candidate`` as JSON, or as a Python literal (``{'a': 'b'}``, the style of HunyuanOCR's
    own prompt); None when it is neither."""
    s = candidate.strip()
    if not s or s[0] not in "{[":
        return None
    try:
        return json.loads(s, strict=False)  # a raw line break inside a string, as models write them
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return None


def _object(data) -> dict | None:
    """A JSON answer as one object: an object; a list of objects merged (first value wins);
    ``{"result": {...}}``-style wrappers are *not* unwrapped (a field may be named so)."""
    if isinstance(data, dict):
        return data
    if isinstance(data, list) and data and all(isinstance(d, dict) for d in data):
        merged: dict = {}
        for d in data:
            for k, v in d.items():
                merged.setdefault(k, v)
        return merged
    return None


def parse_fields(text: str, fields: tuple[str, ...],
                 warnings: tuple[str, ...] = ()) -> tuple[dict[str, str | None], tuple[str, ...]]:
    """An ``extract`` answer -> exactly ``fields``, in that order, each its value or None.

    Reads a JSON object (or a list of objects) inside a code fence, or surrounded by prose, or
    written as a Python literal; keys match the requested names exactly, else ignoring case
    and blank space; keys not asked for are dropped; a field the answer lacks is None; values
    are strings (numbers, booleans, lists and objects as JSON text). An answer cut at
    ``max_tokens`` whose JSON does not close is read pair by pair (every complete
    ``"key": value``), marked ``truncated_max_tokens`` (module docstring).

    Returns:
        ``(fields, warnings)``.

    Raises:
        UnparsableOutput: no JSON object in the answer (prose), or a cut answer with no
            complete pair; ``raw`` is the answer.
    """
    body, trimmed = trim_repeated_tail(text or "")
    if trimmed:
        warnings = _add(warnings, WARNING_TRUNCATED_REPETITION)
    obj = None
    for cand in _candidates(body):
        obj = _object(_load(cand))
        if obj is not None:
            break
    if obj is None and (WARNING_TRUNCATED_MAX_TOKENS in warnings or trimmed):
        pairs = {}
        for k, v in _PAIR.findall(body):
            try:  # strict=False: a raw line break inside a string, as models write them
                pairs[json.loads(f'"{k}"', strict=False)] = json.loads(v, strict=False)
            except ValueError:  # an invalid escape: that pair is not read
                continue
        obj = pairs or None
    if obj is None:
        raise UnparsableOutput(f"extract: no JSON object in the model's answer of {len(text or '')} characters",
                               text or "", warnings)
    exact = {str(k): v for k, v in obj.items()}
    # a key another requested field names exactly is that field's alone: a loose match never
    # copies it to a second field ("ab" answered, "a b" and "ab" asked: only "ab" gets it)
    taken = {f for f in fields if f in exact}
    loose = {}
    for k, v in exact.items():
        if k not in taken:
            loose.setdefault(_norm(k), v)
    out: dict[str, str | None] = {}
    for f in fields:
        v = exact[f] if f in exact else loose.get(_norm(f))
        out[f] = _as_value(v)
    return out, warnings
