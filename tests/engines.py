"""Test helper for engine tests: several pages through an engine's per-page calls at once."""

from __future__ import annotations

import asyncio

from services.infer.engines.base import EngineUnavailable


async def read_all(engine, images, task, timeout_s, lane="bulk") -> list:
    """Every image through ``engine.page`` at once, as the infer window calls it: each page's
    output or the exception it raised, in order.

    Raises:
        EngineUnavailable: when a page found the engine unavailable (as the window sees it).
    """
    out = await asyncio.gather(*(engine.page(img, task, timeout_s, lane) for img in images), return_exceptions=True)
    if down := next((o for o in out if isinstance(o, EngineUnavailable)), None):
        raise down
    return list(out)
