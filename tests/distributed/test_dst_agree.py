"""The decomposed DST's rounds over real process groups (issue 77): 4 gloo processes, each
planning only its own DP rank's slice, the reductions all-reduced (``megatron/step/agreement``),
must end with the plan the in-process driver makes from the whole step (the same grid indices,
the same report up to a sum's rounding), every rank of a DP rank's pipeline with the same rows,
and a rank sending the same bytes a round at DP 2 and DP 4. SAB's agreement over the same groups
(``batching.sab_rounds``) must be the one made from every rank's units, and each rank's packing
its row of ``sab_plan``."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import spawn

pytestmark = pytest.mark.distributed

WORLD, M, PP = 4, 6, 3


def _costs(dp: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_policy_dst import D0, DMAX, DMIN, _quality, synthetic_costs

    from sparsebalance_megatron.policy import DSTSettings

    costs = synthetic_costs(dp, M, PP, seed=7 + dp, lm_head=2.0)
    sens = np.random.default_rng(dp).random((dp, M))
    # speed worth any loss the model allows: the descent's probes, not the plan without cuts
    # (the last rule's own test: tests/unit/test_dst_quality.py), decide these plans
    settings = DSTSettings(D0, DMIN, DMAX, density_floor=0.9, stage_density_floor=0.75,
                           exchange_rate=1e9)
    return costs, sens, settings, _quality(PP)


def _step(dp: int, objective: str):
    """A step's two packings (SAB's, Megatron's sequential) of long-tailed documents on an
    analytic PP 2 latency model, with a sensitivity tracker that has seen them: every rank
    builds the same."""
    from sparsebalance_megatron.batching import (SensitivityTracker, latency_sample_cost_fn,
                                                 sab_plan, sequential_plan)
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency import LatencyModel, ModelShape

    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=2)
    rng = np.random.default_rng(dp)
    lengths = np.minimum(rng.pareto(1.1, size=40 * dp) * 600 + 64, 8000).astype(np.int64)
    lengths = lengths[np.cumsum(lengths) <= 0.6 * dp * 4 * 8192]    # sequential fill fits too
    kw = dict(dp=dp, num_microbatches=4, max_tokens=8192)
    sb = SparseBalanceConfig(sparse_balance=True, density=0.5, dst_objective=objective)
    packings = [sab_plan(lengths, cost_fn=latency_sample_cost_fn(lm, 0.5), **kw),
                sequential_plan(lengths, **kw)]
    tracker = SensitivityTracker()
    segs = packings[0].segment_array()
    tracker.update(segs[:, 0], segs[:, 2] - segs[:, 1], rng.uniform(1, 3, len(segs)))
    options = [(b, lm.unit_features(b.unit_csr(with_padding=True))) for b in packings]
    return sb, lm, tracker, options


def _choices(rank: int, group, dp: int) -> dict:
    from sparsebalance_megatron.megatron.step.choice import choose
    from sparsebalance_megatron.megatron.step.agreement import DPReducer

    out = {}
    for objective in ("quality", "density"):
        sb, lm, tracker, options = _step(dp, objective)
        out[objective] = choose(sb, lm, options, dp, tracker=tracker, dst=True,
                                raise_headroom=0.05, stage_layers=[4, 4], rank=rank,
                                agree=DPReducer(group))
    return out


def _sab(dp: int):
    """A step's SAB assignment every rank builds alike (sab_plan's)."""
    from sparsebalance_megatron.batching import latency_sample_cost_fn, sab_plan
    from sparsebalance_megatron.batching.packing import sab_assignment
    from sparsebalance_megatron.latency import LatencyModel, ModelShape

    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=2)
    lengths = np.minimum(np.random.default_rng(dp).pareto(1.1, size=40 * dp) * 600 + 64,
                         8000).astype(np.int64)
    lengths = lengths[np.cumsum(lengths) <= 0.6 * dp * 4 * 8192]
    kw = dict(dp=dp, num_microbatches=4, max_tokens=8192, cost_fn=latency_sample_cost_fn(lm, 0.5))
    return sab_assignment(lengths, **kw), sab_plan(lengths, **kw)


def _sab_rows(rank: int, group, dp: int):
    """(this rank's row after the agreement over ``group``, the bytes of its rounds)."""
    from sparsebalance_megatron.batching.sab_rounds import agreement_rounds
    from sparsebalance_megatron.megatron.step.agreement import DPReducer, drive

    asg, _ = _sab(dp)
    mine = asg.units([rank])
    reducer = DPReducer(group)
    agreed = drive(agreement_rounds(asg, mine), reducer)
    return asg.rank_plan(mine, agreed).micro_batches[0], reducer.sent


def _drafter(dp: int, objective: str):
    """The runtime's Drafter of a step every rank builds alike (SAB, the stand-down's baseline,
    DST with ``objective``), and the step's segments (the sampler's array)."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency import LatencyModel, ModelShape
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=2)
    rng = np.random.default_rng(10 + dp)
    lengths = np.minimum(rng.pareto(1.1, size=40 * dp) * 600 + 64, 8000).astype(np.int64)
    lengths = lengths[np.cumsum(lengths) <= 0.6 * dp * 4 * 8192]
    segs = np.stack([np.arange(lengths.size), np.zeros_like(lengths), lengths], axis=1)
    tracker = SensitivityTracker()
    tracker.update(segs[::2, 0], lengths[::2], rng.uniform(1, 3, segs[::2].shape[0]))
    # the quality objective's runs record every unit (--sb-metrics-file: the rows gathered)
    sb = SparseBalanceConfig(sparse_balance=True, density=0.5, dst_objective=objective,
                             metrics_file="metrics.jsonl" if objective == "quality" else None)
    return Drafter(sb, lm, tracker, dp=dp, capacity=8192, attention_layers=[4, 4]), segs


def _own_drafts(rank: int, group, dp: int) -> dict:
    """This rank's own draft settled over ``group``: (its rows, densities, report's do-no-harm
    record and planned step) per objective."""
    from sparsebalance_megatron.megatron.step.agreement import DPReducer

    out = {}
    for objective in ("quality", "density"):
        drafter, segs = _drafter(dp, objective)
        draft = drafter.draft(1, 0, segs, 4, with_dst=False, rank=rank)
        dens, report = drafter.settle(draft, rank=rank, agree=DPReducer(group))
        batch = draft.packing(report["stand_down"]["packing_index"])[0]
        out[objective] = (list(batch.micro_batches), np.asarray(dens), report["stand_down"],
                          report["step_time_planned_s"], draft.predicted_busy,
                          report["unit_sensitivity"])
    return out


def _worker(rank: int, init_file: str, out_dir: str):
    import torch.distributed as dist

    from sparsebalance_megatron.megatron.step.agreement import plan_rank
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
                         candidate=plan.candidate, probe=plan.probe, sent=reducer.sent,
                         choices=_choices(r, group, dp))
        out[name]["sab"] = _sab_rows(r, group, dp)
        out[name]["own"] = _own_drafts(r, group, dp)
    with open(f"{out_dir}/{rank}.pkl", "wb") as f:
        pickle.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What every one of the 4 processes planned (one spawn for the module's tests)."""
    tmp = tmp_path_factory.mktemp("dst_agree")
    spawn(_worker, WORLD, str(tmp / "rendezvous"), str(tmp), cwd=tmp)
    return [pickle.loads((tmp / f"{r}.pkl").read_bytes()) for r in range(WORLD)]


