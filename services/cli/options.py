"""The CLI's numeric options, each bounded: a value out of its range, nan or not a number is
refused (exit 2) with the range in the message, and the range is in the option's ``--help``."""

from __future__ import annotations

import math
from typing import Any

import typer

MAX_WAIT_S = 7 * 86_400
"""The longest wait an option may ask for (``submit --timeout``, ``job status --timeout``): 7 days, s."""


def _words(value: float) -> str:
    """``value`` as a person writes it: ``0.05``, ``3600``, ``1,000,000``."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def parse_bounded(raw: Any, kind: type, lo: float, hi: float, span: str) -> int | float:
    """``raw`` (the command line's text, or a default) as ``kind`` from ``lo`` to ``hi`` inclusive.

    Args:
        raw: ``"0.5"``, ``"1e308"``, ``"nan"``, or an int or float default.
        kind: ``int`` or ``float``.
        lo, hi: The smallest and largest value accepted.
        span: The range in words for the message (``0.05 to 3,600 s``).

    Raises:
        typer.BadParameter: ``<raw> is not a number from <span>`` (``an integer`` for an int): not
            a number of ``kind`` (``abc``; ``1.5`` for an int; ``nan``, which compares false with
            every bound), or out of the range (``1e400`` is read as inf).
    """
    a = "an integer" if kind is int else "a number"
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = raw
    else:
        try:
            value = kind(str(raw).strip())
        except ValueError:
            value = None
    if value is None or (isinstance(value, float) and math.isnan(value)) or not lo <= value <= hi:
        raise typer.BadParameter(f"{raw} is not {a} from {span}")
    return value


def bounded(default: Any, *decls: str, kind: type = float, lo: float, hi: float, help: str, unit: str = "") -> Any:
    """A ``typer.Option`` for an int or float from ``lo`` to ``hi`` inclusive (:func:`parse_bounded`).

    A refused value ends the command before it starts, with exit 2 as for any bad option:
    ``Invalid value for '--interval': 1e308 is not a number from 0.05 to 3,600 s``.

    Args:
        default: The option's default (None: not given).
        decls: Its names (``"--interval"``).
        kind: ``int`` or ``float``.
        lo, hi: The smallest and largest value accepted, inclusive.
        help: One sentence without its full stop; the range is appended (``, 0.05 to 3,600 s.``).
        unit: The unit after the range (``"s"``), if any.

    Returns:
        The ``typer.Option`` to use as the parameter's default.
    """
    span = f"{_words(lo)} to {_words(hi)}" + (f" {unit}" if unit else "")
    return typer.Option(default, *decls, parser=lambda raw: parse_bounded(raw, kind, lo, hi, span),
                        metavar=f"<{kind.__name__}>", help=f"{help}, {span}.")
