"""``python -m sparsebalance_megatron.kernels --jobs N`` (make test's first step): the rooms are
shared among the processes, each room once, the longest compiles apart."""

import pytest

from sparsebalance_megatron.kernels import ROOMS
from sparsebalance_megatron.kernels.__main__ import COMPILE_S, main, share


def test_every_room_is_compiled_once_and_the_load_is_shared():
    assert set(COMPILE_S) == set(ROOMS)      # a new room gets its measured compile time
    for jobs in (1, 2, 3, 20):
        groups = share(ROOMS, jobs)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(ROOMS) and len(groups) == min(jobs, len(ROOMS))
    two = [sum(COMPILE_S[r] for r in g) for g in share(ROOMS, 2)]
    assert max(two) <= 0.55 * sum(two)        # about half each
    band, descent = (next(i for i, g in enumerate(share(ROOMS, 2)) if r in g)
                     for r in ("band", "descent"))
    assert band != descent                    # the two longest in different processes


def test_jobs_below_one_is_refused_naming_the_value(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--jobs", "0"])
    assert e.value.code == 2 and "--jobs 0: expected at least 1" in capsys.readouterr().err
