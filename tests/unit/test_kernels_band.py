"""A DST band pass's compiled rules (``kernels.band``), each run in its Python form
(``py_func``) and compiled, on small cases, against brute-force oracles written here: the
density objective's moves in sensitivity order (running sums of every unit's possible move,
each unit's grid index found by a scan), the quality objective's water-filling (every unit's
grid index at every lambda of the bisection's grid counted from the gain tables), and a whole
pass's cut and raise tries (the rows moved by those oracles, then simulated)."""

import numpy as np
import pytest

from sparsebalance_megatron.kernels import band
from sparsebalance_megatron.kernels.records import FILL_EXPS, FILL_GRID, Tables
from sparsebalance_megatron.policy.dst_band import FILL_ITERS, gain_fill
from sparsebalance_megatron.sim.pipeline import event_graph
from tests.unit._floats import unit_floats

FORMS = pytest.mark.parametrize("form", ["python", "compiled"])


def _form(fn, form):
    return fn.py_func if form == "python" else fn


def _scan(t, u, lo, hi, lim):
    """The highest grid index in [lo, hi] of unit row ``u`` whose seconds fit ``lim``."""
    return max([i for i in range(lo, hi + 1) if t[u + i] <= lim], default=lo)


def _moves_oracle(t, u, cur, budget, cap, a, order, bound, raising):
    """Per stage, in ``order``: each unit's possible move x (to the bound; a raise at most its
    float x a), what the stage still needs after the units before it (np.cumsum less its own),
    and the highest grid index whose seconds fit that."""
    out = cur.copy()
    for p in range(u.shape[1]):
        js = order[:, p]
        now = t[u[js, p] + cur[js, p]]
        x = t[u[js, p] + bound] - now if raising else now - t[u[js, p] + bound]
        if raising:
            x = np.minimum(x, a * cap[js, p])
        left = budget[p] * a - (np.cumsum(x) - x)
        if raising:
            left = np.minimum(left, a * cap[js, p])
        for k, j in enumerate(js):
            if left[k] > 0 and x[k] > 0:
                lo, hi = (cur[j, p], bound) if raising else (bound, cur[j, p])
                out[j, p] = _scan(t, u[j, p], lo, hi, now[k] + left[k] if raising
                                  else now[k] - left[k])
    return out


def _table(rng, units, g=9):
    return np.sort(rng.random((units, g)), axis=1).reshape(-1) * rng.uniform(0.5, 2.0)


@FORMS
def test_sensitivity_moves_are_the_running_sums(form):
    """Cuts and raises from nothing to everything, zero and NaN floats, alpha below 1."""
    rng = np.random.default_rng(1)
    moved = 0
    for case in range(60):
        slots, pp, g = int(rng.integers(1, 6)), int(rng.integers(1, 4)), 9
        t = _table(rng, slots * pp, g)
        u = np.arange(slots * pp).reshape(slots, pp) * g
        cur = rng.integers(0, g, (slots, pp))
        order = np.argsort(rng.random((slots, pp)), axis=0)
        budget = rng.uniform(-0.2, 1.5, pp) * slots
        cap = rng.random((slots, pp)) * (case % 3 != 0)
        cap.reshape(-1)[::5] = np.nan if case % 4 == 1 else 0.0
        a = (1.0, 0.5, 0.125)[case % 3]
        for raising, bound in ((False, 0), (True, g - 1)):
            out = np.empty_like(cur)
            _form(band.moves_row, form)(Tables.of(t, t, t), u, cur, budget, cap, a, order, bound,
                                        raising, out)
            want = _moves_oracle(t, u, cur, budget, cap, a, order, bound, raising)
            np.testing.assert_array_equal(out, want)
            moved += int((out != cur).sum())
    assert moved > 50


def _fill_oracle(t, u, b, lo, hi, limit, marg, stage, fill):
    """One column's water-filling: every unit's grid index at every lambda of the grid (the
    gains of its stage >= lambda x b, counted as the kernel's clipped tables order them; a NaN
    key after every entry), the bisection's ``FILL_ITERS`` steps over them, then every common
    level tried."""
    neg = np.clip(-marg[stage], fill.low, None)                      # [slots, g]
    key = np.clip(-(FILL_EXPS[:, None] * b[None, :]), fill.low, fill.high)   # [K, slots]
    count = (neg[None, :, :] <= key[:, :, None]).sum(axis=2) - 1
    count[np.isnan(key)] = 10 ** 6
    at = np.clip(count, lo, hi)                                      # [K, slots]

    def total(idx):
        tot = 0.0
        for s, i in enumerate(idx):
            tot = t[u[s] + i] if s == 0 else tot + t[u[s] + i]
        return tot

    a, z = 0, FILL_GRID
    for _ in range(FILL_ITERS):
        mid = (a + z) // 2
        a, z = (a, mid) if total(at[mid]) <= limit else (mid, z)
    fit, over = at[z], at[a]
    levels = [L for L in range(fit.min(), over.max() + 1)
              if total(np.maximum(fit, np.minimum(over, L))) <= limit]
    return np.maximum(fit, np.minimum(over, max(levels, default=fit.min())))


