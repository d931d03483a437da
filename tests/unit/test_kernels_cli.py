"""``python -m sparsebalance_megatron.kernels --jobs N`` (make test's first step): the rooms are
shared among the processes, each room once, the longest compiles apart; and the warm-up the
planner process runs before it says ready compiles everything a plan then runs."""

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


WARM_CHECK = r"""
import numpy as np
from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.policy import UnitCosts, density_grid
from sparsebalance_megatron.policy import DSTSettings, plan_dst
from sparsebalance_megatron import kernels
import sys
sys.path.insert(0, "tests/unit")
from test_policy_dst import _quality

from sparsebalance_megatron.batching import sab_plan, sequential_plan
from sparsebalance_megatron.batching.packing import latency_sample_cost_fn
from sparsebalance_megatron.megatron.step.planner_worker import warm_up_kernels
warm_up_kernels()                      # what the planner and training processes call
def signatures():
    import importlib
    out = {}
    for room in kernels.ROOMS:
        mod = importlib.import_module(f"sparsebalance_megatron.kernels.{room}")
        out.update({f"{room}.{k}": len(v.signatures) for k, v in vars(mod).items()
                    if hasattr(v, "signatures") and v.__module__ == mod.__name__})
    return out
before = signatures()
lm = LatencyModel.analytic(ModelShape(seq_length=8192), pp=4)
rng = np.random.default_rng(1)
lengths = [rng.integers(200, 3000, rng.integers(1, 5)) for _ in range(6 * 8)]
grid = density_grid(0.5, 0.125, 1.0)
segs = [(i, 0, int(x)) for i, x in enumerate(np.concatenate(lengths))]
sab_plan(segs, dp=6, num_microbatches=8, max_tokens=8192,
         cost_fn=latency_sample_cost_fn(lm, 0.5))
sequential_plan(segs, dp=6, num_microbatches=8, max_tokens=8192)
costs = UnitCosts.from_latency(lm, lengths, 6, 8, grid)
plan_dst(costs, rng.random((6, 8)), DSTSettings(
    0.5, 0.125, 1.0, density_floor=0.9, stage_density_floor=0.75, raise_headroom=0.02),
    quality=_quality(4))
lm.calibrate_ranks(np.ones((6, 4)), np.full((6, 4), 1.1))
UnitCosts.from_latency(lm, lengths, 6, 8, grid)
from sparsebalance_megatron.data.packing import GlobalBatchSampler
GlobalBatchSampler(np.concatenate(lengths), capacity=8192, seed=0, sources=[np.arange(20),
                   np.arange(20, 30)]).next_bin_array(12)          # the step's documents
after = signatures()
assert before == after and sum(n > 0 for n in after.values()) == 20, (before, after)
print("ok")
"""


def test_warm_up_compiles_what_a_plan_runs():
    """The planner process warms the kernels up before it says it is ready: afterwards a plan
    (unit costs, the band search with water-filling, the descent) compiles nothing more, so
    no step's draft pays numba's compilation (a fresh interpreter: nothing compiled before)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    # numba's disk cache written first (a no-op when it is): from a cold cache the warm-up also
    # compiles every kernel the entry kernels call, each then counting a signature, and the
    # count below is the one a planner process sees, which loads them from the cache
    subprocess.run([sys.executable, "-c", "from sparsebalance_megatron import kernels; "
                    "kernels.warm_up()"], cwd=repo, check=True, capture_output=True, timeout=600)
    done = subprocess.run([sys.executable, "-c", WARM_CHECK], cwd=repo, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
