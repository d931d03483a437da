"""The cost tables' memory kept between drafts (``policy.costs.TableMemory``, ``TableLease``):
tables written into kept memory are the fresh ones bit for bit whatever the memory held before
(a larger step's tables, garbage), and a draft made while another holds the lease gets fresh
arrays instead of sharing them."""

import pickle

import numpy as np

from sparsebalance_megatron.latency import LatencyModel, ModelShape
from sparsebalance_megatron.policy.costs import TableLease, TableMemory, UnitCosts, density_grid


def _costs(rng, dp, m, out=None):
    lm = LatencyModel.analytic(ModelShape(num_layers=8, seq_length=8192), pp=2)
    lengths = [rng.integers(100, 4000, rng.integers(1, 4)) for _ in range(dp * m)]
    return UnitCosts.from_latency(lm, lengths, dp, m, density_grid(0.25, 0.125, 0.5),
                                  kept_units=lengths, out=out)


def test_tables_in_kept_memory_equal_fresh_ones_whatever_it_held():
    memory = TableMemory()
    for step, (dp, m) in enumerate(((4, 4), (2, 4), (3, 6), (1, 2))):   # shrink, then grow
        if memory._flat is not None:
            memory._flat[:] = np.nan                 # whatever the last step left there
        kept = _costs(np.random.default_rng(step), dp, m, out=memory)
        fresh = _costs(np.random.default_rng(step), dp, m)
        assert kept.tables_checked and fresh.tables_checked
        for name in ("fwd_s", "bwd_s", "total_s"):
            a, b = getattr(kept, name), getattr(fresh, name)
            assert a.shape == b.shape == (dp, m, 2, 25)
            np.testing.assert_array_equal(a, b)
            assert np.shares_memory(a, memory._flat)
    assert memory._flat.size == 3 * (3 * 6) * 2 * 25     # grown once, to the largest


def test_a_held_lease_lends_nothing_and_is_pickled_empty():
    lease = TableLease()
    with lease.lease() as first:
        assert len(first) == 2 and all(isinstance(t, TableMemory) for t in first)
        first[0].arrays(2, 2, 3)
        with lease.lease() as second:                # another thread's draft meanwhile
            assert second is None
        copy = pickle.loads(pickle.dumps(lease))
        assert copy._memory[0]._flat is None         # the planner process's copy: empty
    with lease.lease() as again:                     # released: the same memory again
        assert again is first and again[0]._flat is not None
