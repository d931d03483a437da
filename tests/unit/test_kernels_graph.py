"""The simulator's and the descent's compiled rules (``kernels.graph``, ``kernels.grid``,
``kernels.descent``), each run in its Python form (``py_func``) and compiled, on small cases,
against brute-force oracles written here: the earliest and latest finishes relaxed to a fixed
point in an order of the oracle's own (no topological order assumed), every unit's float, the
grid search as a scan of the grid, and a descent round's cut as every fraction simulated."""

import numpy as np
import pytest

from sparsebalance_megatron.kernels import descent, graph, grid, slack
from sparsebalance_megatron.kernels.records import Tables
from sparsebalance_megatron.sim.pipeline import event_graph
from tests.unit._floats import latest_finish, unit_floats

FORMS = pytest.mark.parametrize("form", ["python", "compiled"])


def _form(fn, form):
    return fn.py_func if form == "python" else fn


def _earliest_oracle(g, dur, p):
    """Every event's start max(dependency's finish (+ p2p across ranks), previous event's
    finish), NaN winning, relaxed until no event changes, events visited last to first."""
    prev, dep, cross = g.links[:3]
    ef, start = np.full(dur.shape, -np.inf), np.zeros(dur.shape)
    while True:
        before = ef.copy()
        for e in reversed(range(g.ranks.size)):
            ins = [ef[dep[e]] + (p if cross[e] else 0.0)] if dep[e] >= 0 else []
            ins += [ef[prev[e]]] if prev[e] >= 0 else []
            start[e] = np.maximum(*ins) if len(ins) == 2 else (ins[0] if ins else 0.0)
            ef[e] = start[e] + dur[e]
        if np.array_equal(before, ef, equal_nan=True):
            return ef, start


def _latest_oracle(g, dur, deadline, p):
    """Every event's latest finish min(deadline, next event's latest start, its successor's
    latest start (- p2p across ranks)), NaN winning, relaxed to a fixed point first to last."""
    cross, nxt, succ = g.links[2:5]
    lf = np.full(dur.shape, np.inf)
    while True:
        before = lf.copy()
        for e in range(g.ranks.size):
            v = deadline.astype(np.float64)
            if nxt[e] >= 0:
                v = np.minimum(v, lf[nxt[e]] - dur[nxt[e]])
            if succ[e] >= 0:
                v = np.minimum(v, lf[succ[e]] - dur[succ[e]] - (p if cross[succ[e]] else 0.0))
            lf[e] = v
        if np.array_equal(before, lf, equal_nan=True):
            return lf


@FORMS
@pytest.mark.parametrize("m, pp, vp", [(4, 2, 1), (5, 3, 1), (4, 2, 2), (1, 2, 1), (3, 1, 1)])
def test_event_passes_are_the_relaxed_fixed_point(form, m, pp, vp):
    """Earliest finishes and starts (all columns or some), makespans, latest finishes and the
    units' floats, with p2p latency or none, a NaN duration, one deadline per column."""
    g = event_graph(m, pp, vp)
    rec = g.record(0.0)
    rng = np.random.default_rng(m * 100 + pp * 10 + vp)
    for p in (0.0, 2.5e-3):
        rec = rec._replace(p2p=p)
        dur = rng.random((g.ranks.size, 4)) * (rng.random((g.ranks.size, 4)) > 0.1)
        dur[rng.integers(g.ranks.size), 3] = np.nan                 # NaN spreads as np.maximum's
        want, want_start = _earliest_oracle(g, dur, p)
        end, start = np.zeros(dur.shape), np.zeros(dur.shape)
        _form(graph.earliest_finish, form)(rec, dur, np.arange(4), end, start)
        np.testing.assert_array_equal(end, want)
        np.testing.assert_array_equal(start, want_start)
        some = np.full(dur.shape, -1.0)
        _form(graph.earliest_finish, form)(rec, dur, np.array([3, 1]), some, np.empty((0, 0)))
        np.testing.assert_array_equal(some[:, [1, 3]], want[:, [1, 3]])
        assert np.all(some[:, [0, 2]] == -1.0)                # other columns untouched
        mk = [_form(graph.makespan, form)(rec.last, end, j) for j in range(4)]
        np.testing.assert_array_equal(mk, want[g.last].max(axis=0))
        deadline = np.fmax.reduce(want, axis=0) * rng.uniform(0.9, 1.1, 4)
        lf, floats = np.empty(dur.shape), np.empty((4, m * pp * vp))
        _form(graph.latest_finish, form)(rec, dur, deadline, lf)
        np.testing.assert_array_equal(lf, _latest_oracle(g, dur, deadline, p))
        _form(graph.unit_floats, form)(rec, dur, end, deadline, floats)
        fl = lf - want
        np.testing.assert_array_equal(floats, np.minimum(fl[g.unit_events[0]],
                                                         fl[g.unit_events[1]]).T)


def test_a_units_float_is_what_it_may_grow_by():
    """The meaning of a float: a unit grown by its float (its forward and backward together)
    keeps the step within the deadline; its tighter event grown by a little more does not
    (1F1B and interleaved, with p2p latency)."""
    for m, pp, vp in ((4, 3, 1), (4, 2, 2)):
        g = event_graph(m, pp, vp)
        rng = np.random.default_rng(m + pp)
        f = rng.uniform(0.5, 1.5, (1, m, pp * vp))
        dur = g.durations(f, 2 * f)
        deadline = g.makespan(g.earliest_finish(dur, 1e-3)) * 1.05
        ef = g.earliest_finish(dur, 1e-3)
        floats = unit_floats(g, dur, ef, deadline, 1e-3)[0]
        event = (latest_finish(g, dur, deadline, 1e-3) - ef)[:, 0]
        for u in rng.choice(m * pp * vp, 6, replace=False):
            fwd, bwd = g.unit_events[:, u]
            tight = fwd if event[fwd] <= event[bwd] else bwd
            both, over = dur.copy(), dur.copy()
            both[fwd] += 0.4 * floats[u]
            both[bwd] += 0.6 * floats[u] * (1 - 1e-9)
            over[tight] += floats[u] + 1e-6
            assert g.makespan(g.earliest_finish(both, 1e-3))[0] <= deadline[0]
            assert g.makespan(g.earliest_finish(over, 1e-3))[0] > deadline[0]


