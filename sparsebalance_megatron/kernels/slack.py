"""The planner's float slack, one rule for its compiled kernels and its Python callers: seconds
within ``fit_limit(s)`` fit under ``s``, so a tie in float is a fit and not slower (``slower``).
Plain Python (``grid.fit_limit`` is this function compiled): importing it loads no numba, so the
step's choice (``policy.stand_down``) reads it without the kernels.
"""

SCALE = 1.0 + 1e-9           # a limit's float slack: seconds within it fit


def fit_limit(s):
    """The most seconds that fit under ``s`` (a number or an array): ``s`` x ``SCALE`` + 1e-15,
    so that a tie in float is a fit (a descent's unit limits, every raise's makespans, the
    do-no-harm comparisons)."""
    return s * SCALE + 1e-15


def slower(t_s: float, reference_s: float) -> bool:
    """``t_s`` predicted slower than ``reference_s``: it does not fit under it (a tie, within
    the slack, is not slower)."""
    return t_s > fit_limit(reference_s)
