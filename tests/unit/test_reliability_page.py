"""RELIABILITY.md is written by hand for a reader; what it counts is the suite's. Its tables' areas
and case counts, and its totals, are those of the tests marked ``reliability``
(tests/reliability.py), and the page stays short enough to read in five minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.reliability import CASES, counts, table

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "RELIABILITY.md"
ROW = re.compile(r"^\| (?P<area>[^|`]+?) \| (?P<n>\d+) \|", re.M)
TOTAL = re.compile(r"(\d+) cases in (\d+) areas; (\d+) of them run only with `SB_SLOW_TESTS=1`")


def _whole_suite(config) -> bool:
    """This session collected every test (``pytest tests``, or ``pytest`` from the repository)."""
    args = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [REPO / "tests"]
    return all(a in (REPO, REPO / "tests") for a in args)


@pytest.fixture(scope="module")
def cases(request, tmp_path_factory) -> list:
    if _whole_suite(request.config) and CASES in request.config.stash:
        return request.config.stash[CASES]
    out = tmp_path_factory.mktemp("reliability") / "cases.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:cacheprovider", "-p", "no:xdist", "tests"], cwd=REPO,
                       env={**os.environ, "SB_RELIABILITY_CASES": str(out)},
                       capture_output=True, text=True)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


def stated(text: str) -> Counter:
    got = Counter()
    for m in ROW.finditer(text):
        assert m["area"] not in got, f"RELIABILITY.md lists the area {m['area']!r} twice"
        got[m["area"]] = int(m["n"])
    return got


def test_page_counts_match_the_marked_tests(cases):
    by_area, slow = counts(cases)
    assert len(cases) >= 100, f"only {len(cases)} reliability cases collected: the scan broke"
    text = PAGE.read_text()
    page = stated(text)
    assert page == by_area, (
        "RELIABILITY.md's table differs from the tests marked reliability: "
        + "; ".join(f"{a}: page {page.get(a, 'missing')}, tests {by_area.get(a, 'none')}"
                    for a in sorted(set(page) | set(by_area)) if page.get(a) != by_area.get(a)))
    total = TOTAL.search(text)
    assert total, "RELIABILITY.md does not say 'N cases in M areas; K of them run only with ...'"
    assert tuple(map(int, total.groups())) == (len(cases), len(by_area), slow)


def test_page_reads_in_five_minutes():
    words = len(PAGE.read_text().split())
    assert words <= 1600, f"RELIABILITY.md has {words} words: about 300 a minute, five minutes"


def test_the_table_file_and_the_parsers():
    rows = [("b", "x", "y", "passed", "t::1"), ("a", "x", "y", "failed", "t::2"),
            ("a", "z", "y", "skipped", "t::3")]
    out = table(rows)
    assert out.index("| a | x |") < out.index("| b | x |")
    assert "3 cases in 2 areas, 1 not as expected, 1 not run here." in out
    assert "NOT as expected" in out and "not run here" in out
    assert stated(out) == Counter({"a": 2, "b": 1})    # its area table parses as the page's does
    cases = [{"area": "a", "nodeid": "t::1", "slow": True}, {"area": "a", "nodeid": "t::2",
                                                            "slow": False}]
    assert counts(cases) == (Counter({"a": 2}), 1)
