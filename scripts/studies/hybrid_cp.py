"""Megatron's hybrid context parallelism against a2a CP + SparseBalance, in the simulator (issue
14; docs/CONTEXT_PARALLEL.md): Megatron's own ``BalancedCPScheduler`` on the same global batches
the a2a runs see, both priced by the same latency model."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.data import GlobalBatchSampler, load_corpus
from sparsebalance_megatron.experiments import StudyConfig, run_study
from sparsebalance_megatron.latency import LatencyModel, ModelShape

from .common import MODELS, parser, write_result   # the same model shapes as sim_study


def parse_args(argv=None):
    args = parser(__doc__, "hybrid_cp").parse_args(argv)
    # the setting of the documented run; mixes: built-in corpus units, or 'long' (300 synthetic
    # documents of 16K-128K tokens); the variable-length a2a runs' --sb-microbatch-multiple
    args.model, args.seq_length, args.dp, args.microbatches = "llama3.2-1b", 131072, 4, 8
    args.context_parallel, args.density, args.mixes = [2, 4, 8], 0.5, ["file", "section", "long"]
    args.microbatch_multiple, args.steps, args.seed = 1024, 2, 1234
    return args


def mix_lengths(mix: str, seq_length: int) -> np.ndarray:
    if mix == "long":
        return np.random.default_rng(0).integers(16384, seq_length + 1, 300).astype(np.int64)
    return np.asarray(load_corpus(tokenizer="qwen", doc_unit=mix).lengths, dtype=np.int64)


def hybrid_step_s(seg_lengths, total_gpus: int, max_seqlen_per_rank: int, cost) -> dict:
    """One global batch under Megatron's hybrid CP: step seconds, groups, sub-samples."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    group = SimpleNamespace(size=lambda: total_gpus)     # all the scheduler asks of its group
    sched = BalancedCPScheduler(max_seqlen_per_rank, group)
    samples = [(i, int(n)) for i, n in enumerate(seg_lengths)]
    groups, id_groups = sched.get_groups_and_subsamples(samples, None)
    length = dict(samples)
    step, busy = 0.0, 0.0
    for ids in id_groups:                       # [gpu] -> sample ids, in execution order
        share = Counter(s for gpu in ids for s in gpu)
        ready = [0.0] * total_gpus
        pos = [0] * total_gpus
        left = sum(len(g) for g in ids)
        while left:
            moved = False
            for r in range(total_gpus):
                if pos[r] >= len(ids[r]):
                    continue
                s = ids[r][pos[r]]
                holders = [q for q in range(total_gpus)
                           if pos[q] < len(ids[q]) and ids[q][pos[q]] == s]
                if len(holders) < share[s]:
                    continue                    # a partner has not reached it yet
                t = max(ready[q] for q in holders) + cost(length[s], share[s])
                for q in holders:
                    ready[q], pos[q] = t, pos[q] + 1
                busy += cost(length[s], share[s]) * share[s]
                left -= len(holders)
                moved = True
            if not moved:
                raise RuntimeError("hybrid CP schedule: sub-samples in inconsistent orders")
        step += max(ready)
    return {"step_s": step, "groups": len(groups), "subsamples": len(samples),
            "utilisation": busy / (step * total_gpus) if step else float("nan")}


def main(argv=None):
    args = parse_args(argv)
    shape = ModelShape(**{**MODELS[args.model], "seq_length": args.seq_length})
    lm0 = LatencyModel.analytic(shape, pp=1)
    d0 = args.density
    cfg = StudyConfig(microbatches=args.microbatches, seq_length=args.seq_length,
                      steps=args.steps, seed=args.seed,
                      sb=SparseBalanceConfig(sparse_balance=True, density=d0))
    out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": {}}
    print(f"ANALYTIC {args.model} H100 table, PP=1, {args.seq_length} tokens per micro-batch, "
          f"DP={args.dp}, m={args.microbatches}, d0={d0}, {args.steps} steps; CP all-to-all at "
          f"the ASSUMED DeviceProfile bandwidth")
    print(f"{'mix':<8} {'CP':>3} {'GPUs':>5} {'a2a static':>11} {'a2a tok-bal':>11} "
          f"{'a2a dp_bal':>11} {'a2a sab_dst':>11} {'var static':>11} {'var sab_dst':>11} "
          f"{'hybrid':>8} "
          f"{'hyb groups':>10} {'hyb util':>8}   (step s)")
    cfg_var = replace(cfg, microbatch_multiple=args.microbatch_multiple)
    t0 = time.perf_counter()
    for mix in args.mixes:
        lengths = mix_lengths(mix, args.seq_length)
        for cp in args.context_parallel:
            lm = lm0.with_context_parallel(cp)
            runs = {"static": ("static", None), "token_balanced": ("token_balanced", None),
                    "dp_balanced": ("dp_balanced", None), "sab_dst": ("sab_dst", None)}
            rows = run_study(args.dp, cfg, lm, lengths, runs, baseline="static")
            rows_var = run_study(args.dp, cfg_var, lm, lengths, runs, baseline="static")
            models = {}

            def cost(n: int, k: int) -> float:
                if k not in models:
                    models[k] = lm0.with_context_parallel(k)
                return float(models[k].predict([n], d0, 0))

            sampler = GlobalBatchSampler(lengths, capacity=args.seq_length, dp=args.dp,
                                         num_microbatches=args.microbatches, seed=args.seed,
                                         long_sample_policy="split")
            hyb = []
            for _ in range(args.steps):
                segs = sampler.next_global_batch()
                hyb.append(hybrid_step_s([e - s for _, s, e in segs], args.dp * cp,
                                         args.seq_length // cp, cost))
            h = {"step_time_s": float(np.mean([x["step_s"] for x in hyb])),
                 "groups": float(np.mean([x["groups"] for x in hyb])),
                 "subsamples": float(np.mean([x["subsamples"] for x in hyb])),
                 "utilisation": float(np.mean([x["utilisation"] for x in hyb]))}
            out["results"][f"{mix}/cp={cp}"] = {"a2a": rows, "a2a_variable": rows_var,
                                                 "hybrid": h}
            print(f"{mix:<8} {cp:>3} {args.dp * cp:>5} {rows['static']['step_time_s']:>11.3f} "
                  f"{rows['token_balanced']['step_time_s']:>11.3f} "
                  f"{rows['dp_balanced']['step_time_s']:>11.3f} "
                  f"{rows['sab_dst']['step_time_s']:>11.3f} "
                  f"{rows_var['static']['step_time_s']:>11.3f} "
                  f"{rows_var['sab_dst']['step_time_s']:>11.3f} {h['step_time_s']:>8.3f} "
                  f"{h['groups']:>10.1f} {h['utilisation']:>8.3f}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    write_result(args.json, out)