def test_the_rounds_over_the_dp_group_make_the_in_process_plan(runs):
    from sparsebalance_megatron.policy.dst_rounds import plan_dst

    probes = []
    for name, dp in (("pp2_dp2", 2), ("dp4", 4)):
        costs, sens, settings, quality = _costs(dp)
        want = plan_dst(costs, sens, settings, quality=quality)
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
                assert mine[key] == pytest.approx(value, rel=1e-12, abs=1e-15, nan_ok=True), key
            elif isinstance(value, str):
                assert mine[key] == value, key
            else:
                assert mine[key] == pytest.approx(value, rel=1e-12), key
        probes.append(got[0]["probe"])
    assert max(probes) >= 0                     # some rank kept a probe: every round ran
    # bytes a rank sent a round: the same at DP 2 and DP 4 (the rounds both took)
    a, b = runs[0]["pp2_dp2"]["sent"], runs[0]["dp4"]["sent"]
    n = min(len(a), len(b))
    assert n >= 5 and a[:n] == b[:n], (a, b)


def _choice_in_process(dp: int, objective: str):
    """The same step chosen in one process: the whole step's costs, the do-no-harm rule on
    them, each packing's DST made by the in-process driver (the same rounds)."""
    from sparsebalance_megatron.batching.sensitivity import unit_sensitivity
    from sparsebalance_megatron.policy.costs import UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst_settings import dst_inputs
    from sparsebalance_megatron.policy.dst_rounds import plan_dst
    from sparsebalance_megatron.policy.stand_down import choose_step

    sb, lm, tracker, options = _step(dp, objective)
    grid = density_grid(sb.density, sb.min_density, sb.max_density)
    costs = [UnitCosts.from_latency(lm, u, dp, b.num_microbatches, grid,
                                    kept_units=b.unit_csr()) for b, u in options]
    settings, quality = dst_inputs(sb, 2, lm.p2p_s, 0.05, [4, 4])

    def plan_fn(i, c):
        p = plan_dst(c, unit_sensitivity(options[i][0], tracker), settings,
                                quality=quality, rank_scale=lm.correction_grid(dp, 2))
        return p.densities, p
    return choose_step(costs, sb.density, lm.p2p_s, plan_fn, compare=sb.stand_down_compare)


