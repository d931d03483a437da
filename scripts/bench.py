"""The one benchmark runner: every study behind a BENCHMARKS.md, QUALITY.md or docs/ figure.

    python scripts/bench.py                      # the studies, one line each
    python scripts/bench.py NAME --help          # a study's flags
    python scripts/bench.py NAME [flags] --json docs/results/NAME.json

Each study is a module of ``scripts/studies/`` with ``main(argv)``; what studies share is in the
few modules ``SHARED`` names.
"""

from __future__ import annotations

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> what it measures [where its figures are]
STUDIES = {
    "sim_study": "simulated step: every variant vs the best static [BENCHMARKS headline, CP]",
    "planner_cost": "planning overhead (thread CPU) of SAB + DST [BENCHMARKS planner cost]",
    "planner_ab": "the planner's draft, this checkout vs another [BENCHMARKS planner cost]",
    "control_plane": "a rank's draft, bytes, critical path to 16K GPUs [BENCHMARKS control plane]",
    "plugin_cost": "the plugin's per-step cost as the simulator charges it [BENCHMARKS headline]",
    "hybrid_cp": "Megatron's hybrid CP against a2a CP + SAB/DST, simulated [BENCHMARKS CP]",
    "attention": "sparse attention kernels on CPU: time, recall [BENCHMARKS attention kernel]",
    "compile_gate": "every Triton kernel compiled for sm_90a on CPU [docs/GPU.md]",
    "attention_gpu": "the GPU kernel table: every backend vs dense [BENCHMARKS on a GPU]",
    "fa4_pieces": "where one sparse call's time goes, kernel by kernel [docs/GPU.md]",
    "latency_eval": "a latency table's held-out error on real micro-batches [BENCHMARKS latency]",
    "latency_cv": "offline cross-validation of a stored latency table [BENCHMARKS latency model]",
    "full_depth": "the 24-layer e2e model's memory and seconds from run 5 [BENCHMARKS on a GPU]",
    "dst_gpu": "DST with GPU timings composed by the simulator [docs/GPU.md]",
    "sim_validation": "the 1F1B simulator vs a real run's step times [BENCHMARKS latency model]",
    "mask_memory": "BlockMask bytes per layer call against a dense mask [BENCHMARKS mask memory]",
    "context_parallel": "a2a context-parallel attention alone, CP=2 vs CP=1 (CPU) [BENCHMARKS CP]",
    "cp_step": "whole pretrain() steps on CPU, CP=2 vs CP=1 [BENCHMARKS CP]",
    "dense_sab_run": "dense pretrain() on CPU: SAB vs sequential, balanced [BENCHMARKS dense]",
    "plan_quality": "the quality model DST plans by, checked on unseen plans [BENCHMARKS, QUALITY]",
    "sensitivity_signal": "which online signal tracks sparsity sensitivity [BENCHMARKS accuracy]",
    "long_context": "long-context retrieval (needle, variable tracking, QA) in Megatron [QUALITY]",
    "continued_quality": "a dense base continued under static, DST, SAB, controls [QUALITY]",
    "inference_quality": "SmolLM2-135M under DST's plans vs uniform at equal time [QUALITY]",
}
# what the studies share (modules of scripts/studies/ that are not studies)
SHARED = ("common", "continued_verdicts", "device", "drafts", "gpu_trace", "kernels", "slowdown",
          "smollm2")


def usage() -> str:
    width = max(map(len, STUDIES))
    rows = [f"  {n:<{width}}  {what}" for n, what in STUDIES.items()]
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
