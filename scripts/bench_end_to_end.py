"""End-to-end comparison of dense, static sparse, SAB, DST and SAB+DST (issue 5 item 4, issue 4).

Same data (the built-in real corpus: its heavy-tailed length mix), same d0, five variants:

- ``dense``: no sparse attention (Megatron's sequential packing);
- ``static``: static sparse attention at d0 (``--sb-sparse-attention``), sequential packing;
- ``token_balanced``: the same with token-balanced packing (``--sb-packing token_balanced``): the
  best static configuration of a DP run (no layer split to choose); ``vs_tb`` divides by it;
- ``sab``: + sparsity-aware batching (``--sb-batching``), every unit at d0;
- ``dst``: + dynamic sparsity tuning (``--sb-dst``), sequential packing;
- ``sab_dst``: both (``--sparse-balance``).

**real**: CPU torchrun runs of the training entry (gloo; DP=2, or PP=2 x DP=1 with ``--pp 2``),
all in this one invocation, back to back in rounds whose variant order rotates, so that every
variant sees the same background load as far as a shared machine allows. The model is chosen so
that attention is a large share of the step (byte tokenizer: tiny LM head; 8K-token micro-batches;
hidden 64), as in long-context training; otherwise there is nothing to balance. Global batch 4
(2 micro-batches per rank) by default: fewer, longer micro-batches per rank, as at 32K+ contexts. Per variant:
step time (median over the steady steps of all rounds: the first ``--warmup`` steps of each run
are dropped), speedup over static, imbalance (max / mean of the measured per-rank fwd+bwd busy
seconds, median over steps), bubble fraction (derived: 1 - measured busy / (ranks x step time), so
it counts all-reduce, optimizer and framework time as idle too) and the mean density weighted by
attention work (dense 1; static and SAB d0; DST: the plan's work-weighted mean from the metrics).
The DST/SAB runs share one latency table, profiled once here for the run's model (or
``--latency-table``), so no run profiles inside its start-up.

**sim**: ``sparsebalance_megatron.experiments.study`` at 8, 32 and 256 DP ranks x PP=4 on the qwen-token
length mix at 32K tokens per micro-batch, timed by the analytic Qwen2.5-0.5B H100 table (FLOPs /
published throughputs: no GPU table exists here; a CPU table of a tiny model must not be used for
a scale study, docs/DESIGN.md section 7).

    python scripts/bench_end_to_end.py --json runs/end_to_end.json --plot docs/end_to_end.png
    python scripts/bench_end_to_end.py --quick          # < 2 minutes on 2 cores; indicative only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "examples" / "pretrain_gpt_sparsebalance.py"
VARIANTS = ("dense", "static", "token_balanced", "sab", "dst", "sab_dst")
VARIANT_FLAGS = {"dense": [], "static": ["--sb-sparse-attention"],
                 "token_balanced": ["--sb-sparse-attention", "--sb-packing", "token_balanced"],
                 "sab": ["--sb-sparse-attention", "--sb-batching"], "dst": ["--sb-dst"],
                 "sab_dst": ["--sparse-balance"]}
NEEDS_TABLE = ("sab", "dst", "sab_dst")
SIM_RANKS = (8, 32, 256)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small model, few steps, one round (< 2 min on 2 cores; indicative)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="bar chart of the variants (PNG)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-sim", action="store_true")
    r = p.add_argument_group("real CPU runs")
    r.add_argument("--pp", type=int, default=1, choices=(1, 2),
                   help="1: DP=2; 2: PP=2 x DP=1 (2 processes either way)")
    r.add_argument("--steps", type=int, default=None, help="steps per run (default 10; quick 5)")
    r.add_argument("--warmup", type=int, default=None,
                   help="first steps of each run left out (default 2; quick 1)")
    r.add_argument("--rounds", type=int, default=None,
                   help="runs per variant, order rotated each round (default 3; quick 1)")
    r.add_argument("--num-layers", type=int, default=None, help="default 2")
    r.add_argument("--hidden-size", type=int, default=64)
    r.add_argument("--seq-length", type=int, default=None, help="default 8192; quick 4096")
    r.add_argument("--global-batch-size", type=int, default=4)
    r.add_argument("--doc-unit", default="section", choices=("file", "section"))
    r.add_argument("--tokenizer", default="byte")
    r.add_argument("--density", type=float, default=0.5, help="d0 of every sparse variant")
    r.add_argument("--block-size", type=int, default=64)
    r.add_argument("--latency-table", default=None,
                   help="CPU latency table of this model (default: profile one once, cached "
                        "under --out-dir)")
    r.add_argument("--out-dir", default="runs/bench_end_to_end", help="metrics and logs")
    r.add_argument("--timeout", type=int, default=900, help="seconds per run")
    r.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="more flags for every run (last on the line), e.g. --sb-straggler-rank 1")
    s = p.add_argument_group("simulator")
    s.add_argument("--sim-ranks", type=int, nargs="+", default=list(SIM_RANKS))
    s.add_argument("--sim-steps", type=int, default=None, help="default 3; quick 1")
    s.add_argument("--sim-seq-length", type=int, default=32768)
    s.add_argument("--sim-microbatches", type=int, default=8)
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (("steps", 10, 5), ("warmup", 2, 1), ("rounds", 3, 1),
                              ("num_layers", 2, 1), ("seq_length", 8192, 4096),
                              ("sim_steps", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


# --- real runs --------------------------------------------------------------------------------

@dataclass
class CpuRunConfig:
    """The model and data of the real CPU runs (the same for every variant compared)."""

    num_layers: int = 2
    hidden_size: int = 64
    seq_length: int = 8192
    global_batch_size: int = 4
    pp: int = 1
    tokenizer: str = "byte"
    doc_unit: str = "section"
    density: float = 0.5
    block_size: int = 64

    @classmethod
    def from_args(cls, args) -> "CpuRunConfig":
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__})

    def shape(self):
        """The model as a profiler ``ModelShape`` (the one list of its dimensions)."""
        from sparsebalance_megatron.latency.shape import ModelShape

        return ModelShape(num_layers=self.num_layers, hidden_size=self.hidden_size,
                          ffn_hidden_size=2 * self.hidden_size, num_attention_heads=4,
                          num_query_groups=2, vocab_size=self.padded_vocab_size(),
                          seq_length=self.seq_length, pp=self.pp, swiglu=True)

    def flags(self) -> list:
        """Megatron + SparseBalance flags of the run (no variant flags)."""
        m = self.shape()
        return [
            "--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
            "--ffn-hidden-size", m.ffn_hidden_size, "--num-attention-heads", m.num_attention_heads,
            "--group-query-attention", "--num-query-groups", m.num_query_groups,
            "--seq-length", m.seq_length, "--max-position-embeddings", m.seq_length,
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--attention-dropout", 0, "--hidden-dropout", 0,
            "--micro-batch-size", 1, "--global-batch-size", self.global_batch_size,
            "--lr", 1e-3, "--lr-decay-style", "constant", "--clip-grad", 1.0,
            "--log-interval", 1, "--seed", 7, "--eval-iters", 0,
            "--pipeline-model-parallel-size", m.pp,
            "--sb-tokenizer", self.tokenizer, "--sb-doc-unit", self.doc_unit,
            "--sb-density", self.density, "--sb-block-size", self.block_size,
        ]

    def padded_vocab_size(self) -> int:
        """What the trainer computes from the compact built-in corpus."""
        from sparsebalance_megatron.data import load_corpus

        n = load_corpus(tokenizer=self.tokenizer, compact_vocab=True,
                        doc_unit=self.doc_unit).vocab_size
        return ((n + 127) // 128) * 128

    def ensure_latency_table(self, out_dir: Path) -> tuple[str, float]:
        """(path, seconds spent profiling) of this model's CPU latency table: profiled once
        (quick grid, min over repeats: it resists contention) and reused from ``out_dir``."""
        from sparsebalance_megatron import __version__

        key = (f"l{self.num_layers}h{self.hidden_size}s{self.seq_length}pp{self.pp}"
               f"b{self.block_size}_{self.tokenizer}_v{__version__}")  # runs refuse other versions
        path = out_dir / f"latency_{key}.json"
        if path.exists():
            return str(path), 0.0
        cmd = [sys.executable, "-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
               "--no-progress", "--statistic", "min", "--out", str(path),
               *self.shape().cli_flags(), "--sb-block-size", self.block_size]
        print(f"profiling the CPU latency table of this model -> {path}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            sys.exit(f"latency profiling failed:\n{proc.stdout[-3000:]}")
        return str(path), time.perf_counter() - t0


def write_json(path: str, result: dict) -> None:
    """Write a bench result (creating the folder) and say where."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_variant(variant: str, flags: list, *, steps: int, metrics: Path, log: Path,
                timeout: int, entry=None) -> list[dict]:
    """One torchrun (2 processes, gloo) of the training entry; returns its metrics lines."""
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *(entry or [str(ENTRY)]), *flags, "--train-iters", steps,
           "--sb-metrics-file", str(metrics)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=_env(), stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{variant}: torchrun failed ({proc.returncode}), log {log}:\n{tail}")
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    print(f"  {variant:<8} {len(lines)} steps in {time.perf_counter() - t0:5.1f} s wall "
          f"(step times {', '.join(f'{r['step_time_s']:.2f}' for r in lines)})", flush=True)
    return lines