def test_a_ranks_choice_over_the_dp_group_is_the_whole_steps(runs):
    """``choice.choose`` with a rank and the DP group's reductions: the rank prices and plans
    only its own units, and every rank ends with the whole step's choice (packing, plan,
    do-no-harm verdicts) as one process makes it from every rank's costs."""
    moved = 0
    for name, dp in (("pp2_dp2", 2), ("dp4", 4)):
        for objective in ("quality", "density"):
            want = _choice_in_process(dp, objective)
            for run in runs:
                dens, report, record = run[name]["choices"][objective]
                assert record["packing_index"] == want.index
                assert record["dst_stood_down"] == want.outcome.dst_stood_down
                assert record["predicted_step_s"] == pytest.approx(want.step_s, rel=1e-12)
                np.testing.assert_array_equal(np.asarray(dens), want.outcome.densities)
                assert report["step_time_planned_s"] == pytest.approx(want.outcome.step_s,
                                                                      rel=1e-12)
                assert np.shape(report["predicted_busy_s"]) == (dp, 2)
                assert np.shape(report["unit_sensitivity"]) == (dp, 4)
                moved += report["units_cut"] + report["units_raised"]
    assert moved > 0                            # DST moved densities: the plans say something


def test_sabs_agreement_over_the_dp_group_packs_each_ranks_row(runs):
    """Each rank packs only its own micro-batches and agrees the candidates' over the group:
    its row is ``sab_plan``'s (two rounds: a flag, counts and the makespans; the candidates'
    block)."""
    for name, dp in (("pp2_dp2", 2), ("dp4", 4)):
        _, whole = _sab(dp)
        for run in runs:
            row, sent = run[name]["sab"]
            assert row == whole.micro_batches[run[name]["dp_rank"]], name
            assert len(sent) == 2, sent   # round 1: max; round 2: sum (DP <= 38: all candidates)


def test_a_ranks_own_draft_settles_to_its_row_of_the_whole_steps(runs):
    """``Drafter.draft(rank=r)`` packs only the rank's SAB units and its baseline row, and
    ``settle`` agrees SAB, the do-no-harm race and DST over the group: the rank commits its row
    of what the whole-step draft commits (the same packing chosen, the same micro-batches, the
    same densities, the same planned step) and its predicted busy seconds (what it calibrates
    its own pipeline with); with --sb-metrics-file every rank's rows gathered are the whole
    step's (densities, sensitivities)."""
    for name, dp in (("pp2_dp2", 2), ("dp4", 4)):
        for objective in ("quality", "density"):
            drafter, segs = _drafter(dp, objective)
            whole = drafter.draft(1, 0, segs, 4, with_dst=True)
            dens, report = whole.payload
            index = report["stand_down"]["packing_index"]
            batch = whole.packing(index)[0]
            for run in runs:
                rows, got, record, step_s, busy, sens = run[name]["own"][objective]
                r = run[name]["dp_rank"]
                assert record["packing_index"] == index, (name, objective)
                assert rows == [batch.micro_batches[r]], (name, objective, r)
                if objective == "quality":   # --sb-metrics-file: every rank's rows gathered
                    np.testing.assert_array_equal(got, np.asarray(dens))
                    assert sens == report["unit_sensitivity"]
                else:                        # its own rows alone, no sensitivities reported
                    np.testing.assert_array_equal(got, np.asarray(dens)[r:r + 1])
                    assert sens is None
                np.testing.assert_array_equal(busy,
                                              np.asarray(report["predicted_busy_s"])[r:r + 1])
                assert step_s == pytest.approx(report["step_time_planned_s"], rel=1e-12)
