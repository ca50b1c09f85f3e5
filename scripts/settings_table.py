"""Print (or check) the README's configuration table: every OCRSTREAM_* variable, default, meaning.

Usage: python scripts/settings_table.py [--write README.md | --check README.md]
The table sits between the markers ``<!-- settings:begin -->`` and ``<!-- settings:end -->``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel, SecretStr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's services, not an installed copy

from services.common.settings import CommonSettings  # noqa: E402
from services.dedup.settings import DedupSettings
from services.infer.settings import InferSettings
from services.api.settings import ApiSettings
from services.ingest.settings import IngestSettings
from services.sink.settings import SinkSettings

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
STAGES = {"ingest": IngestSettings, "dedup": DedupSettings, "infer": InferSettings, "sink": SinkSettings,
          "the HTTP door (`python -m services.api`)": ApiSettings}


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, (list, tuple, dict)):  # as the variable takes it: JSON
        text = json.dumps(list(value) if isinstance(value, tuple) else value, ensure_ascii=False)
    else:
        text = repr(value) if isinstance(value, str) else str(value)
    return text.replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str = "OCRSTREAM_") -> list[tuple[str, str, str]]:
    """``(env var, default, description)`` for every leaf field of ``model``."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(rows(ann, f"{prefix}{name.upper()}__"))
        else:
            desc = (field.description or "").replace("|", "\\|")
            out.append((f"{prefix}{name.upper()}", _default(field), desc))
    return out


def all_env_vars() -> set[str]:
    """Every variable any stage reads."""
    return {r[0] for cls in [CommonSettings, *STAGES.values()] for r in rows(cls)}


def render() -> str:
    """The markdown tables: shared settings, then each stage's own."""
    common = {r[0] for r in rows(CommonSettings)}
    parts = ["Shared by every stage:", "", "| variable | default | meaning |", "|---|---|---|"]
    parts += [f"| `{v}` | `{d}` | {m} |" if d else f"| `{v}` | | {m} |" for v, d, m in rows(CommonSettings)]
    for stage, cls in STAGES.items():
        inherited = common | {r[0] for base in cls.__mro__[1:] if base in STAGES.values() for r in rows(base)}
        own = [r for r in rows(cls) if r[0] not in inherited]
        parts += ["", f"{stage} only:", "", "| variable | default | meaning |", "|---|---|---|"]
        parts += [f"| `{v}` | `{d}` | {m} |" if d else f"| `{v}` | | {m} |" for v, d, m in own]
    return "\n".join(parts)


def main() -> int:
    table = render()
    if len(sys.argv) == 3 and sys.argv[1] in ("--write", "--check"):
        path = Path(sys.argv[2])
        text = path.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
        if sys.argv[1] == "--check":
            if new != text:
                print(f"{path}: configuration table is stale; run python scripts/settings_table.py --write {path}")
                return 1
            return 0
        path.write_text(new)
        return 0
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
