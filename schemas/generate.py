"""Write the JSON Schema of every event into ``schemas/jsonschema/`` (run: ``python -m schemas.generate``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from schemas.events import ALL_EVENTS

OUT_DIR = Path(__file__).parent / "jsonschema"


def render() -> dict[str, str]:
    """Return ``{file name: JSON text}`` for every event model, deterministic byte for byte."""
    out = {}
    for name, model in ALL_EVENTS.items():
        schema = model.model_json_schema(by_alias=True, mode="serialization")
        schema["$id"] = f"https://ocrstream.dev/schemas/{name}.json"
        out[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main() -> int:
    """Regenerate the files; print what changed."""
    OUT_DIR.mkdir(exist_ok=True)
    for fname, text in render().items():
        path = OUT_DIR / fname
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
