"""The latency features' work table summed per unit, compiled (``latency.features``'
``UnitFeatures.work_grid``): one pass over the runs of equal documents (integer pair counts:
exact in any order). Pure numpy and numba; imports nothing of this package but ``kernels``.
"""

from __future__ import annotations

import numpy as np

from . import jit


@jit
def run_sums(table_t, blocks, unit, count, out):
    """out[unit[r]] += table_t[blocks[r]] x count[r] over the runs r."""
    for r in range(blocks.size):
        u, b, c = unit[r], blocks[r], count[r]
        for j in range(out.shape[1]):
            out[u, j] += table_t[b, j] * c


def warm_up() -> None:
    """``kernels.warm_up``'s part: this room's kernels on a draft's argument types."""
    run_sums(np.ones((2, 2)), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
             np.ones(1), np.zeros((1, 2)))
