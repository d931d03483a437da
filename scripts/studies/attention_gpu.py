"""GPU kernel table: our block-sparse kernels against cuDNN's dense attention, pass by pass
(``studies/kernels.py`` times and summarises; docs/GPU.md and docs/benchmarks/attention-gpu.md
give the rows, grid and targets)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from .common import ROOT, gpu_provenance, parser, write_result
from .kernels import (Case, Clock, Lists, RowLog, add_row_args, call_fn, check, crossover_of,
                      dense_passes, e_against, kernel_fn, make_mixes, parse_shape, pass_times,
                      print_table, rates, summarize, usable_backends)

DENSITIES = (0.25, 0.5, 1.0, 0.125)
SINGLE_LENGTHS = (32768,)
TARGET_SHAPE = "8/2/128"
SHAPES = (TARGET_SHAPE, "14/2/64")
BACKENDS = ("triton", "fa4", "flex", "flash")
KERNEL_BACKENDS = ("triton", "fa4")         # callable alone on lists (kernel rows, checks)
SPLIT = ("host", "gpu", "held")              # pass_times' host / GPU-alone keys (fwd_host_ms, ...)
MIXES_PATH = os.path.join(ROOT, "docs", "results", "packed_mixes_32k.json")
# the correctness case: several documents (a 1-token one, short last blocks), density 0.3
CHECK_LENS = (1000, 1, 1499, 1596)
CHECK_DENSITY = 0.3
FA4_REPEATS = 5


def plan_cases(args, mixes):
    """The micro-batches in the order that decides the targets: single documents (longest
    first) at each shape in turn, then the packed micro-batches at each shape. Each:
    dict(case, lens, shape, packed)."""
    out = []
    singles = sorted(args.lengths, reverse=True) if "single" in args.cases else []
    for shape in args.shapes:
        out += [dict(case="single", lens=[t], shape=shape, packed=False) for t in singles]
    for shape in args.shapes:
        for unit in (c for c in args.cases if c != "single"):
            for i, lens in enumerate(mixes.get(unit, [])[:1]):     # one packed micro-batch
                out.append(dict(case=f"{unit}#{i}", lens=list(lens), shape=shape, packed=True))
    return out


def variants(backend: str, case) -> list:
    """``[(variant, config or None)]`` of a kernel backend: triton at the settings it trains
    with (``launch_config``: pinned, else the default), then every split backward of
    ``candidates`` (a dQ kernel of its own); fa4 as it is, then its backward on K/V repeated per
    query head (``fa4_cute.BWD_PER_HEAD``'s other form) where the shape has GQA."""
    if backend == "fa4":
        out = [("fa4", None)]
        if case.nh > case.ng:
            from sparsebalance_megatron.attention import fa4_cute
            out.append(("bwd per head" if not fa4_cute.BWD_PER_HEAD else "bwd accumulated",
                        {"bwd_per_head": not fa4_cute.BWD_PER_HEAD}))
        return out
    if backend != "triton":
        return [(backend, None)]
    from sparsebalance_megatron.attention.triton_launch import candidates, launch_config
    key = (case.hn, 128, case.nh // case.ng)
    pinned = launch_config(*key)
    out = [("pinned", pinned)]
    for c in candidates(*key):
        if c.dq_block_m and c != pinned:
            out.append((f"split dq{c.dq_block_m} {c.bwd_block_m}x{c.bwd_block_n}", c))
    return out


def _failed(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


class Table:
    """The run's rows (``log``) and what every backend shares: each micro-batch's inputs and
    dense rows, each (micro-batch, density)'s selection and lists, made once."""

    def __init__(self, log, reps: int, clock):
        self.log, self.reps, self.clock = log, reps, clock
        self._cases, self._lists = {}, {}

    def case(self, job):
        """(Case, its dense row) of ``job``; the dense row is measured and logged once."""
        key = (job["case"], tuple(job["lens"]), job["shape"])
        if key not in self._cases:
            case = Case(job["case"], job["lens"], job["shape"], seed=len(self._cases))
            dense = self.clock.timed(lambda: dense_passes(case, self.reps))
            ok = {k: v["fwd_ms"] + v["bwd_ms"] for k, v in dense.items() if "fwd_ms" in v}
            row = dict(kind="dense", **self.base(case), **dense,
                       dense_ms=min(ok.values()) if ok else None)
            for k in ("cudnn", "sdpa", "varlen"):
                row[f"dense_{k}_ms"] = ok.get(k)
            self.log.add(row)
            self._cases[key] = (case, row)
        return self._cases[key]

    def lists(self, job, case, density):
        key = (job["case"], tuple(job["lens"]), job["shape"], density)
        if key not in self._lists:
            self._lists[key] = Lists(case, density)
        return self._lists[key]

    @staticmethod
    def base(case) -> dict:
        return dict(case=case.name, shape=case.shape, tokens=case.tokens,
                    docs=len(case.doc_lens), longest=max(case.doc_lens))


def run_checks(log, backend: str, shapes) -> None:
    """``backend``'s kernels (every variant) against float64 at each shape (``CHECK_LENS``,
    density ``CHECK_DENSITY``; FA4's calls repeated ``FA4_REPEATS`` times): rows of kind
    ``check`` (``ok`` False where one failed)."""
    for shape in shapes:
        case = Case("check", CHECK_LENS, shape, seed=7)
        lists = Lists(case, CHECK_DENSITY)
        for variant, cfg in variants(backend, case):
            row = dict(kind="check", backend=backend, variant=variant, shape=shape,
                       tokens=case.tokens, density=CHECK_DENSITY)
            try:
                row.update(check(kernel_fn(backend, lists, case, cfg), case, lists,
                                 repeats=FA4_REPEATS if backend == "fa4" else 1))
            except Exception as e:  # noqa: BLE001 - a kernel that fails here is a row
                row.update(ok=False, failed=_failed(e))
            print(f"  check {backend} {variant} {shape}: {'ok' if row['ok'] else 'FAILED'} "
                  f"{ {k: round(v['rel_err'], 5) for k, v in row.items() if isinstance(v, dict)} }"
                  f"{' ' + row['failed'] if 'failed' in row else ''}", file=sys.stderr)
            log.add(row)


def _timed(table: Table, row: dict, label: str, make_fn, case):
    """The pass times of ``make_fn()`` on ``case`` under the table's clock, or None where making
    or running it failed (``row`` then says why: a kernel that fails here is a row)."""
    try:
        return table.clock.timed(lambda: pass_times(make_fn(), [case.q, case.k, case.v],
                                                    case.g, table.reps))
    except Exception as e:  # noqa: BLE001
        row["failed"] = _failed(e)
        print(f"  {label}: failed: {row['failed']}", file=sys.stderr)
        return None


def run_backend(table: Table, job, backend: str, densities, crossover=None) -> bool:
    """``backend``'s rows on one micro-batch: per density its kernel rows (kernel backends)
    then its call rows (unrouted; routed too where ``crossover`` {(backend, density): tokens
    or None} is given). False once the clock stops new rows."""
    clock, log = table.clock, table.log
    if not clock.can_start():
        return False
    case, dense = table.case(job)
    # e against cuDNN's kernel (the dense sdpa call where it refused the shape), on single
    # documents only: cuDNN runs a packed micro-batch padded to its longest document
    e_ref = "cudnn" if "fwd_ms" in dense.get("cudnn", {}) else "sdpa"
    e_pass = dense.get(e_ref, {}) if len(case.doc_lens) == 1 else {}
    if backend not in KERNEL_BACKENDS:
        torch._dynamo.reset()      # every micro-batch compiles its own flex graph
    for d in densities:
        kernel_fwd = None
        if backend in KERNEL_BACKENDS:
            lists = table.lists(job, case, d)
            for variant, cfg in variants(backend, case):
                if not clock.can_start():
                    return False
                row = dict(kind="kernel", **Table.base(case), backend=backend, variant=variant,
                           density=d, tiles=lists.tiles, kept_fraction=lists.kept_fraction)
                if cfg is not None:
                    from dataclasses import asdict, is_dataclass
                    row["config"] = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
                label = f"{case.name} {case.shape} {backend} {variant} d={d}"
                t = _timed(table, row, label, lambda: kernel_fn(backend, lists, case, cfg),
                           case)
                if t is not None:
                    row.update(t, **rates(t, lists.tiles, case.hn),
                               **e_against(t, e_pass, lists.kept_fraction), e_ref=e_ref,
                               kernel_ms=t["fwd_ms"] + t["bwd_ms"])
                    if dense["dense_cudnn_ms"]:
                        row["ratio_vs_cudnn"] = row["kernel_ms"] / dense["dense_cudnn_ms"]
                    if kernel_fwd is None:
                        kernel_fwd = t
                    split = "".join(f", {p} host {t[p + '_host_ms']:.2f} gpu "
                                    f"{t[p + '_gpu_ms']:.2f}" for p in ("fwd", "bwd")
                                    if p + "_gpu_ms" in t)
                    print(f"  {label}: fwd {t['fwd_ms']:.2f} bwd {t['bwd_ms']:.2f} ms, e "
                          f"{row.get('e_fwd', float('nan')):.2f} / "
                          f"{row.get('e_bwd', float('nan')):.2f}{split}", file=sys.stderr)
                log.add(row)
        routings = [("none", 0)]
        if crossover is not None:
            x = crossover.get((backend, d))
            routings.insert(0, ("crossover", (1 << 40) if x is None else x))
        for routing, below in routings:
            if not clock.can_start():
                return False
            row = dict(kind="call", **Table.base(case), backend=backend, density=d,
                       routing=routing, dense_below_tokens=below,
                       **{k: dense[k] for k in ("dense_ms", "dense_cudnn_ms", "dense_sdpa_ms",
                                                "dense_varlen_ms")})
            label = f"{case.name} {case.shape} {backend} call d={d} {routing}"
            t = _timed(table, row, label, lambda: call_fn(backend, case, d, below), case)
            if t is not None:
                ms = t["fwd_ms"] + t["bwd_ms"]
                row.update(call_fwd_ms=t["fwd_ms"], call_bwd_ms=t["bwd_ms"],
                           bwd_method=t["bwd_method"], ours_ms=ms,
                           **{f"call_{k}": v for k, v in t.items() if k.split("_")[1] in SPLIT})
                for name, ref in (("dense", "dense_ms"), ("cudnn", "dense_cudnn_ms"),
                                  ("varlen", "dense_varlen_ms")):
                    if dense[ref]:
                        row[f"ratio_vs_{name}"] = ms / dense[ref]
                if kernel_fwd is not None and routing == "none":
                    row["select_ms"] = t["fwd_ms"] - kernel_fwd["fwd_ms"]
                    if "fwd_gpu_ms" in t and "fwd_gpu_ms" in kernel_fwd:
                        row["select_gpu_ms"] = t["fwd_gpu_ms"] - kernel_fwd["fwd_gpu_ms"]
                        row["select_host_ms"] = t["fwd_host_ms"] - kernel_fwd["fwd_host_ms"]
                print(f"  {label}: {ms:.2f} ms ({row.get('ratio_vs_cudnn', float('nan')):.3f}x "
                      f"cuDNN)", file=sys.stderr)
            log.add(row)
    return True


def run(args, backends, log, clock, mixes) -> bool:
    """Every backend's checks and rows (module docstring: the order). False when cut."""
    table = Table(log, args.reps, clock)
    jobs = plan_cases(args, mixes)
    for backend in backends:
        if backend in KERNEL_BACKENDS and args.check:
            if not clock.can_start():
                return False
            # not a row: the checks compile every kernel form (about 30 s for FA4's on a bare
            # H200), and timed as one row their 1.5x margin held back every row after them
            run_checks(log, backend, args.shapes)
        for job in jobs:
            cross = None
            single = [r for r in log.rows if r.get("kind") == "call" and r["case"] == "single"
                      and "ours_ms" in r]
            if job["packed"] and len({r["tokens"] for r in single}) >= 2:
                cross = {(backend, d): crossover_of(single, backend, job["shape"], d)
                         for d in args.densities}
            if not run_backend(table, job, backend, args.densities, cross):
                print(f"deadline: stopped at {backend} {job['case']} {job['shape']}",
                      file=sys.stderr)
                return False
    return True


def main(argv=None) -> int:
    ap = parser(__doc__, "attention_gpu", json_arg=False)
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                    help="in the order they run")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), metavar="NP/NG/HN")
    ap.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    ap.add_argument("--cases", nargs="+", choices=("single", "file", "section"),
                    default=["single", "file"])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(SINGLE_LENGTHS),
                    help="single-document lengths (tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the correctness checks against float64")
    ap.add_argument("--json", metavar="PATH", help="the table, the summary and provenance, at the end")
    add_row_args(ap)
    ap.add_argument("--make-mixes", metavar="PATH", help="write the packed mixes (CPU) and exit")
    ap.add_argument("--summarize", metavar="JSON",
                    help="print the summary (targets, fixed costs per call) of a table this "
                         "script wrote, and exit (CPU)")
    args = ap.parse_args(argv)
    bad = [n for n in args.lengths if n < 128]
    if bad:
        ap.error(f"--lengths {bad[0]}: expected token counts >= 128 (one attention block)")
    if args.summarize:
        with open(args.summarize) as f:
            print(json.dumps(summarize(json.load(f)["rows"]), indent=1))
        return 0
    if args.make_mixes:
        make_mixes(args.make_mixes)
        return 0
    try:
        for s in args.shapes:
            parse_shape(s)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("error: needs CUDA (the CPU benchmark is scripts/bench.py attention)",
              file=sys.stderr)
        return 2
    backends, skipped = usable_backends(args.backends)
    for b, why in skipped.items():
        print(f"backend {b} skipped: {why}", file=sys.stderr)
    t0 = time.time()
    clock = Clock(args.deadline_s)
    log = RowLog(args.jsonl)
    mixes = {}
    if any(c != "single" for c in args.cases):
        with open(MIXES_PATH) as fh:
            mixes = json.load(fh)["mixes"]
    finished = run(args, backends, log, clock, mixes)
    rows = log.rows
    single = [r for r in rows if r.get("kind") == "call" and r["case"] == "single"
              and "ours_ms" in r]
    crossovers = {f"{b}|{s}|{d}": crossover_of(single, b, s, d)
                  for b in backends for s in args.shapes for d in args.densities}
    doc = dict(gpu_provenance(), dtype="bfloat16", block_size=128, seconds=time.time() - t0,
               cut_by_deadline=not finished, skipped_backends=skipped,
               summary=dict(summarize(rows), crossover_tokens=crossovers), rows=rows)
    print_table(rows, doc["device"])
    print(json.dumps(doc["summary"], indent=1))
    write_result(args.json, doc)
    return 1 if any("failed" in r or r.get("ok") is False for r in rows) else 0
