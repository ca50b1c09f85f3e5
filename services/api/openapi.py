"""Write the HTTP door's OpenAPI spec to ``schemas/openapi.json`` (run: ``python -m services.api.openapi``).

The spec is the one the running door serves at ``/openapi.json`` (FastAPI builds it from the
routes in :mod:`services.api.router`); the committed copy lets clients and reviewers read it
without a running service. ``tests/unit/test_openapi.py`` fails when the copy drifts from the app.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "schemas" / "openapi.json"


def spec() -> dict:
    """The OpenAPI 3.1 document of the door (no client connects: the app is built, not started)."""
    from services.api.router import create_app
    from services.api.settings import ApiSettings

    return create_app(ApiSettings()).openapi()


def render() -> str:
    """The spec as JSON text, deterministic byte for byte (sorted keys, 2-space indent, final newline)."""
    return json.dumps(spec(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> int:
    """Regenerate ``schemas/openapi.json``; print whether it changed."""
    text = render()
    if OUT.exists() and OUT.read_text() == text:
        print(f"{OUT} is up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
