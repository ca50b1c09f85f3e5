"""The docs stay true to the code and to each other: the generated settings table matches the
settings classes, every relative link resolves, and the README stays a front page."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

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


def test_every_relative_link_resolves():
    broken = []
    for path in doc_files():
        text = FENCE.sub("", path.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            rel = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest
            if not dest.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no {rel})")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(REPO)}: {target} (no heading #{anchor} in {rel})")
    assert not broken, "\n".join(broken)


def test_every_docs_file_is_in_the_index():
    index = (REPO / "docs" / "README.md").read_text()
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md"))
               if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_readme_is_a_front_page_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "bash scripts/ocr.sh" in text and "bash scripts/test.sh" in text
    assert "exec bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()  # the README says .ci/run calls it
    setup = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", re.sub(r"(?m)^== .*$", "", setup)), "a commit hash in the set-up"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", setup), "a date in the set-up section"