def _formula_tables(rng, n, stages, g):
    """Tables made by their formula (``grid.unit_tables``) and carrying it."""
    formula = (np.sort(rng.random((n, g)), axis=1), rng.uniform(0.5, 2.0, (2, stages)),
               rng.random((2, n, stages)), rng.uniform(0.8, 1.2, (n, stages)), True)
    fb, tot = np.empty((2, n, stages, g)), np.empty((n, stages, g))
    grid.unit_tables(*formula, fb, tot)
    return Tables.of(fb[0], fb[1], tot, formula)


@FORMS
def test_the_grid_search_is_a_scan_of_the_grid(form):
    """``highest_within``: the highest grid index in [lo, hi] whose seconds are <= the limit,
    lo if none, at every span, limits between, on and beyond the entries, NaN and inf; a
    unit's seconds read from the tables or computed by their formula (``source``), and
    ``seconds`` the tables' entries either way."""
    rng = np.random.default_rng(5)
    g = 20
    tables = _formula_tables(rng, 6, 3, g)
    fwd, bwd, tot, work = tables.fwd, tables.bwd, tables.tot, tables.work
    fn = _form(grid.highest_within, form)
    for case in range(300):
        q = int(rng.integers(0, 18))
        t = tot[q * g:(q + 1) * g]
        lo = int(rng.integers(0, g))
        hi = int(rng.integers(lo, g))
        lim = (np.nan, np.inf, -np.inf, t[lo], t[hi])[case % 5] if case % 3 == 0 \
            else float(rng.uniform(t[0] - 0.1, t[-1] + 0.1))
        fits = [i for i in range(lo, hi + 1) if t[i] <= lim]
        for src in (grid.row_of(q * g), grid.source(tables, q)):   # read, by the formula
            assert fn(tot, work, src, lo, hi, lim) == (fits[-1] if fits else lo), (case, lim)
            i = int(rng.integers(0, g))
            assert grid.seconds(fwd, bwd, work, src, i) == (fwd[q * g + i], bwd[q * g + i])


@FORMS
@pytest.mark.parametrize("by_formula", [False, True])
def test_a_descent_cut_is_every_fraction_simulated(form, by_formula):
    """A round's cut at a target: the units with a negative float, and per DP rank the first
    of ``CUT_FRACTIONS`` whose plan (each unit at the highest grid index within its seconds
    less that fraction of its cuttable time) fits, each fraction's plan simulated whole; the
    tables read, or their formula computed."""
    dp, m, pp = 3, 4, 2
    rng = np.random.default_rng(2)
    g = event_graph(m, pp, 1)
    tables = _formula_tables(rng, dp * m, pp, 6)
    if not by_formula:
        tables = Tables.of(tables.fwd, tables.bwd, tables.tot.reshape(-1, 6))
    rec, n = g.record(1e-3), m * pp
    idx = np.full(dp * n, 4, dtype=np.int64)
    at = np.arange(dp * n) * 6 + idx
    f, b = tables.fwd[at], tables.bwd[at]
    dur = g.durations(f.reshape(dp, m, pp), b.reshape(dp, m, pp))
    ef = g.earliest_finish(dur, 1e-3)
    mk = g.makespan(ef)
    t_min = tables.tot[np.arange(dp * n) * 6]
    plan = descent.Plan(dur, ef, f, b, idx)
    none = (np.zeros(0, np.int64), np.zeros((0, 0), np.int64), np.full(dp, -1, np.int64))
    seen = set()
    for target in (float(mk.min()) * 0.99, float(mk.max()) * 0.3):
        fits, (on, cut_i, ranks, mk_p, _, _) = _form(descent.cut_round, form)(
            rec, tables, plan, t_min, target, 0, none)[:2]
        floats = unit_floats(g, dur, ef, target, 1e-3).reshape(-1)
        np.testing.assert_array_equal(on, np.flatnonzero(floats < 0))
        assert len(ranks) == dp
        for j, r in enumerate(ranks):
            sel = on // n == r                                     # the rank's units
            mine, tried = on[sel], []
            for frac in descent.CUT_FRACTIONS:
                cand = idx.copy()
                for q in mine:
                    t = f[q] + b[q]
                    lim = slack.fit_limit(t + frac * (t_min[q] - t))
                    cand[q] = max([i for i in range(idx[q] + 1) if tables.tot[q * 6 + i] <= lim],
                                  default=0)
                at = np.arange(dp * n) * 6 + cand
                d = g.durations(tables.fwd[at].reshape(dp, m, pp),
                                tables.bwd[at].reshape(dp, m, pp))
                tried.append((g.makespan(g.earliest_finish(d, 1e-3))[r], cand[mine]))
            ok = [k for k, (t, _) in enumerate(tried) if t <= slack.fit_limit(target)]
            assert fits[j] == bool(ok)
            seen.add(bool(ok))
            k = ok[0] if ok else 0
            assert mk_p[j] == tried[k][0]
            np.testing.assert_array_equal(cut_i[sel], tried[k][1])
    assert seen == {True, False}
