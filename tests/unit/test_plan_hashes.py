"""The planner's plans, bit for bit, on a fixed set of drafts: each configuration's digest of
two consecutive drafts (the runtime's ``Drafter`` on the built-in corpus, the calibration and
sensitivity tracker updated between them as ``end_step`` does, ``planner_ab.draft_loop``'s
digest: every plan's densities and report) must equal the one recorded here. Recorded at
959136a, before the planner's kernels moved into ``kernels/`` (which kept all 11, as did the
numpy paths' removal: every rule written once, compiled); recorded again when DST began to
plan at effective densities (issue 62: a move that keeps no other block is no move), which
changed 9 of them by design and left the two whose drafts made no such move; and again when
the blocks a move keeps became the documents' alone (``UnitCosts.from_latency``'s
``kept_units``: a raise that keeps only more padding is none), which changed 8 and left 3;
and again when DST became the decomposed planner (issue 77: every DP rank's rounds, made
in-process here as the DP group's all-reduces make them in a run), which changed 10 and left 1
(each committed step predicted 0.996-1.003x the central planner's), and again when its probes
agreed the ranks' supply and demand of slack (``dst_probes``), which changed 7: 0.996-1.0004x;
and again when the report gained ``quality_sd`` and ``adopted`` and the quality objective got its
measured model and last rule (issue 84), which changed all 11 digests: the densities alone are
unchanged in the 5 configurations whose plans neither rule touches (the 4 of the density
objective, and DP 2 x PP 2 where nothing moves: the one-planner refactor kept them bit for bit),
and the quality objective's plans are the search's where their cuts trade speed for predicted
loss at least as well as uniform sparsity does at that step (``--sb-exchange-rate auto``): the
same steps as before in 9 of the 10 quality-objective drafts that moved (e.g. the even split at
DP 4: 0.979 / 0.980x static), the plan without cuts in one (descent off, a step 0.007%
faster); the quality-objective digests moved once more when the shipped model dropped its
length term and interaction (the check on held-out plans, ``plan_quality --validate``). The
last two, DP 1, were added when DP 1 came to run the same rounds as every DP (issue 85: the
probed descent is the only one); the 11 above, all DP > 1, were unchanged by it. All 13 were
recorded again when the report dropped ``anchor_s`` and ``band_s`` (read by nothing): the
densities, the micro-batches and every other report field byte-equal on both drafts of each.

A refactor of the planner (its kernels, its passes, its phases) keeps these: a change that moves
a single float of a plan fails here. A change meant to change plans records new digests and says
why in its commit message.

The configurations cover DP 1 and above, both pipeline layouts (Megatron's even split, 1F1B;
the best static layout, interleaved), both DST objectives, the critical-path descent on and
off, every stand-down packing and compare, and ``raise_to static``. Each subprocess plans every
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
    ((4, 8, 4, "even", {}), "f546c6f8fc03390e"),
    ((4, 8, 4, "best", {}), "5953ad4784ef400a"),
    ((4, 8, 4, "even", {"dst_objective": "density"}), "d9d5a8cfeac550a3"),
    ((4, 8, 4, "best", {"dst_objective": "density"}), "4605720573ea8a85"),
    ((2, 8, 2, "best", {}), "06515c7b7871929f"),
    ((8, 8, 4, "best", {"dst_objective": "density", "stand_down": "off"}), "2ae0af5e7407da33"),
    ((4, 8, 4, "best", {"stand_down_compare": "static"}), "387b22f409d5dc16"),
    ((4, 8, 4, "even", {"dst_descent": "off"}), "4aff54ddce6e012b"),
    ((4, 8, 4, "best", {"dst_descent": "off", "dst_objective": "density"}), "726035b95c6e4a78"),
    ((2, 4, 2, "even", {"stand_down": "token_balanced"}), "914fcbdf80b0d466"),
    ((8, 8, 4, "even", {"raise_to": "static"}), "30e0516229234970"),
    ((1, 8, 4, "best", {}), "a5c415cab151b11e"),
    ((1, 8, 4, "even", {"dst_objective": "density"}), "7f79e22b4efb133c"),
]

DIGESTS = r"""
import hashlib, json, sys
import numpy as np
sys.path.insert(0, "scripts")
from sparsebalance_megatron.batching import SensitivityTracker
from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
from studies.drafts import make_drafter
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
