"""Import rules the import-linter contracts in pyproject.toml cannot state alone: schemas imports only
pydantic, the standard library and itself (the allow-list side of a contract that forbids the other
dependencies by name); the core-of-common contract names every module directly in services/common."""

import ast
import sys
import tomllib

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


def _contract(name_starts: str) -> dict:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"].startswith(name_starts))


def test_the_core_contract_names_every_module_and_every_concept_of_services_common():
    contract = _contract("the core of services.common imports no concept")
    common = REPO / "services" / "common"
    modules = {f"services.common.{p.stem}" for p in common.glob("*.py") if p.stem != "__init__"}
    concepts = {f"services.common.{p.parent.name}" for p in common.glob("*/__init__.py")} - {"services.common.migrations"}
    assert set(contract["source_modules"]) == modules
    assert set(contract["forbidden_modules"]) == concepts
    assert {"services.common.cache", "services.common.documents", "services.common.images"} <= concepts
