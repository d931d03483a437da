"""DST measured with GPU timings (issue 74): the units of a PP x DP step timed one after another on
one device, and the step composed by the simulator from them; ``static``, ``dst`` and
``dense_sab`` on the same documents, each predicted step beside its measured one.

    python scripts/bench.py dst_gpu --json runs/dst_gpu.json            # a GPU: the real shape
    python scripts/bench.py dst_gpu --tiny --json runs/dst_gpu_cpu.json  # CPU, a tiny model
"""

from __future__ import annotations

import time

import numpy as np

from .common import parser, write_result

GPU_SHAPE = dict(layers=24, pp=4, dp=4, microbatches=4, seq_length=32768, block=128,
                 hidden=896, ffn=4864, heads=14, groups=2, head_dim=64, vocab=151936,
                 min_doc_tokens=16384)
TINY_SHAPE = dict(layers=2, pp=2, dp=2, microbatches=2, seq_length=256, block=32,
                  hidden=32, ffn=64, heads=4, groups=2, head_dim=8, vocab=256,
                  min_doc_tokens=64)
D0 = 0.25                   # the static arm's density and DST's d0
ARMS = ("static", "dst", "dense_sab")
DENSE_ALL = 1 << 30          # a routing threshold above every document: all of them dense


def model_shape(s: dict):
    from sparsebalance_megatron.latency import ModelShape
    return ModelShape(num_layers=s["layers"], hidden_size=s["hidden"],
                      ffn_hidden_size=s["ffn"], num_attention_heads=s["heads"],
                      num_query_groups=s["groups"], kv_channels=s["head_dim"],
                      vocab_size=s["vocab"], seq_length=s["seq_length"], pp=s["pp"])


def latency_model(s: dict, cuda: bool, backend: str):
    """(LatencyModel, words) that plan the step (module docstring)."""
    from sparsebalance_megatron.latency import LatencyModel
    if cuda:
        from .device import priced_table
        table = priced_table(backend, layers=s["layers"], pp=s["pp"],
                             seq_length=s["seq_length"])
        return LatencyModel.from_table(table), table["sparse_call"]["described"]
    lm = LatencyModel.analytic(model_shape(s), pp=s["pp"], block_size=s["block"])
    return lm, lm.table["sparse_call"]["described"]