def rotated(variants, k: int) -> list:
    k %= len(variants)
    return list(variants[k:]) + list(variants[:k])


def run_real(args, variants) -> dict:
    out_dir = REPO / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = CpuRunConfig.from_args(args)
    table, prof_s = args.latency_table, 0.0
    if table is None and any(v in NEEDS_TABLE for v in variants):
        table, prof_s = cfg.ensure_latency_table(out_dir)
    base = cfg.flags() + list(args.extra)
    runs: dict[str, list] = {v: [] for v in variants}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
        for v in rotated(variants, rnd):
            flags = base + VARIANT_FLAGS[v]
            if v in NEEDS_TABLE:
                flags += ["--sb-latency-table", table]
            lines = run_variant(v, flags, steps=args.steps, timeout=args.timeout,
                                metrics=out_dir / f"{v}_r{rnd}.jsonl",
                                log=out_dir / f"{v}_r{rnd}.log")
            runs[v].append(lines)
    wall = time.perf_counter() - t0
    rows = summarize_real(runs, args)
    return {"rows": rows, "latency_table": table, "profile_s": prof_s, "wall_s": wall}


def summarize_real(runs: dict, args) -> dict:
    """Per variant: the report row from its runs' metrics (steady steps only)."""
    nproc = 2
    rows = {}
    for v, rounds in runs.items():
        steady = [r for lines in rounds for r in lines if r["step"] > args.warmup]
        times = [r["step_time_s"] for r in steady]
        imb = [r["measured_imbalance"] for r in steady if "measured_imbalance" in r]
        idle = [1.0 - sum(r["rank_busy_s"]) / (nproc * r["step_time_s"])
                for r in steady if r.get("rank_busy_s")]
        if v == "dense":
            dens = 1.0
        elif v in ("static", "token_balanced", "sab"):
            dens = args.density
        else:
            dens = float(np.mean([r["mean_density"] for r in steady]))
        row = {"step_time_s": statistics.median(times),
               "step_time_mean_s": float(np.mean(times)),
               "step_times_s": [round(t, 4) for t in times],
               "imbalance": statistics.median(imb) if imb else None,
               "bubble_fraction": statistics.median(idle) if idle else None,
               "mean_density": dens,
               "overhead_fraction": float(np.median([r["sb_overhead_s"] / r["step_time_s"]
                                                     for r in steady])),
               "steps": len(steady)}
        if v in ("dst", "sab_dst"):
            pred = [(r["predicted_static_s"], r["predicted_step_s"]) for r in steady
                    if "predicted_step_s" in r]
            if pred:
                row["predicted_speedup_vs_static_plan"] = (sum(a for a, _ in pred)
                                                           / sum(b for _, b in pred))
            cal = [c for r in steady for c in r.get("calibration", [])]
            if cal:
                row["calibration_median"] = statistics.median(cal)
        if v in NEEDS_TABLE:
            row["latency_error"] = latency_error(rounds, args.warmup)
        rows[v] = row
    if "static" in rows:
        st = rows["static"]
        for v, row in rows.items():
            row["speedup_vs_static"] = st["step_time_s"] / row["step_time_s"]
            row["speedup_vs_static_mean"] = st["step_time_mean_s"] / row["step_time_mean_s"]
            row["speedup_paired_median"] = _paired(runs["static"], runs[v], args.warmup)
            if "token_balanced" in rows:
                row["speedup_vs_token_balanced"] = (rows["token_balanced"]["step_time_s"]
                                                    / row["step_time_s"])
                row["speedup_paired_vs_token_balanced"] = _paired(
                    runs["token_balanced"], runs[v], args.warmup)
    return rows


