"""Benchmark budgeted block-sparse attention on CPU: fwd+bwd time vs density against dense SDPA,
the selection's own time and one long document's memory (docs/benchmarks/attention-cpu.md)."""

from __future__ import annotations

import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from sparsebalance_megatron.attention import block_sparse_attention, build_layout
from sparsebalance_megatron.attention.kernels import to_blocks_kv, to_blocks_q
from sparsebalance_megatron.attention.selection import estimate_block_shares, select_from_shares

from .common import parser, write_result

DENSITIES = (1.0, 0.5, 0.25, 0.125)
MEM_DENSITY = 0.125         # --mem-seq-len's density


def _median_ms(fn, reps: int, warmup: int = 1):
    """(median wall ms, median process CPU ms) of ``fn`` over ``reps`` runs after warm-up (CPU:
    a GPU's timings are ``attention_gpu``'s)."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def _row(kind, seq_len, density, backend, **kw) -> dict:
    """One table row: ``kw`` its figures (the table's columns it does not measure: None)."""
    return {**dict(kind=kind, seq_len=seq_len, density=density, backend=backend,
                   fwd_bwd_ms=None, ratio_vs_full_density=None, ratio_vs_dense_sdpa=None,
                   select_ms=None), **kw}


def bench_kernels(seq_lens, dtype, nh, ng, hn, reps, block_size):
    device = torch.device("cpu")
    rows = []
    for t in seq_lens:
        g = torch.Generator(device="cpu").manual_seed(t)
        q, k, v = (torch.randn(t, h, hn, generator=g).to(device, dtype).requires_grad_(True)
                   for h in (nh, ng, ng))

        def dense():
            kk, vv = (x.repeat_interleave(nh // ng, 1).transpose(0, 1)[None] for x in (k, v))
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, is_causal=True)
            out.float().sum().backward()

        dense_ms, dense_cpu = _median_ms(dense, reps)
        rows.append(_row("timing", t, 1.0, "dense_sdpa", fwd_bwd_ms=dense_ms,
                         ratio_vs_dense_sdpa=1.0, fwd_bwd_cpu_ms=dense_cpu,
                         cpu_ratio_vs_full_density=None, cpu_ratio_vs_dense_sdpa=1.0))
        full_ms = full_cpu = None
        backend = "torch"
        lay = build_layout([0, t], t, block_size, device)
        for d in DENSITIES:
            def ours(d=d):
                out, _ = block_sparse_attention(q, k, v, [0, t], d, block_size=block_size,
                                                backend=backend)
                out.float().sum().backward()

            def select_only(d=d):
                qb = to_blocks_q(lay.pad(q.detach()), ng, block_size)
                kb = to_blocks_kv(lay.pad(k.detach()), block_size)
                sh = estimate_block_shares(qb, kb, lay, "maxkey", hn ** -0.5)
                select_from_shares(sh, lay, torch.full((1,), d, dtype=torch.float64,
                                                       device=device))

            ms, cpu = _median_ms(ours, reps)
            sel_ms = _median_ms(select_only, reps)[0]
            if d == 1.0:
                full_ms, full_cpu = ms, cpu
            rows.append(dict(kind="timing", seq_len=t, density=d, backend=backend,
                             fwd_bwd_ms=ms, ratio_vs_full_density=ms / full_ms,
                             ratio_vs_dense_sdpa=ms / dense_ms, select_ms=sel_ms,
                             fwd_bwd_cpu_ms=cpu, cpu_ratio_vs_full_density=cpu / full_cpu,
                             cpu_ratio_vs_dense_sdpa=cpu / dense_cpu))
            print(f"  timed seq_len={t} density={d}: {ms:.0f} ms", file=sys.stderr)
    return rows


def peak_memory_row(seq_len, density, nh, ng, hn, block_size):
    """CPU only: growth of the peak RSS over one fwd+bwd of a ``seq_len``-token document."""
    import resource
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seq_len, h, hn, generator=g).requires_grad_(True)
               for h in (nh, ng, ng))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.process_time()
    out, _ = block_sparse_attention(q, k, v, [0, seq_len], density, block_size=block_size,
                                    backend="torch")
    out.sum().backward()
    cpu_ms = (time.process_time() - t0) * 1e3
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return _row("memory", seq_len, density, "torch", fwd_bwd_cpu_ms=cpu_ms,
                peak_rss_growth_mib=peak - before,
                dense_scores_per_head_mib=seq_len * seq_len * 4 / 2 ** 20)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = parser(__doc__, "attention")
    ap.add_argument("--quick", action="store_true", help="smallest sizes; under a minute on CPU")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--mem-seq-len", type=int, default=None,
                    help="CPU: also measure the peak-RSS growth of one fwd+bwd at this length")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's); 1 is steadier on a shared host")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    seq_lens, dtype, nh, ng, hn = [4096] if args.quick else [4096, 8192], torch.float32, 4, 2, 64
    name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    reps = args.reps or (1 if args.quick else 3)
    rows = []
    cuda = torch.cuda.is_available()
    if cuda:        # a GPU's timings are the kernel table's (pass by pass against cuDNN)
        print("timing on a GPU: python scripts/bench.py attention_gpu (the kernel table)")
    else:
        rows += bench_kernels(seq_lens, dtype, nh, ng, hn, reps, args.block_size)
    if args.mem_seq_len and not cuda:
        row = peak_memory_row(args.mem_seq_len, MEM_DENSITY, nh, ng, hn, args.block_size)
        print(f"memory: {args.mem_seq_len} tokens, density {MEM_DENSITY}: peak RSS grew "
              f"{row['peak_rss_growth_mib']:.0f} MiB during fwd+bwd ({row['fwd_bwd_cpu_ms']:.0f} "
              f"ms CPU); one fp32 L x L score matrix per head would be "
              f"{row['dense_scores_per_head_mib']:.0f} MiB")
        rows.append(row)

    print(f"device: {name}; torch {torch.__version__}; block_size {args.block_size}; "
          f"threads {torch.get_num_threads()}")
    print(f"| {'kind':7} | {'seq_len':>7} | {'density':>7} | {'backend':>15} | {'fwd_bwd_ms':>10} "
          f"| {'vs_d1.0':>7} | {'vs_sdpa':>7} | {'cpu_ms':>8} | {'cpu_vs_d1.0':>11} "
          f"| {'select_ms':>9} |")
    for r in rows:
        print(f"| {r['kind']:7} | {r['seq_len']:7d} | {r['density']:7.3f} | {r['backend']:>15} "
              f"| {_fmt(r['fwd_bwd_ms'], '10.1f')} | {_fmt(r['ratio_vs_full_density'], '7.3f')} "
              f"| {_fmt(r['ratio_vs_dense_sdpa'], '7.3f')} "
              f"| {_fmt(r.get('fwd_bwd_cpu_ms'), '8.1f')} "
              f"| {_fmt(r.get('cpu_ratio_vs_full_density'), '11.3f')} "
              f"| {_fmt(r['select_ms'], '9.1f')} |")
    if args.json:
        meta = dict(torch=torch.__version__, block_size=args.block_size, reps=reps,
                    heads=[nh, ng, hn], dtype=str(dtype), quick=args.quick,
                    threads=torch.get_num_threads())
        write_result(args.json, {"device": name, "meta": meta, "results": rows})
    return 0
