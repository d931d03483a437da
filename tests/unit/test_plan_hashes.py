"""The planner's plans, bit for bit, on a fixed set of drafts: each configuration's digest of
two consecutive drafts (the runtime's ``Drafter`` on the built-in corpus, the calibration and
sensitivity tracker updated between them as ``end_step`` does, ``planner_ab.draft_loop``'s
digest: every plan's densities and report) must equal the one recorded here. Recorded at
959136a, before the planner's kernels moved into ``kernels/`` (which kept all 11, as did the
numpy paths' removal: every rule written once, compiled); recorded again when DST began to
plan at effective densities (issue 62: a move that keeps no other block is no move), which
changed 9 of them by design and left the two whose drafts made no such move; and again when
the blocks a move keeps became the documents' alone (``UnitCosts.from_latency``'s
``kept_units``: a raise that keeps only more padding is none), which changed 8 and left 3.

A refactor of the planner (its kernels, its passes, its phases) keeps these: a change that moves
a single float of a plan fails here. A change meant to change plans records new digests and says
why in its commit message.

The configurations cover both pipeline layouts (Megatron's even split, 1F1B; the best static
layout, interleaved), both DST objectives, the critical-path descent on and off, every
stand-down packing and compare, and ``raise_to static``. Each subprocess plans every
configuration in a few seconds (plus numba's compilation when its disk cache is cold).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# (dp, micro-batches, pp, layout, SparseBalanceConfig fields) -> digest (see the docstring)
PLANS = [
    ((4, 8, 4, "even", {}), "efdd2a1177e093a9"),
    ((4, 8, 4, "best", {}), "d50b768cd2e22014"),
    ((4, 8, 4, "even", {"dst_objective": "density"}), "d1bd06eb17a73ebb"),
    ((4, 8, 4, "best", {"dst_objective": "density"}), "246a25841aeb8029"),
    ((2, 8, 2, "best", {}), "08ac10c975c5053d"),
    ((8, 8, 4, "best", {"dst_objective": "density", "stand_down": "off"}), "da32415131552853"),
    ((4, 8, 4, "best", {"stand_down_compare": "static"}), "9352e0cc5440c2c5"),
    ((4, 8, 4, "even", {"dst_descent": "off"}), "a5ca3c462ecd72da"),
    ((4, 8, 4, "best", {"dst_descent": "off", "dst_objective": "density"}), "63f87a55fb8c6141"),
    ((2, 4, 2, "even", {"stand_down": "token_balanced"}), "ba43855084fdc3d2"),
    ((8, 8, 4, "even", {"raise_to": "static"}), "eb20547b908f63c7"),
]

DIGESTS = r"""
import hashlib, json, sys
import numpy as np
sys.path.insert(0, "scripts")
from sparsebalance_megatron.batching import SensitivityTracker
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
from studies._drafts import make_drafter
from studies.planner_cost import after_step

out = []
for dp, m, pp, layout, kw in json.loads(sys.argv[1]):
    sb = SparseBalanceConfig(sparse_balance=True, **kw)
    corpus = corpus_steps(dp, m, sb.density, 2, seq=32768, layout=layout, pp=pp)
    drafter = make_drafter(corpus.lm, sb, dp, 32768)
    tracker, rng = SensitivityTracker(), np.random.default_rng(0)
    h = hashlib.sha256()
    for k in range(2):
        d = drafter.draft(k, 0, corpus.segments[k], m, with_dst=True)
        h.update(np.asarray(d.payload[0]).tobytes())
        h.update(repr(sorted(d.payload[1].items())).encode())
        after_step(corpus.lm, sb, d, tracker, rng)
    out.append(h.hexdigest()[:16])
print(json.dumps(out))
"""


def test_plans_are_the_recorded_ones():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", DIGESTS, json.dumps([c for c, _ in PLANS])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    changed = [(cfg, want, have) for (cfg, want), have in zip(PLANS, got) if want != have]
    assert not changed, f"plans changed (config, recorded, now): {changed}"