def latency_error(rounds, warmup: int):
    """Median relative error of the calibrated latency model on the per-rank busy seconds:
    step t's uncorrected prediction x the calibration after step t-1 (what the plan of step t
    used) vs step t's measurement. None when the metrics lack it."""
    errs = []
    for lines in rounds:
        for prev, cur in zip(lines, lines[1:]):
            if cur["step"] <= warmup or not all(k in cur for k in ("predicted_busy_s",
                                                                     "rank_busy_s")):
                continue
            cal = prev.get("calibration") or [1.0] * len(cur["rank_busy_s"])
            errs += [abs(p * c - m) / m for p, c, m in
                     zip(cur["predicted_busy_s"], cal, cur["rank_busy_s"]) if m > 0]
    return statistics.median(errs) if errs else None


def _paired(static_rounds, rounds, warmup: int):
    """Median over (round, step) of static step time / variant step time: the same global batch
    (same seed) run at nearly the same time, so slow drifts of the background load cancel."""
    ratios = []
    for a, b in zip(static_rounds, rounds):
        sa = {r["step"]: r["step_time_s"] for r in a if r["step"] > warmup}
        ratios += [sa[r["step"]] / r["step_time_s"] for r in b if r["step"] in sa]
    return statistics.median(ratios) if ratios else None