@FORMS
def test_water_filling_is_every_lambda_counted(form):
    """Columns of stages with a segment of equal gains, limits from below everything to above
    everything, seconds per density at 0, below 0 (a column searched in full) and NaN."""
    rng = np.random.default_rng(2)
    nv, g, slots = 3, 12, 5
    marg = np.sort(rng.random((nv, g)) * 0.3, axis=1)[:, ::-1].copy()
    marg[:, 0] = np.inf
    marg[1, 4:9] = marg[1, 4]
    fill = gain_fill(marg, 1, nv, 1)                              # stage of "unit" q: q
    n = 40
    stage = rng.integers(0, nv, n)
    t = _table(rng, n * slots, g)
    u = np.arange(n * slots).reshape(n, slots) * g
    b = rng.random((n, slots)) * 3
    b[0, :2] = 0.0
    b[1, 1] = -0.5
    b[2, 3] = np.nan
    lo = rng.integers(0, 5, (n, slots))
    hi = np.minimum(lo + rng.integers(0, 8, (n, slots)), g - 1)
    at_lo, at_hi = (t[u + x].sum(axis=1) for x in (lo, hi))
    limit = at_lo + rng.uniform(-0.2, 1.2, n) * (at_hi - at_lo)
    out = np.empty((n, slots), dtype=np.int64)
    for j in range(n):                           # column j: every slot on stage[j]
        col = fill._replace(shift=np.full((slots, 1), fill.shift[0, stage[j]]),
                            first=np.full((slots, 1), fill.first[0, stage[j]]))
        _form(band.water_fill, form)(t, u[j], b[j], lo[j], hi[j], limit[j], col, 0, FILL_ITERS,
                                     out[j])
        want = _fill_oracle(t, u[j], b[j], lo[j], hi[j], limit[j], marg,
                            np.full(slots, stage[j]), fill)
        np.testing.assert_array_equal(out[j], want, err_msg=f"column {j}")
    assert np.any(out != hi) and np.any(out != lo)


def _pass(dp, m, pp, vp, seed, g=9):
    """A band pass of two candidates' copies of ``dp`` ranks (rows 0, 2, ...: water-filled)."""
    rng = np.random.default_rng(seed)
    slots, nv = m * vp, pp * vp
    t = np.sort(rng.uniform(0.2, 1.0, (dp, m, nv, g)), axis=-1) * rng.uniform(0.5, 1.5,
                                                                            (dp, m, nv, 1))
    marg = np.sort(rng.random((nv, g)), axis=1)[:, ::-1].copy()
    marg[:, 0] = np.inf
    units = np.arange(dp * slots * pp).reshape(dp, slots, pp) * g        # the ranks' units
    b = rng.random((dp, slots, pp))
    bp = band.BandPass(Tables.of(t / 3, 2 * t / 3, t / 3 + 2 * t / 3),
                       event_graph(m, pp, vp).record(1e-3), units, rng.random((dp, slots, pp)),
                       gain_fill(marg, slots, pp, vp), b)
    return bp, marg, rng


def _simulated(bp, m, pp, vp, idx):
    g = event_graph(m, pp, vp)
    units = bp.rows.units                                         # row r: rank r mod dp
    at = units[np.arange(len(idx)) % len(units)] + idx
    f, b = (x.take(at).reshape(len(at), m, pp * vp) for x in (bp.tables.fwd, bp.tables.bwd))
    dur = g.durations(f, b)
    ef = g.earliest_finish(dur, 1e-3)
    return g.makespan(ef), dur, ef


def _column(bp, marg, r, q, lo, hi, limit):
    t, g = bp.tables.tot, bp.tables.g
    stage = (bp.fill.first[:, q] - 1) // g
    dp = len(bp.rows.units)
    return _fill_oracle(t, bp.rows.units[r % dp, :, q], bp.rows.b[r % dp, :, q], lo, hi,
                        limit, marg, stage, bp.fill)


