"""The one benchmark runner: every study behind a BENCHMARKS.md, QUALITY.md or docs/ figure.

    python scripts/bench.py                      # the studies, one line each
    python scripts/bench.py NAME --help          # a study's flags
    python scripts/bench.py NAME [flags] --json docs/results/NAME.json

Every study writes JSON that records its command, commit, versions and device
(``studies/common.py``). Each study is a module of ``scripts/studies/`` with ``main(argv)``; what
studies share is in the few modules ``SHARED`` names.
"""

from __future__ import annotations

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (what it measures, where its figures are)
STUDIES = {
    "sim_study": ("simulated step: every variant against the best static layout and packing",
                  "BENCHMARKS.md headline, robustness, do no harm, CP"),
    "planner_cost": ("planning overhead (thread CPU) of SAB + DST at 64 DP x 16 x PP 4",
                     "BENCHMARKS.md headline"),
    "planner_ab": ("the planner's draft CPU and plans, this checkout against another, "
                   "alternated", "BENCHMARKS.md the planner's own cost"),
    "control_plane": ("a rank's draft by phase, its bytes and the critical path on the per-rank "
                      "path, 128 to 16,384 GPUs",
                      "BENCHMARKS.md control plane"),
    "sab_ranks": ("SAB's packing per DP rank: every rank's micro-batches against a rank's own "
                  "only, by phase, DP 512 to 4,096 (thread CPU)", "BENCHMARKS.md control plane"),
    "plugin_cost": ("the plugin's own per-step cost as the simulator charges it, by part and "
                    "planner form", "BENCHMARKS.md headline (net figures)"),
    "hybrid_cp": ("Megatron's hybrid-CP scheduler against a2a CP + SAB/DST (simulated)",
                  "BENCHMARKS.md context parallelism"),
    "attention": ("sparse attention kernels on CPU: time, recall, training loss",
                  "BENCHMARKS.md attention kernel"),
    "compile_gate": ("every Triton kernel compiled for the H100 (sm_90a) on CPU, per launch config",
                     "BENCHMARKS.md attention kernel, docs/GPU.md"),
    "attention_gpu": ("the GPU kernel table: every backend against dense, crossover",
                      "BENCHMARKS.md attention on GPU, docs/GPU.md"),
    "fa4_pieces": ("where one sparse call's time goes, kernel by kernel, host and GPU apart: "
                   "FA4's side passes, both GQA backward forms, selection, copies (GPU)",
                   "issue 74's device plan (gpu_check.py --steps pieces), docs/GPU.md"),
    "latency_eval": ("a latency table's held-out error on real micro-batches",
                     "BENCHMARKS.md latency model, docs/GPU.md"),
    "latency_cv": ("offline cross-validation of a stored latency table",
                   "BENCHMARKS.md attention on GPU, docs/GPU.md"),
    "full_depth": ("the end-to-end call's 24-layer model: memory and seconds per step and run, "
                   "from run 5's 8-layer figures", "BENCHMARKS.md on a GPU, docs/GPU.md"),
    "dst_gpu": ("DST with GPU timings: a PP x DP step's units timed on one device, composed "
                "by the simulator; DST, static and dense + SAB", "BENCHMARKS.md on a GPU"),
    "sim_validation": ("the 1F1B simulator against a real torchrun run's step times",
                       "BENCHMARKS.md latency model"),
    "mask_memory": ("BlockMask bytes per layer call against a dense mask",
                    "BENCHMARKS.md BlockMask memory"),
    "context_parallel": ("a2a context-parallel attention alone, CP=2 vs CP=1 (CPU)",
                         "BENCHMARKS.md context parallelism, docs/CONTEXT_PARALLEL.md"),
    "cp_step": ("whole pretrain() steps on CPU, CP=2 vs CP=1 (the README's job)",
                "BENCHMARKS.md context parallelism, attention alone"),
    "dense_sab_run": ("dense attention, pretrain() on CPU: SAB vs sequential vs token-balanced "
                      "packing, paired steps", "BENCHMARKS.md against dense, README results"),
    "plan_quality": ("the quality model DST plans by: fitted on a real model's loss by depth "
                     "group, density and length, checked on whole plans it has not seen",
                     "BENCHMARKS.md quality model, QUALITY.md"),
    "sensitivity_signal": ("which online signal tracks measured sparsity sensitivity",
                           "BENCHMARKS.md DST's accuracy side"),
    "long_context": ("long-context retrieval (needle, variable tracking, QA) in Megatron",
                     "QUALITY.md"),
    "continued_quality": ("a dense-trained base continued under static, --sparse-balance, SAB "
                          "alone, matched static and a 0.9 x d0 control on CPU: a verdict",
                          "QUALITY.md"),
    "inference_quality": ("SmolLM2-135M under the runtime's DST plans at two layouts against "
                          "uniform d0 and uniform at DST's predicted step time, with a positive "
                          "control and a pilot's margins: free accuracy, a verdict",
                          "QUALITY.md"),
}
# what the studies share (modules of scripts/studies/ that are not studies)
SHARED = ("common", "device", "gpu_trace", "kernels", "smollm2")


def usage() -> str:
    width = max(map(len, STUDIES))
    rows = [f"  {n:<{width}}  {what} [{where}]" for n, (what, where) in STUDIES.items()]
    return ("usage: python scripts/bench.py NAME [flags]   (NAME --help: its flags)\n\nstudies:\n"
            + "\n".join(rows))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in STUDIES:
        print(f"error: no study {name!r}; expected one of: {', '.join(STUDIES)}",
              file=sys.stderr)
        return 2
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from studies import common
    common.COMMAND = ["python", "scripts/bench.py", name, *rest]
    sys.argv = [f"scripts/bench.py {name}", *rest]
    return importlib.import_module(f"studies.{name}").main(rest) or 0


if __name__ == "__main__":
    raise SystemExit(main())
