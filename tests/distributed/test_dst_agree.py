"""The decomposed DST's rounds over real process groups (issue 77): 4 gloo processes, each
planning only its own DP rank's slice, the reductions all-reduced (``megatron/step/dst_agree``),
must end with the plan the in-process driver makes from the whole step (the same grid indices,
the same report up to a sum's rounding), every rank of a DP rank's pipeline with the same rows,
and a rank sending the same bytes a round at DP 2 and DP 4."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.distributed

WORLD, M, PP = 4, 6, 3


def _costs(dp: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_policy_dst import D0, DMAX, DMIN, _quality, synthetic_costs

    from sparsebalance_megatron.policy import DSTSettings

    costs = synthetic_costs(dp, M, PP, seed=7 + dp, lm_head=2.0)
    sens = np.random.default_rng(dp).random((dp, M))
    settings = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75)
    return costs, sens, settings, _quality(PP)


def _worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as dist

    from sparsebalance_megatron.megatron.step.dst_agree import plan_rank
    from sparsebalance_megatron.policy.dst_ranks import rank_slice

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    # PP 2 x DP 2 (Megatron's order: the DP rank varies fastest), then the whole world as DP 4;
    # every rank makes every group, in the same order
    stages = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    world = dist.new_group(list(range(WORLD)), backend="gloo")
    out = {}
    for name, dp, r, group in (("pp2_dp2", 2, rank % 2, stages[rank // 2]),
                               ("dp4", 4, rank, world)):
        costs, sens, settings, quality = _costs(dp)
        plan, reducer = plan_rank(rank_slice(costs, r), sens[r:r + 1], settings, group,
                                  quality=quality)
        out[name] = dict(dp_rank=r, index=plan.grid_index, report=plan.report,
                         candidate=plan.candidate, probe=plan.probe, sent=reducer.sent)
    with open(f"{out_dir}/{rank}.pkl", "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


def test_the_rounds_over_the_dp_group_make_the_in_process_plan(tmp_path):
    import torch.multiprocessing as mp

    from sparsebalance_megatron.policy.dst_ranks_local import plan_dst_decomposed

    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD,
             join=True)
    runs = [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in range(WORLD)]
    probes = []
    for name, dp in (("pp2_dp2", 2), ("dp4", 4)):
        costs, sens, settings, quality = _costs(dp)
        want = plan_dst_decomposed(costs, sens, settings, quality=quality)
        got = {}
        for run in runs:
            x = run[name]
            if x["dp_rank"] in got:             # the other stage of this DP rank: the same
                np.testing.assert_array_equal(x["index"], got[x["dp_rank"]]["index"])
                assert x["report"] == got[x["dp_rank"]]["report"]
            got[x["dp_rank"]] = x
        idx = np.concatenate([got[r]["index"] for r in range(dp)])
        np.testing.assert_array_equal(idx, want.grid_index)
        assert len({(x["candidate"], x["probe"]) for x in got.values()}) == 1
        mine, ref = got[0]["report"].as_dict(), want.report.as_dict()
        for key, value in ref.items():
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
            else:
                assert mine[key] == pytest.approx(value, rel=1e-12), key
        probes.append(got[0]["probe"])
    assert max(probes) >= 0                     # some rank kept a probe: every round ran
    # bytes a rank sent a round: the same at DP 2 and DP 4 (the rounds both took)
    a, b = runs[0]["pp2_dp2"]["sent"], runs[0]["dp4"]["sent"]
    n = min(len(a), len(b))
    assert n >= 5 and a[:n] == b[:n], (a, b)
