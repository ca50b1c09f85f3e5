"""The two lanes a request is read in (docs/delivery.md, "Two lanes")."""

from __future__ import annotations

from typing import Literal

Priority = Literal["interactive", "bulk"]
"""The lane a request is read in (docs/delivery.md, "Two lanes"): ``interactive`` requests (a
single image at either door) take the infer window's free slots first and have slots of their
own; ``bulk`` ones (a job's requests, a document's pages) fill the rest."""
PRIORITIES: tuple[str, ...] = ("interactive", "bulk")


def request_priority(priority: Priority | None, job_id: str | None) -> Priority:
    """The lane of a request submitted at either door: ``priority`` when the submitter gave one,
    else ``bulk`` for a request in a job and ``interactive`` for a single one (a document's pages
    are ``bulk`` whatever this says: the split sets it)."""
    if priority is not None:
        return priority
    return "bulk" if job_id else "interactive"
