"""The control-plane study's per-rank measurement (``scripts/bench.py control_plane``): a rank's
draft is split into phases that add up to it, made through the package's per-rank entries (its
row is the whole plan's: the study stops otherwise), and the bytes a rank receives are fixed in
DP where the study says so and grow where it says they grow. No timing is asserted."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from studies import control_plane  # noqa: E402
from studies.drafts import OWN  # noqa: E402


@pytest.fixture(scope="module")
def points():
    return {dp: control_plane.measure_point(dp, m=4, pp=4, seq=8192) for dp in (2, 4)}


def test_a_ranks_draft_is_its_phases_and_the_same_rounds_at_dp_2_and_4(points):
    from sparsebalance_megatron.policy.dst_ranks import PHASES

    for dp, q in points.items():
        assert set(q["phases_s"]) == set(OWN) | {"busy_s"} | {f"dst.{k}" for k in PHASES}
        assert all(v >= 0 for v in q["phases_s"].values())
        assert sum(q["phases_s"].values()) == pytest.approx(q["draft_s"], abs=1e-12)
        assert 0 <= q["rank"] < dp and q["static_step_s"] > 0 and q["handoff_bytes"] > 0
        assert q["candidates"] == dp                      # few ranks: every one a candidate
        d = q["dst_rank_s"]                  # a rank's DST over ranks, the least of 3 runs each
        assert 0 < d["median"] <= d["p99"] <= d["max"]
        assert len(d["single_run_phase_maxima"]) == 3 * 2  # 3 runs x both packings
    a, b = points[2], points[4]
    # the rounds' vectors (AR1, AR2, AR3, AR3b, AR4 of SAB's packing), the row, a unit: fixed
    assert a["rounds"][:5] == b["rounds"][:5] and len(a["rounds"]) >= 10
    assert (a["row_floats"], a["unit_floats"]) == (b["row_floats"], b["unit_floats"])


def test_fixed_collectives_stay_bounded_and_growing_ones_grow_with_dp(points):
    q = points[4]
    got = {dp: {c["name"]: c for c in control_plane.rank_bytes(1, 4, dp, 4, q, 50)}
           for dp in (2, 64, 4096, 16384)}
    assert set(got[2]) == set(got[64]) == set(got[4096]) == set(got[16384])
    for name, c in got[2].items():
        mid, big, top = got[64][name], got[4096][name], got[16384][name]
        assert c["grows"] == big["grows"]
        if c["grows"]:
            assert big["bytes"] >= 1000 * c["bytes"] > 0, name
        else:      # a ring all-reduce of a vector capped in size: 2 (n - 1) / n of it (the
            # agreed medians gather each rank's few values below their cap, 2,048 floats)
            assert big["bytes"] <= top["bytes"] <= 1.05 * big["bytes"], name
            assert mid["bytes"] <= 2 * big["bytes"], name
    assert {n for n, c in got[2].items() if c["grows"]} == {"rows (--sb-metrics-file only)"}
    # the report's figures and the record's DP level: all-reduces of a few floats (issue 77)
    assert not got[4096]["report.sum"]["grows"] and got[4096]["report.max"]["bytes"] < 100
    assert not got[4096]["record.dp"]["grows"] and got[4096]["record.dp"]["bytes"] < 200


def test_the_table_and_the_simulators_rows_from_measured_points(points):
    pts = [dict(q, dp=dp) for dp, q in points.items()]
    rows, fits, _ = control_plane.build_rows(pts, 256, 4, 1)
    assert [(r["tp"], r["pp"], r["dp"]) for r in rows] == [(1, 4, 32), (1, 4, 64), (1, 8, 32)]
    assert set(fits) == set(control_plane.WORK)
    for r in rows:
        assert r["critical_path_s"] == pytest.approx(sum(r["critical_path_parts_s"].values()))
        assert r["bytes_per_rank"] == r["bytes_fixed"] + r["bytes_growing"]
        assert not r["measured"]                        # DP 32 and up: fitted from DP 2 and 4
    sim = control_plane.simulator_rows(rows)
    assert sim and all(s["tp"] == 1 and s["pp"] == 4 and s["broadcast_ms"] == 0.0 for s in sim)
    assert {"world_size", "microbatches", "gather_ms", "broadcast_ms"} <= set(sim[0])


def test_the_candidates_rounds_are_priced_from_the_rounds_made():
    """Past 2 x 19 ranks the candidates' agreement is rounds of fixed-size parts (the range, the
    refinements, the hash-slot gathers), made on the step's makespans and checked to agree
    ``slots.candidates``; the pricing adds them as all-reduces that do not grow with DP."""
    import numpy as np
    from sparsebalance_megatron.batching import span_select
    from studies.drafts import span_rounds

    assert span_rounds(np.linspace(1, 2, 38)) == []
    sizes = span_rounds(np.random.default_rng(0).lognormal(0, 0.05, 500))
    assert sizes[0] == {"sum": 0, "max": 2} and len(sizes) <= 7
    assert all(s["sum"] in (span_select.BINS, 2 * span_select.BINS, 3 * span_select.SLOTS)
               for s in sizes[1:])
    q = {"rounds": [], "unit_floats": 10, "row_floats": 10, "report_floats": {"sum": 1, "max": 1},
         "span_rounds": sizes}
    got = {dp: {c["name"]: c for c in control_plane.rank_bytes(1, 4, dp, 4, q, 5)}
           for dp in (64, 4096)}
    for op in ("sum", "max"):
        a, b = got[64][f"sab.candidate_rounds.{op}"], got[4096][f"sab.candidate_rounds.{op}"]
        assert a["count"] == b["count"] == sum(1 for s in sizes if s[op])
        assert not b["grows"] and a["bytes"] <= b["bytes"] <= 1.05 * a["bytes"]
