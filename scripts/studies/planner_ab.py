"""The planner's draft, this checkout against another one side by side (issue 44): thread CPU per
draft and a hash of every plan, alternated round by round. ``--other``: a checkout of another
commit (``git worktree add``)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from .common import ROOT, parser, write_result


def draft_loop(steps: int = 6, dp: int = 64, m: int = 16, layout: str = "best") -> dict:
    """``steps`` drafts of consecutive corpus steps with the default flags, the calibration
    and tracker updated after each as ``end_step`` does: their thread CPU ms and a sha256 (16
    hex digits) of every plan's densities and report."""
    import numpy as np

    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    try:
        from studies.drafts import make_drafter
    except ImportError:                 # a checkout before drafts.py
        from studies._drafts import make_drafter
    from studies.planner_cost import after_step

    if steps < 2:
        raise ValueError(f"steps={steps}: expected at least 2 (the first is left out)")
    sb = SparseBalanceConfig(sparse_balance=True)
    corpus = corpus_steps(dp, m, sb.density, steps, seq=32768, layout=layout, pp=4)
    drafter = make_drafter(corpus.lm, sb, dp, 32768)
    tracker, rng = SensitivityTracker(), np.random.default_rng(0)
    digest, ms = hashlib.sha256(), []
    for k in range(steps):
        t = time.thread_time()
        d = drafter.draft(k, 0, corpus.segments[k], m, with_dst=True)
        ms.append((time.thread_time() - t) * 1e3)
        digest.update(np.asarray(d.payload[0]).tobytes())
        digest.update(repr(sorted(d.payload[1].items())).encode())
        after_step(corpus.lm, sb, d, tracker, rng)
    return {"draft_ms": ms[1:], "plans_sha256": digest.hexdigest()[:16]}


def _run(tree: str, steps: int, dp: int = 64, layout: str = "best") -> dict:
    """One draft loop in a subprocess with ``tree``'s package and study helpers (its stdout:
    JSON)."""
    env = dict(os.environ, PYTHONPATH=tree)
    code = (f"import sys, json, importlib.util; sys.path.insert(0, "
            f"{os.path.join(tree, 'scripts')!r}); import studies; "
            f"spec = importlib.util.spec_from_file_location('studies.planner_ab', "
            f"{os.path.abspath(__file__)!r}); ab = importlib.util.module_from_spec(spec); "
            f"sys.modules[spec.name] = ab; spec.loader.exec_module(ab); "
            f"print(json.dumps(ab.draft_loop({steps}, dp={dp}, layout={layout!r})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the draft loop in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = parser(__doc__, "planner_ab")
    p.add_argument("--other", required=True, metavar="DIR",
                   help="a checkout of the commit to compare with (git worktree add DIR REV)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds per checkout")
    p.add_argument("--steps", type=int, default=6, help="drafts per loop (the first left out)")
    p.add_argument("--layout", choices=("best", "even"), default="best",
                   help="the pipeline layout of the 64 DP x 16 x PP4 step: the best static one "
                        "(interleaved) or Megatron's even split")
    args = p.parse_args(argv)
    other = os.path.abspath(args.other)
    if not os.path.isdir(os.path.join(other, "sparsebalance_megatron")):
        p.error(f"--other {args.other!r}: expected a checkout of this repository (no "
                f"sparsebalance_megatron/ in it)")
    if args.rounds < 1 or args.steps < 2:
        p.error(f"--rounds {args.rounds} / --steps {args.steps}: expected >= 1 / >= 2")
    trees = {"this": ROOT, "other": other}
    out = {name: {"draft_ms": [], "hashes": []} for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            loop = _run(tree, args.steps, layout=args.layout)
            out[name]["draft_ms"] += loop["draft_ms"]
            out[name]["hashes"].append(loop["plans_sha256"])
            print(f"round {r + 1} {name:5s}: draft ms {[round(x) for x in loop['draft_ms']]}"
                  f" plans {loop['plans_sha256']}")
    for name in trees:
        out[name]["draft_ms_median"] = statistics.median(out[name]["draft_ms"])
    same = set(out["this"]["hashes"]) == set(out["other"]["hashes"]) and \
        len(set(out["this"]["hashes"])) == 1
    ratio = out["this"]["draft_ms_median"] / out["other"]["draft_ms_median"]
    print(f"draft median: this {out['this']['draft_ms_median']:.1f} ms, other "
          f"{out['other']['draft_ms_median']:.1f} ms ({ratio:.3f}x); same plans: {same}")
    write_result(args.json, {"other": other, "rounds": args.rounds, "steps": args.steps,
                             "shape": f"64 DP x 16 micro-batches x PP4, {args.layout} layout",
                             "this": out["this"], "other_checkout": out["other"],
                             "draft_ratio": ratio, "same_plans": same})
    return 0
