"""A reader following the docs finds what they point to.

- every relative link (``[text](path)``, ``[id]: path``) in the repository's Markdown resolves,
  its ``#anchor`` included when it points into a Markdown page;
- every result JSON a page or the code names by path (``docs/results/NAME.json``, globs and
  ``{a,b}`` included) is in the tree, or the text names the commit git keeps it at: ``PATH at
  <commit>`` in the same paragraph, or, on a page of docs/history, the page's own line "git keeps
  them at <commit>";
- every JSON under docs/results is cited by a current page (docs/history's pages do not count:
  what only history cites has left the tree), and every JSON under docs/history by some page.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS, HISTORY = REPO / "docs/results", REPO / "docs/history"
SKIP_DIRS = {"runs", "out", "checkpoints", "build", "dist", "__pycache__", "node_modules"}
CODE_DIRS = ("sparsebalance_megatron", "scripts", "tests", "examples", "patches")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# a result JSON named by path; NAME may hold globs and {a,b}; an all-capitals NAME is a placeholder
JSON_PATH = re.compile(r"(?<![\w/.-])(docs/(?:history/)?results/)([\w.*?{},-]+\.json)")
JSON_NAME = re.compile(r"(?<![\w.-])([\w.*?{},-]+\.json)")
AT_COMMIT = re.compile(r"\bat\s+([0-9a-f]{7,40})\b")
PAGE_COMMIT = re.compile(r"git keeps them at\s+([0-9a-f]{7,40})")


def _skipped(p: Path) -> bool:
    parts = p.relative_to(REPO).parts
    return any(x.startswith(".") or x in SKIP_DIRS or x.endswith(".egg-info") for x in parts)


def pages() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.md") if not _skipped(p))


def code_files() -> list[Path]:
    files = [REPO / "Makefile"]
    for d in CODE_DIRS:
        files += sorted(p for p in (REPO / d).rglob("*") if p.is_file() and not _skipped(p)
                        and p.suffix in (".py", ".sh") and p != Path(__file__).resolve())
    return files


def is_history(page: Path) -> bool:
    return HISTORY in page.parents


def expand(name: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd`` (every brace group)."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"`|\*\*?|__?|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict = {}
    out = set()
    for m in HEADING.finditer(text):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return [m.group(1) for m in itertools.chain(INLINE_LINK.finditer(text), REF_LINK.finditer(text))]


def broken_link(page: Path, target: str) -> str | None:
    if re.match(r"[a-zA-Z][\w+.-]*:", target):          # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
        return f"no heading #{anchor}"
    return None


def in_tree(folder: str, name: str) -> bool:
    """Every name ``name`` expands to (globs matched) is a file of ``folder``."""
    d = REPO / folder
    present = [p.name for p in d.glob("*.json")] if d.is_dir() else []
    return all(any(fnmatch.fnmatchcase(p, n) for p in present) for n in expand(name))


def json_citations(path: Path, text: str):
    """(folder, NAME, commits) for each result JSON ``path`` names by path. The commits that may
    hold it: on a docs/history page, the page's line "git keeps them at <commit>" first; then every
    "at <commit>" after the path in its paragraph."""
    page = PAGE_COMMIT.search(text) if path.suffix == ".md" and is_history(path) else None
    for para in re.split(r"\n\s*\n", text):
        for m in JSON_PATH.finditer(para):
            folder, name = m.group(1).rstrip("/"), m.group(2)
            if re.fullmatch(r"[A-Z_]+\.json", name):
                continue
            after = [a.group(1) for a in AT_COMMIT.finditer(para, m.end())]
            yield folder, name, ([page.group(1)] if page else []) + after


def unresolved_citations() -> list:
    """(file, folder, NAME, commits) for each path-named JSON not in the tree."""
    out = []
    for f in pages() + code_files():
        for folder, name, commits in json_citations(f, f.read_text(encoding="utf-8",
                                                                   errors="replace")):
            if not in_tree(folder, name):
                out.append((f.relative_to(REPO).as_posix(), folder, name, commits))
    return out


def cited_names(history: bool) -> set:
    """Every ``*.json`` token (globs and braces expanded) on the current pages, or on all pages."""
    names = set()
    for p in pages():
        if history or not is_history(p):
            for m in JSON_NAME.finditer(p.read_text(encoding="utf-8")):
                names.update(expand(m.group(1)))
    return names


def uncited(folder: Path, names: set) -> list:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.json")
                  if not any(fnmatch.fnmatchcase(p.name, n) for n in names))


def test_relative_links_resolve():
    checked, bad = 0, []
    for page in pages():
        for target in links(page):
            checked += 1
            why = broken_link(page, target)
            if why:
                bad.append(f"{page.relative_to(REPO)}: ({target}) {why}")
    assert checked >= 50, f"only {checked} links found in {len(pages())} pages: the scan broke"
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_cited_result_jsons_are_in_the_tree_or_named_with_their_commit():
    bad = [f"{f}: {folder}/{name}" for f, folder, name, commits in unresolved_citations()
           if not commits]
    assert not bad, ("named by path, not in the tree and no commit named (`PATH at <commit>`, or "
                     "on a docs/history page its line 'git keeps them at <commit>'):\n"
                     + "\n".join(bad))


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


@lru_cache(maxsize=None)
def _tree_at(commit: str, folder: str) -> tuple | None:
    """The file names of ``folder`` at ``commit``; None where this clone lacks the commit."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    r = _git("ls-tree", "--name-only", f"{commit}:{folder}")
    return tuple(r.stdout.split()) if r.returncode == 0 else ()


