"""The plugin's own per-step cost on the critical path, as the simulator studies charge it
(``experiments/plugin_cost.py``), by part and by planner form."""

from __future__ import annotations

import numpy as np

from .common import parser, write_result

PP = 4
SEQ = 32768
# (name, DP, micro-batches, TP): each at PP 4 with 4 virtual stages, 32K tokens a micro-batch
SHAPES = (("8 DP x PP 4 x 8 mb, 32K (the studies)", 8, 8, 1),
          ("32 DP x PP 4 x 8 mb, 32K (the studies)", 32, 8, 1),
          ("64 DP x 16 x PP 4, 32K (issue 44)", 64, 16, 1),
          ("DP 4 x PP 4 x 16, 32K (the paper's)", 4, 16, 1),
          ("1,024 GPUs: DP 32 x PP 4 x TP 8 x 16, 32K", 32, 16, 8))


def breakdown(cost, step_s=None) -> list:
    """The charge of SAB + DST (stand-down on) at every ``SHAPES`` entry, per planner form."""
    from sparsebalance_megatron.config import PLANNERS
    from sparsebalance_megatron.experiments.plugin_cost import Shape

    out = []
    for name, dp, m, tp in SHAPES:
        shape = Shape(dp=dp, microbatches=m, pp=PP, virtual_stages=4, seq_length=SEQ, tp=tp)
        for planner in PLANNERS:
            ch = cost.charge(shape, sab=True, dst=True, planner=planner, stand_down=True)
            row = dict(shape=name, planner=planner, total_ms=ch.plan_s * 1e3,
                       parts_ms=ch.parts_ms, flags=ch.flags, source=ch.source)
            if step_s and name in step_s:
                row["static_step_s"] = step_s[name]
                row["share_of_step"] = ch.plan_s / step_s[name]
            out.append(row)
    return out


def static_steps() -> dict:
    """The simulated step the charge is a share of: the analytic Qwen2.5-0.5B / H100 table's
    (the kernel ``auto`` runs), even split, one global batch of the built-in corpus SAB-packed
    at d0 0.5 and every unit at d0; shapes with TP are skipped (TP is not modelled)."""
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps
    from sparsebalance_megatron.policy import UnitCosts
    from sparsebalance_megatron.sim import pipeline_makespan_s

    out = {}
    for name, dp, m, tp in SHAPES:
        if tp > 1:
            continue
        c = corpus_steps(dp, m, 0.5, 1, seq=SEQ, layout="even", pp=PP)
        costs = UnitCosts.from_latency(c.lm, c.plans[0].unit_csr(with_padding=True), dp, m,
                                       np.array([0.5]))
        f, b = costs.at(np.zeros(costs.shape, dtype=np.int64))
        out[name] = float(pipeline_makespan_s(f, b, c.lm.p2p_s, pp=PP).max())
    return out


def main(argv=None) -> int:
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.experiments.plugin_cost import PluginCost

    p = parser(__doc__, "plugin_cost")
    args = p.parse_args(argv)
    sb = SparseBalanceConfig()
    cost = PluginCost.from_results(sb.dst_objective, sb.dst_descent)
    table = breakdown(cost, static_steps())
    print(f"SAB + DST, the plugin's critical-path cost per step as the studies charge it "
          f"({cost.planner.source}; {cost.control.source}; share: of the simulated static step)")
    print(f"{'shape':<44} {'planner':>8} {'total ms':>9} {'planning':>9} {'gather':>8} "
          f"{'bcast':>7} {'calib':>7} {'share':>7}")
    for r in table:
        q = r["parts_ms"]
        share = f"{100 * r['share_of_step']:6.2f}%" if "share_of_step" in r else f"{'-':>7}"
        print(f"{r['shape']:<44} {r['planner']:>8} {r['total_ms']:>9.1f} "
              f"{q['planning']:>9.1f} {q['gather']:>8.2f} {q['broadcast']:>7.2f} "
              f"{q['calibration']:>7.2f} {share}")
    if args.json:
        write_result(args.json, {
            "what": "the charge per step as the studies price it (charge)",
            "assumptions": {"pp": PP, "sensitivity_signal": sb.sensitivity_signal},
            "charge": table, "planner_cost": cost.planner.source,
            "control_plane": cost.control.source, "notes": cost.notes})
    return 0
