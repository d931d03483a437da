"""The reliability cases: a pytest plugin (tests/conftest.py registers it).

Mark a test (or a pytest.param) with

    @pytest.mark.reliability(area="latency table", case="all-zero coefficients",
                             expect="refused: error names the table and the coefficient")

and it is one case of RELIABILITY.md's area "latency table": the page says, per area, what was
tried, how many cases and what happens, and tests/unit/test_reliability_page.py checks its counts
against the marked tests. `make reliability` (``SB_RELIABILITY_REPORT=out/reliability.md pytest -m
reliability tests``) writes every case with the outcome this run observed to that file, which is
not committed. ``SB_RELIABILITY_CASES=PATH`` writes the collected cases as JSON (the page's test
collects them so when its own session did not collect the whole suite).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

CASES = pytest.StashKey[list]()
"""Every collected reliability case, before ``-m`` or ``-k`` deselects: dicts of area, nodeid,
slow (runs only with SB_SLOW_TESTS=1)."""

_ROWS: list = []


def case_of(item) -> dict | None:
    mark = item.get_closest_marker("reliability")
    if mark is None:
        return None
    return {"area": mark.kwargs.get("area", "?"), "nodeid": item.nodeid,
            "slow": item.get_closest_marker("slow") is not None}


def counts(cases: list) -> tuple[Counter, int]:
    """(cases per area, cases that run only with SB_SLOW_TESTS=1)."""
    return Counter(c["area"] for c in cases), sum(c["slow"] for c in cases)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    cases = [c for c in map(case_of, items) if c is not None]
    config.stash[CASES] = cases
    path = os.environ.get("SB_RELIABILITY_CASES")
    if path:
        Path(path).write_text(json.dumps(cases))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    mark = item.get_closest_marker("reliability")
    if mark is not None and (rep.when == "call" or (rep.when == "setup" and rep.skipped)):
        kw = mark.kwargs
        _ROWS.append((kw.get("area", "?"), kw.get("case", item.name), kw.get("expect", ""),
                      rep.outcome, item.nodeid))


def table(rows: list) -> str:
    """The per-case table: area, input or fault, expected outcome, observed, test."""
    verdict = {"passed": "as expected", "failed": "NOT as expected", "skipped": "not run here"}
    lines = ["# Reliability: every case, as this run observed it", "",
             "Written by `make reliability` (`SB_RELIABILITY_REPORT=out/reliability.md pytest -m "
             "reliability tests`); not committed. RELIABILITY.md says per area what was tried. "
             "Every row is a test that feeds the input or injects the fault and asserts the "
             "expected outcome; the observed column is this run's.", "",
             "| area | input or fault | expected outcome | observed | test |",
             "|---|---|---|---|---|"]
    for area, case, expect, outcome, nodeid in sorted(rows):
        lines.append(f"| {area} | {case} | {expect} | {verdict.get(outcome, outcome)} | "
                     f"`{nodeid}` |")
    by_area = Counter(r[0] for r in rows)
    n_bad = sum(1 for r in rows if r[3] == "failed")
    n_skip = sum(1 for r in rows if r[3] == "skipped")
    lines += ["", f"{len(rows)} cases in {len(by_area)} areas, {n_bad} not as expected, "
              f"{n_skip} not run here.", "", "| area | cases |", "|---|---:|"]
    lines += [f"| {a} | {n} |" for a, n in sorted(by_area.items())]
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("SB_RELIABILITY_REPORT")
    if path and _ROWS:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(table(_ROWS))
