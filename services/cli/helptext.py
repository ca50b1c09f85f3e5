"""Command help that reads as whole sentences at any terminal width.

Typer (with rich) prints a command's docstring with its line breaks kept: the command list shows
its first paragraph broken where the source line ended (``... and the`` / ``MariaDB tables``),
and a narrow terminal breaks it again. :func:`whole_paragraphs` gives every command a help text
whose paragraphs are one line each, which rich wraps to the terminal; the first paragraph, the
one the command list shows, is one short sentence.
"""

from __future__ import annotations

import inspect

import typer
from rich.markup import escape


def paragraphs(doc: str) -> str:
    """``doc`` (a docstring) with each paragraph on one line and rich markup escaped.

    Args:
        doc: Paragraphs separated by blank lines; lines within one joined by a space.

    Returns:
        The paragraphs joined by blank lines; a ``[`` is shown as written, never read as markup.
    """
    blocks = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(escape(" ".join(line.strip() for line in b.splitlines() if line.strip())) for b in blocks)


def whole_paragraphs(app: typer.Typer) -> typer.Typer:
    """Set the help of every command of ``app`` and of its sub-apps to its docstring (or given
    help) through :func:`paragraphs`. Called once, after every command is registered.

    Returns:
        ``app``.
    """
    for info in app.registered_commands:
        info.help = paragraphs(info.help if info.help is not None else inspect.getdoc(info.callback) or "")
    for group in app.registered_groups:
        whole_paragraphs(group.typer_instance)
    return app
