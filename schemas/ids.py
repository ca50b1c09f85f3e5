"""The rule every client-chosen request id follows, at both doors (``ocr.submit`` and ``POST /v1/ocr``).

A request id is 1 to :data:`REQUEST_ID_MAX_LENGTH` (64) characters, each one of ``A-Z a-z 0-9 . _ : -``
(printable ASCII that needs no escaping in a URL path, a Kafka key, an SSE ``id:`` field or a
SQL ``VARCHAR(64)``), and not only dots (``.`` and ``..`` are not path segments a client can
``GET``). Anything else -- a space, a control character, a non-ASCII letter, a lone surrogate, a
65th character -- is refused with ``invalid_request``; an id is never cut or changed to fit.

Ids the system makes itself (the HTTP door's for a request without one, ingest's derived one
for a submission without one or with an id it refuses) are 32 lowercase hex digits, which the
rule also admits, so they can be read back through the same routes.

One form is the system's alone: ``<anything>:p<digits>``, the id of a document's page
(:func:`page_request_id`). A client may read such an id but not choose one
(:func:`chosen_request_id_problem`), so a page id is never held by another request, whichever
comes first.
"""

from __future__ import annotations

import hashlib
import re

REQUEST_ID_MAX_LENGTH = 64
#: The rule as a JSON Schema / pydantic ``pattern`` (anchored; pydantic's regex engine has no
#: newline quirk at ``$``). Length is checked separately (``max_length``).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]*[A-Za-z0-9_:-][A-Za-z0-9._:-]*$"
#: The same rule for Python's ``re`` (``fullmatch``: Python's ``$`` would also match before a final "\n").
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN.removeprefix("^").removesuffix("$"))

REQUEST_ID_RULE = (f"1 to {REQUEST_ID_MAX_LENGTH} characters of A-Z a-z 0-9 . _ : - (not only dots)")
"""The rule in words, for error messages and docs."""


def is_request_id(value: object) -> bool:
    """True if ``value`` is a ``str`` that follows the request id rule (module docstring)."""
    return (isinstance(value, str) and 0 < len(value) <= REQUEST_ID_MAX_LENGTH
            and _REQUEST_ID_RE.fullmatch(value) is not None)


def request_id_problem(value: object) -> str | None:
    """Why ``value`` is not a valid request id (a message for ``invalid_request``), or None if it is.

    The value is shown cut to 80 characters with ``ascii()`` escapes (a control character or
    a lone surrogate is shown as ``\\x07`` / ``\\ud800``, never written raw into a log or a result).
    """
    if is_request_id(value):
        return None
    shown = ascii(value[:80]) + ("..." if len(value) > 80 else "") if isinstance(value, str) else type(value).__name__
    length = f" ({len(value)} characters)" if isinstance(value, str) and len(value) > REQUEST_ID_MAX_LENGTH else ""
    return f"request_id {shown}{length} is not a valid request id: {REQUEST_ID_RULE}"


_PAGE_ID_RE = re.compile(r".*:p[0-9]+")


def is_page_request_id(value: str) -> bool:
    """True if ``value`` has the form of a document page's id (``<document id>:p<n>``)."""
    return _PAGE_ID_RE.fullmatch(value) is not None


def chosen_request_id_problem(value: object) -> str | None:
    """Why ``value`` cannot be a request id a submitter chooses (a message for
    ``invalid_request``), or None if it can: :func:`request_id_problem`, and not of the page id
    form (``<document id>:p<n>``, :func:`page_request_id`: the system gives those)."""
    if (bad := request_id_problem(value)) is not None:
        return bad
    if is_page_request_id(value):
        return (f"request_id {value!r} has the form of a document page's id (<document id>:p<page>), which "
                "ocrstream gives the pages it splits; choose an id that does not end in ':p' and digits")
    return None


def page_request_id(document_id: str, page_number: int) -> str:
    """The request id of page ``page_number`` (1-based) of the document ``document_id``: the same
    for every replay of the split, so a page is one request however often it is announced.

    ``<document_id>:p<n>`` when that fits :data:`REQUEST_ID_MAX_LENGTH`, else the first 40 hex
    digits of SHA-256 of the document id followed by ``:p<n>`` (at most 48 characters for the
    3,000+ pages a document may have). Both follow the request id rule.
    """
    own = f"{document_id}:p{page_number}"
    if len(own) <= REQUEST_ID_MAX_LENGTH:
        return own
    return f"{hashlib.sha256(document_id.encode()).hexdigest()[:40]}:p{page_number}"
