"""Counted nouns in messages for people: ``1 request``, ``2 requests``, ``0 cache entries``."""

from __future__ import annotations


def plural(count: int, word: str, words: str | None = None, *, number: bool = True) -> str:
    """``count`` and ``word`` in the form that agrees with it (English: singular for exactly 1).

    Args:
        count: How many (0 and every count but 1 take the plural).
        word: The singular (``"request"``, ``"cache hit"``).
        words: The plural when it is not ``word + "s"`` (``"cache entries"``).
        number: False: the noun alone (``"page"`` for a list that follows: ``page 3 of 7``).

    Returns:
        E.g. ``"1 request"``, ``"3 requests"``, ``"0 cache entries"``; ``"pages"`` without the number.
    """
    noun = word if count == 1 else (words or word + "s")
    return f"{count} {noun}" if number else noun
