"""The event graph's passes a wave at a time (``sim.waves``) give the event loop's numbers bit
for bit: plain and interleaved schedules, p2p latency or none, zero durations, start times,
deadlines per column or one for all."""

import numpy as np
import pytest

from sparsebalance_megatron.policy import slack
from sparsebalance_megatron.sim import waves
from sparsebalance_megatron.sim.pipeline import event_graph


@pytest.mark.parametrize("m, pp, vp", [(16, 4, 1), (16, 4, 2), (8, 2, 2), (5, 3, 1), (1, 2, 1),
                                       (12, 4, 3), (6, 8, 1), (4, 1, 1)])
def test_waves_give_the_event_loops_numbers(m, pp, vp):
    g = event_graph(m, pp, vp)
    rng = np.random.default_rng(m * 100 + pp * 10 + vp)
    cols = waves.WAVE_COLS + 5                         # the event loop runs these
    for p in (0.0, 2.5e-3):
        dur = rng.random((g.size, cols)) * (rng.random((g.size, cols)) > 0.1)
        start_loop, start_waves = np.empty_like(dur), np.empty_like(dur)
        loop = g.earliest_finish(dur, p, start_loop)
        by_waves = waves.earliest_finish(g.waves, dur, p, start_waves)
        np.testing.assert_array_equal(by_waves, loop)
        np.testing.assert_array_equal(start_waves, start_loop)
        for deadline in (loop.max(axis=0), float(loop.max()), rng.random(cols) * loop.max()):
            want = slack.latest_finish(g, dur, deadline, p)
            got = waves.latest_finish(g.waves, dur, np.asarray(deadline, np.float64), p)
            np.testing.assert_array_equal(got, want)
    few = dur[:, :waves.WAVE_COLS]                      # and the dispatch takes the waves
    np.testing.assert_array_equal(g.earliest_finish(few, p), loop[:, :waves.WAVE_COLS])