# --- simulator --------------------------------------------------------------------------------

def run_sim(args, variants) -> dict:
    from sparsebalance_megatron.data import load_corpus
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.experiments.study import StudyConfig, run_config

    lm = LatencyModel.analytic(pp=4)
    corpus = load_corpus(tokenizer="qwen")
    lengths = np.asarray(corpus.lengths, dtype=np.int64)
    cfg = StudyConfig(microbatches=args.sim_microbatches, seq_length=args.sim_seq_length,
                      density=args.density, steps=args.sim_steps)
    names = [v for v in variants if v != "static"]
    res = {str(dp): run_config(dp, cfg, lm, lengths, ["static"] + names) for dp in args.sim_ranks}
    return {"rows": {dp: {v: rows[v] for v in variants} for dp, rows in res.items()},
            "latency_source": "ANALYTIC Qwen2.5-0.5B / 32K / H100 table (published "
                              "throughputs, not measured)",
            "corpus": repr(corpus), "config": vars(cfg)}


# --- output -----------------------------------------------------------------------------------

def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_tables(result: dict, args) -> None:
    hdr = (f"{'variant':<14} {'step_s':>8} {'speedup':>8} {'imbal':>6} {'bubble':>7} "
           f"{'density':>8}")
    if "real" in result:
        r = result["meta"]["real"]
        print(f"\nreal: CPU torchrun, {'DP=2' if args.pp == 1 else 'PP=2 x DP=1'}, "
              f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
              f"global batch {args.global_batch_size}, {args.tokenizer} tokens, doc unit "
              f"{args.doc_unit}, d0 {args.density}, block {args.block_size}; {args.rounds} "
              f"round(s) x {args.steps} steps, first {args.warmup} dropped; wall "
              f"{r['wall_s']:.0f} s (+{r['profile_s']:.0f} s profiling)")
        if args.quick:
            print("QUICK: small model and few steps; these numbers are indicative only")
        print(hdr + f" {'paired':>7} {'mean_s':>7} {'ovh%':>6} {'lat_err':>7} {'pred':>6} "
              f"{'vs_tb':>6} {'pair_tb':>7}")
        for v, row in result["real"].items():
            print(f"{v:<14} {row['step_time_s']:>8.3f} {row['speedup_vs_static']:>8.3f} "
                  f"{_fmt(row['imbalance'], '6.3f')} {_fmt(row['bubble_fraction'], '7.3f')} "
                  f"{row['mean_density']:>8.3f} {_fmt(row['speedup_paired_median'], '7.3f')} "
                  f"{row['step_time_mean_s']:>7.3f} {100 * row['overhead_fraction']:>6.2f} "
                  f"{_fmt(row.get('latency_error'), '7.3f')} "
                  f"{_fmt(row.get('predicted_speedup_vs_static_plan'), '6.3f')} "
                  f"{_fmt(row.get('speedup_vs_token_balanced'), '6.3f')} "
                  f"{_fmt(row.get('speedup_paired_vs_token_balanced'), '7.3f')}")
        print("paired: median over steps of static / variant step time on the same global "
              "batch; lat_err: median |calibrated prediction - measured| / measured of per-rank "
              "busy; pred: DST's predicted static / planned step time; bubble: 1 - measured "
              "fwd+bwd busy / (2 ranks x step time)")
    if "sim" in result:
        print(f"\nsim: {result['meta']['sim']['latency_source']}, PP=4, "
              f"{args.sim_microbatches} micro-batches of {args.sim_seq_length} tokens per rank, "
              f"{args.sim_steps} steps, d0 {args.density}")
        print(f"{'ranks':>6} " + hdr)
        for dp, rows in result["sim"].items():
            for v, row in rows.items():
                print(f"{dp:>6} {v:<14} {row['step_time_s']:>8.3f} "
                      f"{row['speedup_vs_static']:>8.3f} {row['imbalance']:>6.3f} "
                      f"{row['bubble_fraction']:>7.3f} {row['mean_density']:>8.3f}")


