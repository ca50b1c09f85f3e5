"""Print the longest functions and the largest modules of the project (issue #23's size checks).

Usage: python scripts/longest_functions.py [-n 10] [PATH ...]   (default paths: services schemas)
A function's length is its lines from ``def`` (decorators excluded) to its last line, nested
functions counted inside their parent and also on their own; a module's is its line count (``wc -l``).
Lines printed: ``file:line name lines``. The house limits: functions under 100 lines, modules 600.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def functions(path: Path) -> list[tuple[int, str, int]]:
    """``(line, qualified name, lines)`` of every function and method in the file at ``path``."""
    out = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((child.lineno, name, child.end_lineno - child.lineno + 1))
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(), str(path)), "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10, help="how many of each to print (default 10)")
    ap.add_argument("paths", nargs="*", default=["services", "schemas"], help="folders or files, from the repo root")
    args = ap.parse_args()
    files = sorted({f for p in args.paths for f in ([ROOT / p] if p.endswith(".py") else (ROOT / p).rglob("*.py"))})
    funcs = [(n, f.relative_to(ROOT).as_posix(), line, name) for f in files for line, name, n in functions(f)]
    print(f"longest {args.n} functions (of {len(funcs)}):")
    for n, rel, line, name in sorted(funcs, reverse=True)[: args.n]:
        print(f"  {rel}:{line} {name} {n}")
    sizes = sorted(((len(f.read_text().splitlines()), f.relative_to(ROOT).as_posix()) for f in files), reverse=True)
    print(f"largest {args.n} modules (of {len(sizes)}), lines:")
    for n, rel in sizes[: args.n]:
        print(f"  {rel} {n}")


if __name__ == "__main__":
    main()