def _sum(x):
    tot = 0.0
    for k, v in enumerate(x):
        tot = v if k == 0 else tot + v
    return tot


@pytest.mark.parametrize("pp, vp", [(2, 1), (2, 2), (1, 1)])
def test_a_band_pass_is_its_rows_moved_and_simulated(pp, vp):
    """``BandPass.cut``, its floats and a raise try (and ``cut_rows`` / ``raise_try_rows``'
    Python forms) against every row cut or raised by the oracles above, its objective's way,
    then simulated: grid indices, makespans, durations, finishes, busy seconds."""
    dp, m, g = 2, 4, 9
    bp, marg, rng = _pass(dp, m, pp, vp, seed=pp * 10 + vp)
    t, units, rows = bp.tables.tot, np.tile(bp.rows.units, (2, 1, 1)), 2 * dp
    water = np.arange(rows) % 2 == 0
    cur = np.full(units.shape, 5, dtype=np.int64)
    busy0 = t.take(units[:dp] + cur[:dp]).sum(axis=1)                # [dp, pp]
    bands = rng.uniform(0.5, 1.1, rows) * busy0.mean()
    bands[-1] = np.inf                                                  # a band that cuts none
    excess = busy0[np.arange(rows) % dp] - bands[:, None]
    got = bp.cut(cur, busy0, bands, water, 0, FILL_ITERS)
    py = tuple(np.empty_like(x) for x in got)
    band.cut_rows.py_func(bp.graph, bp.tables, bp.rows, bp.fill, cur, busy0, bands, water, 0,
                          FILL_ITERS, py)
    want = cur.copy()
    for r in range(rows):
        if not water[r]:
            want[r] = _moves_oracle(t, units[r], cur[r], np.maximum(excess[r], 0.0), None, 1.0,
                                    bp.rows.down[r % dp], 0, False)
            continue
        for q in range(pp):
            base, ex = _sum(t[units[r, :, q] + cur[r, :, q]]), excess[r, q]
            limit = base - ex if ex > 0 else np.inf
            if not base <= limit:
                want[r, :, q] = _column(bp, marg, r, q, np.zeros(m * vp, int), cur[r, :, q],
                                        limit)
    mk, dur, ef = _simulated(bp, m, pp, vp, want)
    busy = [[_sum(bp.tables.fwd[units[r, :, q] + want[r, :, q]]
                  + bp.tables.bwd[units[r, :, q] + want[r, :, q]]) for q in range(pp)]
            for r in range(rows)]
    for x in (got, py):
        for have, w in zip(x, (want, mk, dur, ef, np.array(busy))):
            np.testing.assert_array_equal(have, w)
    assert np.any(want != cur)
    target = mk * 1.02
    cap = bp.floats(dur, ef, target)
    fl = np.maximum(unit_floats(event_graph(m, pp, vp), dur, ef, target, 1e-3), 0.0)
    np.testing.assert_array_equal(cap, fl.reshape(cap.shape))
    slack = np.maximum(target[:, None] - busy, 0.0)
    alpha, i_max = rng.uniform(0.3, 1.0, rows), g - 1
    trial, mk_t = bp.raise_try(want, cap, slack, np.arange(rows), alpha, water, i_max,
                               FILL_ITERS)
    py = (np.empty_like(trial), np.empty_like(mk_t))
    band.raise_try_rows.py_func(bp.graph, bp.tables, bp.rows, bp.fill, (want, cap, slack),
                                np.arange(rows), alpha, water, i_max, FILL_ITERS, py)
    up = want.copy()
    for r in range(rows):
        a = alpha[r]
        if not water[r]:
            up[r] = _moves_oracle(t, units[r], want[r], slack[r], cap[r], a, bp.rows.up[r % dp],
                                  i_max, True)
            continue
        for q in range(pp):
            u, c = units[r, :, q], want[r, :, q]
            top = np.array([_scan(t, u[s], c[s], i_max, t[u[s] + c[s]] + a * cap[r, s, q])
                            for s in range(m * vp)])
            limit = _sum(t[u + c]) + a * slack[r, q]
            up[r, :, q] = top if _sum(t[u + top]) <= limit else \
                _column(bp, marg, r, q, c, top, limit)
    for x in ((trial, mk_t), py):
        np.testing.assert_array_equal(x[0], up)
        np.testing.assert_array_equal(x[1], _simulated(bp, m, pp, vp, up)[0])
    assert np.any(up != want)
