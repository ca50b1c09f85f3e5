"""schemas imports only pydantic, the standard library and itself (the allow-list side of the
import-linter contract in pyproject.toml, which forbids the project's other dependencies by name)."""

import ast
import sys

from tests.conftest import REPO

ALLOWED = set(sys.stdlib_module_names) | {"pydantic", "schemas", "__future__"}


def imported_top_names(tree: ast.AST) -> set[str]:
    """First dotted part of every absolute import in ``tree``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_schemas_import_only_pydantic_and_the_standard_library():
    files = sorted((REPO / "schemas").rglob("*.py"))
    assert len(files) >= 5
    found = {f.relative_to(REPO).as_posix(): imported_top_names(ast.parse(f.read_text())) - ALLOWED for f in files}
    assert {f: sorted(n) for f, n in found.items() if n} == {}


def test_the_check_sees_a_third_party_import():
    assert imported_top_names(ast.parse("import os\nfrom redis.asyncio import Redis\nfrom . import x")) - ALLOWED == {"redis"}
