"""Print (or check) the configuration table of docs/configuration.md: every OCRSTREAM_* variable,
its default and its meaning.

Usage: python scripts/settings_table.py [--write [FILE] | --check [FILE]]   (FILE: docs/configuration.md)
The table sits between the markers ``<!-- settings:begin -->`` and ``<!-- settings:end -->``; a file
without both markers is refused (the table no longer lives in README.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel, SecretStr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's services/, not whichever one the venv's editable install names

from services.common.cache.keys import CacheKeySettings  # noqa: E402
from services.common.settings import CommonSettings  # noqa: E402
from services.dedup.settings import DedupSettings  # noqa: E402
from services.infer.settings import InferSettings  # noqa: E402
from services.api.settings import ApiSettings  # noqa: E402
from services.ingest.settings import IngestSettings  # noqa: E402
from services.sink.settings import SinkSettings  # noqa: E402
from services.jobs.settings import JobsSettings  # noqa: E402
from services.webhooks.settings import WebhooksSettings  # noqa: E402

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
DEFAULT_FILE = ROOT / "docs" / "configuration.md"
STAGES = {"ingest": IngestSettings, "dedup": DedupSettings, "infer": InferSettings, "sink": SinkSettings, "jobs": JobsSettings,
          "webhooks": WebhooksSettings, "the HTTP door (`python -m services.api`)": ApiSettings}


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


def _table(title: str, table_rows: list[tuple[str, str, str]]) -> list[str]:
    """``title``, then one markdown table row per ``(variable, default, meaning)``."""
    return [title, "", "| variable | default | meaning |", "|---|---|---|",
            *(f"| `{v}` | `{d}` | {m} |" if d else f"| `{v}` | | {m} |" for v, d, m in table_rows)]


def render() -> str:
    """The markdown tables: settings every stage has, those of the stages that compute cache keys,
    then each stage's own."""
    common = {r[0] for r in rows(CommonSettings)}
    keyed = [r for r in rows(CacheKeySettings) if r[0] not in common]
    parts = _table("Shared by every stage:", rows(CommonSettings)) + [""] + _table(
        "Shared by every stage that computes, checks or stores under a cache key (the HTTP door, ingest, "
        "dedup, infer, sink, and the CLI): they must agree.", keyed)
    common |= {r[0] for r in keyed}
    for stage, cls in STAGES.items():
        inherited = common | {r[0] for base in cls.__mro__[1:] if base in STAGES.values() for r in rows(base)}
        parts += ["", *_table(f"{stage} only:", [r for r in rows(cls) if r[0] not in inherited])]
    return "\n".join(parts)


def main() -> int:
    table = render()
    args = sys.argv[1:]
    if not args:
        print(table)
        return 0
    if args[0] not in ("--write", "--check") or len(args) > 2:
        print(__doc__.strip().splitlines()[3], file=sys.stderr)
        return 2
    path = Path(args[1]) if len(args) == 2 else DEFAULT_FILE
    text = path.read_text()
    if BEGIN not in text or END not in text:
        print(f"{path}: no {BEGIN} ... {END} markers; the settings table lives in docs/configuration.md "
              "(python scripts/settings_table.py --write)", file=sys.stderr)
        return 2
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if args[0] == "--check":
        if new != text:
            print(f"{path}: configuration table is stale; run python scripts/settings_table.py --write")
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
