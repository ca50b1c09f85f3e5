"""The docs stay true to the code and to each other: the generated settings table matches the
settings classes, every relative link resolves, and the README stays a front page."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

#: Files other branches of this round add; a link to one is accepted while it is missing (and
#: checked like any other once it exists). Drop an entry when its file has landed.
PENDING = {"docs/errors.md"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def doc_files() -> list[Path]:
    """README.md, docs/*.md and bench/README.md."""
    return [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-``/``_`` dropped, spaces to ``-``."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (duplicates get GitHub's ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_settings_table_is_current():
    res = subprocess.run([sys.executable, "scripts/settings_table.py", "--check"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_settings_table_refuses_a_file_without_markers(tmp_path):
    """The table moved out of README.md: `--write README.md` must not append a table to it."""
    readme = tmp_path / "README.md"
    readme.write_text("# front page\n")
    res = subprocess.run([sys.executable, "scripts/settings_table.py", "--write", str(readme)], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "no <!-- settings:begin -->" in res.stderr
    assert readme.read_text() == "# front page\n"