def test_commits_named_for_left_jsons_hold_them():
    cites = [c for c in unresolved_citations() if c[3]]
    if not any(_tree_at(c, folder) is not None for _, folder, _, commits in cites for c in commits):
        pytest.skip("this clone has none of the commits the docs name (a shallow clone?)")
    bad = []
    for f, folder, name, commits in cites:
        trees = [t for t in (_tree_at(c, folder) for c in commits) if t is not None]
        if trees and not any(all(any(fnmatch.fnmatchcase(n, x) for n in t) for x in expand(name))
                             for t in trees):
            bad.append(f"{f}: {folder}/{name} is at none of {commits}")
    assert not bad, "\n".join(bad)


def test_every_result_json_is_cited():
    current, every = cited_names(history=False), cited_names(history=True)
    assert len(current) >= 30, f"only {len(current)} JSON names on the current pages: the scan broke"
    bad = ([f"docs/results/{p}" for p in uncited(RESULTS, current)]
           + [f"docs/history/{p}" for p in uncited(HISTORY, every)])
    assert not bad, ("no page cites these (docs/results: no current page; docs/history: no page); "
                     "cite them or let them leave the tree:\n" + "\n".join(bad))


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = REPO / "docs/history/BENCHMARKS-2026-11.md"    # a history page: "git keeps them at"
    assert expand("a{b,c}_{1,2}.json") == ["ab_1.json", "ab_2.json", "ac_1.json", "ac_2.json"]
    assert slug("## 5. The `kernels/` room, **twice**".lstrip("# ")) == "5-the-kernels-room-twice"
    text = ("see docs/results/gone.json at abc1234 and docs/results/also_gone.json.\n\n"
            "docs/history/results/g*.json, docs/results/NAME.json\n")
    assert list(json_citations(REPO / "README.md", text)) == [
        ("docs/results", "gone.json", ["abc1234"]), ("docs/results", "also_gone.json", []),
        ("docs/history/results", "g*.json", [])]
    assert [c[2] for c in json_citations(page, text + "\ngit keeps them at 1234567\n")] == [
        ["1234567", "abc1234"], ["1234567"], ["1234567"]]
    assert not in_tree("docs/results", "surely_not_here_{a,b}.json")
    assert broken_link(REPO / "README.md", "docs/no_such_page" + ".md") == "no such file"
    assert broken_link(REPO / "README.md", "#no-such-heading-here") == "no heading #no-such-heading-here"
    assert broken_link(REPO / "README.md", "https://example.com/x.md") is None
    (tmp_path / "a_1.json").write_text("{}")
    assert uncited(tmp_path, {"b*.json"}) == ["a_1.json"]
    assert uncited(tmp_path, {"a_*.json"}) == []