def plot(result: dict, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (["real"] if "real" in result else []) + (["sim"] if "sim" in result else [])
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 4.2 * len(panels)), squeeze=False)
    axes = axes.ravel()
    colors = {"dense": "#999999", "static": "#4c72b0", "token_balanced": "#8172b3",
              "sab": "#55a868", "dst": "#dd8452",
              "sab_dst": "#c44e52"}
    k = 0
    if "real" in result:
        rows = result["real"]
        names = list(rows)
        ax = axes[k]
        bars = ax.bar(names, [rows[v]["speedup_vs_static"] for v in names],
                      color=[colors[v] for v in names])
        for b, v in zip(bars, names):
            ax.annotate(f"{rows[v]['step_time_s']:.2f}s\nd={rows[v]['mean_density']:.2f}",
                        (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel("speedup vs static (median step time)")
        ax.set_title(f"real CPU torchrun ({'DP=2' if args.pp == 1 else 'PP=2'}, seq "
                     f"{args.seq_length}){' QUICK' if args.quick else ''}", fontsize=10)
        ax.margins(y=0.2)
        ax = axes[k + 1]
        ax.bar(names, [rows[v]["imbalance"] or 0 for v in names], color=[colors[v] for v in names])
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylim(bottom=0.9)
        ax.set_ylabel("imbalance (max/mean rank busy)")
        ax.set_title("real CPU: measured imbalance", fontsize=10)
        k += 2
    if "sim" in result:
        sim = result["sim"]
        dps = list(sim)
        names = list(next(iter(sim.values())))
        width = 0.8 / len(names)
        x = np.arange(len(dps))
        for metric, ax, label in (("speedup_vs_static", axes[k], "speedup vs static"),
                                  ("imbalance", axes[k + 1], "imbalance (max/mean rank)")):
            for j, v in enumerate(names):
                vals = [sim[dp][v][metric] for dp in dps]
                bars = ax.bar(x + (j - (len(names) - 1) / 2) * width, vals, width, label=v,
                              color=colors[v])
                if metric == "speedup_vs_static":
                    for b, dp in zip(bars, dps):
                        ax.annotate(f"{sim[dp][v]['mean_density']:.2f}",
                                    (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=6, rotation=90)
            ax.set_xticks(x, [f"{dp} DP x PP=4" for dp in dps])
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_ylabel(label)
            ax.margins(y=0.15)
        axes[k].set_title("sim, analytic Qwen2.5-0.5B H100 table\n(labels: work-weighted "
                          "mean density)", fontsize=10)
        axes[k + 1].set_ylim(bottom=0.9)
        axes[k + 1].set_title("sim: imbalance", fontsize=10)
        axes[k + 1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    variants = [v for v in VARIANTS if v in args.variants]
    if "static" not in variants:
        sys.exit("--variants must include static (the baseline)")
    t0 = time.perf_counter()
    result: dict = {"meta": {"command": " ".join(sys.argv), "quick": args.quick,
                             "config": {k: v for k, v in vars(args).items()
                                        if k not in ("json", "plot")}}}
    if not args.skip_sim:
        sim = run_sim(args, variants)
        result["sim"] = sim.pop("rows")
        result["meta"]["sim"] = sim
    if not args.skip_real:
        real = run_real(args, variants)
        result["real"] = real.pop("rows")
        result["meta"]["real"] = real
    result["meta"]["wall_s"] = time.perf_counter() - t0
    if args.quick:
        result["meta"]["note"] = "quick: small model, few steps; numbers are indicative only"
    print_tables(result, args)
    print(f"\n({result['meta']['wall_s']:.0f} s)")
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot(result, args.plot, args)


if __name__ == "__main__":
    main()