def plan_arms(lm, segments, s: dict, density: float, multiple: int) -> dict:
    """{arm: (BatchPlan, densities [dp, m, pp], the model that prices it)} of one global batch."""
    from sparsebalance_megatron.batching.packing import (latency_sample_cost_fn, sab_plan,
                                                         sequential_plan)
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.step.choice import choose

    kw = dict(dp=s["dp"], num_microbatches=s["microbatches"], max_tokens=s["seq_length"])
    sb = SparseBalanceConfig(sparse_balance=True, density=density, block_size=s["block"],
                             dense_below_tokens="0", raise_headroom="0")
    seq = sequential_plan(segments, **kw).with_length_multiple(multiple)
    sab = sab_plan(segments, cost_fn=latency_sample_cost_fn(lm, density), seed=0,
                   length_multiple=multiple, **kw)
    dense = lm.all_dense()
    sab_dense = sab_plan(segments, cost_fn=latency_sample_cost_fn(dense, 1.0), seed=0,
                         length_multiple=multiple, **kw)
    options = [(b, lm.unit_features(b.unit_csr(with_padding=True))) for b in (sab, seq)]
    layers = [s["layers"] // s["pp"]] * s["pp"]          # the quality objective's (default)
    densities, report, record = choose(sb, lm, options, s["dp"], dst=True, raise_headroom=0.0,
                                       stage_layers=layers)
    shape = (s["dp"], s["microbatches"], lm.num_stages)
    return {"static": (seq, np.full(shape, density), lm),
            "dst": (options[record["packing_index"]][0], np.asarray(densities), lm),
            "dense_sab": (sab_dense, np.ones(shape), dense),
            "_report": report}


def unit_lengths(batch) -> list:
    """[dp][m] the packed lengths of every micro-batch (padding pieces included)."""
    flat = batch.flat_lengths(with_padding=True)
    m = batch.num_microbatches
    return [[list(map(int, flat[r * m + i])) for i in range(m)] for r in range(batch.dp)]


def predicted(lm, batch, densities) -> tuple:
    """[dp, m, pp] fwd and bwd seconds the table gives the arm's units."""
    units = lm.unit_features(batch.unit_csr(with_padding=True))
    dp, m, pp = densities.shape
    per_stage = [lm.predict_many_fwd_bwd(units, densities[:, :, v].reshape(-1), v)
                 for v in range(pp)]
    return tuple(np.stack([p[k].reshape(dp, m) for p in per_stage], axis=-1) for k in (0, 1))


class UnitTimer:
    """Times units on this device: one stage model per kind, its budget set per unit."""

    def __init__(self, s: dict, backend: str, cuda: bool):
        import torch

        from sparsebalance_megatron.config import SparseBalanceConfig
        from sparsebalance_megatron.megatron.launch.profile import build_stage, init_single_process
        from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
        self.torch, self.cuda, self.s = torch, cuda, s
        self.sb = SparseBalanceConfig(sparse_attention=True, block_size=s["block"],
                                      attention_backend=backend, dense_below_tokens="0",
                                      dense_kernel="sdpa" if cuda else "auto")
        init_single_process(self.sb.seed)
        self.shape = model_shape(s)
        per = s["layers"] // s["pp"]
        self.kinds = (["first"] + ["middle"] * (s["pp"] - 2) + ["last"] if s["pp"] > 1
                      else ["only"])
        self.models = {}
        for k in dict.fromkeys(self.kinds):
            torch.manual_seed(self.sb.seed)
            net, self.dev = build_stage(self.shape, self.sb, k, per)
            budget = next(m.budget for m in net.modules() if isinstance(m, SparseCoreAttention))
            self.models[k] = (net, budget)
        self.cache = {}

    def time(self, stage: int, lengths, density: float, dense: bool, reps: int) -> tuple:
        """(fwd_s, bwd_s) of one unit, median of ``reps`` after one warm-up; cached by kind,
        documents, density and kernel."""
        kind = self.kinds[stage]
        key = (kind, tuple(lengths), round(float(density), 6), dense)
        if key not in self.cache:
            self.cache[key] = self._time(kind, lengths, density, dense, reps)
        return self.cache[key]

    def _time(self, kind, lengths, density, dense, reps):
        from sparsebalance_megatron.megatron.launch.profile import microbatch_inputs
        from sparsebalance_megatron.plan import BudgetPlan
        torch = self.torch
        net, budget = self.models[kind]
        psp, tokens, pos, hidden = microbatch_inputs(net, self.dev, self.shape, lengths)
        budget.set_routing(DENSE_ALL if dense else 0)
        budget.set_plan(BudgetPlan.static(0, float(density), 1, 1, 1), dp_rank=0, stage=0)
        fwd, bwd = [], []
        try:
            for i in range(1 + reps):
                net.zero_grad(set_to_none=True)
                if kind in ("middle", "last"):
                    net.set_input_tensor(hidden.clone().requires_grad_(True))
                labels = tokens if kind in ("last", "only") else None
                if self.cuda:
                    torch.cuda.synchronize()
                marks = [self._mark()]
                out = net(tokens if kind in ("first", "only") else None, pos, None,
                          labels=labels, packed_seq_params=psp)
                marks.append(self._mark())
                (out.float().mean() if labels is not None else out).backward(
                    None if labels is not None else torch.ones_like(out))
                marks.append(self._mark())
                f, b = self._elapsed(marks)
                if i:
                    fwd.append(f)
                    bwd.append(b)
        finally:
            budget.set_plan(None, dp_rank=0, stage=0)
            budget.set_routing(0)
            budget.pop_served()
            budget.pop_stats()
        return float(np.median(fwd)), float(np.median(bwd))

    def _mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _elapsed(self, marks):
        if self.cuda:
            marks[-1].synchronize()
            return (marks[0].elapsed_time(marks[1]) / 1e3, marks[1].elapsed_time(marks[2]) / 1e3)
        return marks[1] - marks[0], marks[2] - marks[1]


def measure(timer, arms: dict, reps: int, deadline: float) -> dict:
    """{arm: (fwd, bwd) [dp, m, pp] measured seconds, or None where time ran out}; a line per
    arm with its units and seconds (run 6 timed 25 units in 75 s and said nothing of where the
    time went)."""
    out = {}
    for arm in ARMS:
        batch, dens, _ = arms[arm]
        lengths = unit_lengths(batch)
        f, b = np.zeros(dens.shape), np.zeros(dens.shape)
        t0, before = time.time(), len(timer.cache)
        for r, i, v in np.ndindex(*dens.shape):
            if time.time() > deadline:
                out[arm] = None
                break
            f[r, i, v], b[r, i, v] = timer.time(v, lengths[r][i], dens[r, i, v],
                                                arm == "dense_sab", reps)
        else:
            out[arm] = (f, b)
        print(f"{arm}: {len(timer.cache) - before} new units timed in {time.time() - t0:.1f} s"
              + ("" if out[arm] else " (out of time)"), flush=True)
    return out


def compare(arms: dict, measured: dict, p2p: float) -> dict:
    """Each arm's predicted and measured step, the gains and the table's unit error."""
    from sparsebalance_megatron.sim.pipeline import simulate_1f1b
    rows = {}
    for arm in ARMS:
        batch, dens, lm = arms[arm]
        pf, pb = predicted(lm, batch, dens)
        row = {"predicted_step_s": simulate_1f1b(pf, pb, p2p).step_time_s,
               "mean_density": float(dens.mean()), "packing": batch.method}
        got = measured.get(arm)
        if got is not None:
            mf, mb = got
            sim = simulate_1f1b(mf, mb, p2p)
            err = np.abs(pf + pb - mf - mb) / (mf + mb)
            row.update(measured_step_s=sim.step_time_s, bubble_fraction=sim.bubble_fraction,
                       imbalance=sim.imbalance, unit_mape=float(err.mean()),
                       unit_max_error=float(err.max()),
                       measured_fwd_s=mf.tolist(), measured_bwd_s=mb.tolist())
        row.update(densities=np.round(dens, 4).tolist())
        rows[arm] = row
    st, d, dn = rows["static"], rows["dst"], rows["dense_sab"]
    summary = {"predicted_gain_vs_static": st["predicted_step_s"] / d["predicted_step_s"]}
    if "measured_step_s" in st and "measured_step_s" in d:
        g = st["measured_step_s"] / d["measured_step_s"]
        summary.update(measured_gain_vs_static=g, gain_gap_points=100 * (
            g - summary["predicted_gain_vs_static"]))
    if "measured_step_s" in dn and "measured_step_s" in d:
        summary["measured_vs_dense_sab"] = dn["measured_step_s"] / d["measured_step_s"]
    summary["predicted_vs_dense_sab"] = dn["predicted_step_s"] / d["predicted_step_s"]
    return {"arms": rows, "summary": summary}


def main(argv=None) -> int:
    p = parser(__doc__, "dst_gpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (the CPU test's)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=90.0)
    args = p.parse_args(argv)
    t0 = time.time()
    import torch

    from sparsebalance_megatron.data import GlobalBatchSampler, load_corpus

    from .device import length_free_backend
    cuda = torch.cuda.is_available() and not args.tiny
    s = dict(TINY_SHAPE if args.tiny or not cuda else GPU_SHAPE)
    # 'auto' as the runtime runs it at variable lengths (fa4, else triton; the torch kernel
    # off CUDA)
    backend = length_free_backend() if cuda else "torch"
    priced = backend if backend in ("fa4", "triton") else "triton"
    lm, described = latency_model(s, cuda, priced)
    lengths = np.asarray(load_corpus(tokenizer="qwen").lengths, dtype=np.int64)
    lengths = lengths[lengths >= s["min_doc_tokens"]]
    sampler = GlobalBatchSampler(lengths, capacity=s["seq_length"], dp=s["dp"],
                                 num_microbatches=s["microbatches"], seed=0,
                                 long_sample_policy="split")
    arms = plan_arms(lm, sampler.next_global_batch(), s, D0, s["block"])
    report = arms.pop("_report")
    timer = UnitTimer(s, backend, cuda)
    setup_s = time.time() - t0          # the corpus, the plans and the stage models
    print(f"set up in {setup_s:.1f} s", flush=True)
    measured = measure(timer, arms, args.reps, t0 + args.budget_s)
    got = compare(arms, measured, lm.p2p_s)
    summ = got["summary"]
    targets = {}
    if "measured_gain_vs_static" in summ:
        targets = {"dst_gain_within_2_points_of_predicted": abs(summ["gain_gap_points"]) <= 2,
                   "dst_never_below_static": summ["measured_gain_vs_static"] >= 1.0}
    doc = {"shape": s, "backend": backend, "device": "cuda" if cuda else "cpu",
           "table": described, "d0": D0, "units_timed": len(timer.cache),
           "setup_s": setup_s,
           "p2p_s": lm.p2p_s,
           "dst_report": {k: report.get(k) for k in ("units_cut", "units_raised", "speedup",
                                                     "step_time_planned_s",
                                                     "step_time_static_s")},
           "seconds": time.time() - t0, **got, "targets": targets}
    for arm, r in got["arms"].items():
        m = r.get("measured_step_s")
        print(f"{arm:10s} predicted {1e3 * r['predicted_step_s']:8.1f} ms  measured "
              + (f"{1e3 * m:8.1f} ms  unit MAPE {100 * r['unit_mape']:.1f}%" if m else "-"))
    print({k: round(v, 4) for k, v in summ.items()}, targets)
    write_result(args.json, doc)
    return 0
