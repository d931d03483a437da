"""``scripts/bench.py planner_ab``: the draft loop it times is deterministic (the same plans'
hash twice, in this process and in a checkout's subprocess), and a directory that is no
checkout is refused by name before any loop runs. No assertion reads a clock's value."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from studies import planner_ab  # noqa: E402


def test_the_draft_loop_plans_the_same_in_process_and_in_a_checkouts_subprocess():
    here = planner_ab.draft_loop(steps=2, dp=4)
    assert len(here["draft_ms"]) == 1 and len(here["plans_sha256"]) == 16
    assert planner_ab.draft_loop(steps=2, dp=4)["plans_sha256"] == here["plans_sha256"]
    with pytest.raises(ValueError, match="steps=1"):
        planner_ab.draft_loop(steps=1, dp=4)


def test_a_checkouts_subprocess_loop_plans_what_this_process_plans():
    """``_run`` loads the checkout's package (PYTHONPATH) and study helpers in a subprocess:
    with this repository as the checkout, its plans hash as the in-process loop's."""
    out = planner_ab._run(str(REPO), 2, dp=4)
    assert len(out["draft_ms"]) == 1
    assert out["plans_sha256"] == planner_ab.draft_loop(steps=2, dp=4)["plans_sha256"]
    even = planner_ab._run(str(REPO), 2, dp=4, layout="even")   # --layout even
    assert even["plans_sha256"] == planner_ab.draft_loop(steps=2, dp=4,
                                                         layout="even")["plans_sha256"]
    assert even["plans_sha256"] != out["plans_sha256"]


@pytest.mark.reliability(area="benchmarks", case="planner_ab --other that is no checkout",
                         expect="exit 2 naming the directory")
def test_a_directory_that_is_no_checkout_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        planner_ab.main(["--other", str(tmp_path)])
    assert e.value.code == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_the_local_slowdown_is_the_draft_bursts_excess_over_the_windows_pace():
    # the estimate's arithmetic on made-up bursts (no clock): 10 bursts in 1.1 s while the
    # draft ran, 90 in 9.0 s after it: 0.1 s beyond the 0.1 s pace, of a 10.1 s window
    from studies.slowdown import local_share

    assert local_share((10, 1.1), (90, 9.0), 10.1) == pytest.approx(0.1 / 10.1)
    assert local_share((10, 1.0), (90, 9.0), 10.0) == pytest.approx(0.0, abs=1e-15)
    assert local_share((10, 1.0), (0, 0.0), 1.0) != local_share((10, 1.0), (0, 0.0), 1.0)
