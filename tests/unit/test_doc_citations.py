"""Every Markdown page the repository cites exists in it, and every "docs/DESIGN.md section N"
names a section that page has: a reader following a citation finds what it points to."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("sparsebalance_megatron", "scripts", "tests", "examples", "patches", "docs")
CODE_FILES = ("Makefile", "setup.py", "pytest.ini")
# a path ending in .md that starts a token (not the tail of a URL or of a longer path)
MD_PATH = re.compile(r"(?<![\w/:.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
GENERATED = ("out/",)   # written by make targets (make reliability), gitignored: not in a clone
DESIGN_SECTION = re.compile(r"docs/DESIGN\.md\s+section\s+(\d+)")


def cited_files() -> list[Path]:
    files = [REPO / f for f in CODE_FILES] + sorted(REPO.glob("*.md"))
    for d in CODE_DIRS:
        files += sorted(p for p in (REPO / d).rglob("*") if p.is_file() and p.suffix in
                        (".py", ".sh", ".md", ".patch") and "__pycache__" not in p.parts)
    return files


def test_cited_markdown_pages_exist():
    missing = []
    for f in cited_files():
        for m in MD_PATH.finditer(f.read_text(encoding="utf-8", errors="replace")):
            path = m.group(1)
            if path.startswith(GENERATED):
                continue
            if not ((REPO / path).is_file() or (f.parent / path).is_file()):
                missing.append(f"{f.relative_to(REPO)}: {path}")
    assert not missing, "cited but not in the repository: " + "; ".join(missing)


def test_cited_design_sections_exist():
    design = (REPO / "docs/DESIGN.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", design, re.M))
    assert sections, "docs/DESIGN.md has no numbered sections"
    bad, cites = [], 0
    for f in cited_files():
        for m in DESIGN_SECTION.finditer(f.read_text(encoding="utf-8", errors="replace")):
            cites += 1
            if m.group(1) not in sections:
                bad.append(f"{f.relative_to(REPO)}: section {m.group(1)}")
    assert cites >= 9, f"only {cites} citations of docs/DESIGN.md sections found: the scan broke"
    assert not bad, f"docs/DESIGN.md has sections {sorted(sections, key=int)}; cited: {bad}"
