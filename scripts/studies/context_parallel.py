"""Context parallelism of the sparse attention on one long document: CP=1 vs CP=N, CPU, gloo
(``SparseCoreAttention`` fwd+bwd; wall time, the all-to-alls alone, saved bytes and peak RSS per
rank; docs/CONTEXT_PARALLEL.md)."""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
import types

import torch

from .common import parser, write_result


def _module(args, cp: int, group):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=args.heads * args.head_dim,
                            num_attention_heads=args.heads, num_query_groups=args.groups,
                            kv_channels=args.head_dim, attention_dropout=0.0,
                            context_parallel_size=cp)
    sb = SparseBalanceConfig(density=args.density, block_size=args.block_size,
                             attention_backend="torch")
    return SparseCoreAttention(cfg, 1, AttnMaskType.causal, cp_comm_type="a2a", sb_config=sb,
                               pg_collection=types.SimpleNamespace(cp=group))


def _run(rank: int, cp: int, init_file: str, args, out):
    import torch.distributed as dist

    from sparsebalance_megatron.data.context_parallel import zigzag_positions
    from sparsebalance_megatron.megatron.runtime import comm
    from sparsebalance_megatron.megatron.model.budget import SparsePackedSeqParams

    torch.set_num_threads(args.threads)
    group = None
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=cp)
        group = dist.group.WORLD
    attn = _module(args, cp, group)
    t = args.tokens
    cu = torch.tensor([0, t], dtype=torch.int32)
    keep = torch.from_numpy(zigzag_positions([0, t], cp, rank)) if cp > 1 else torch.arange(t)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, args.head_dim, generator=g)[keep].requires_grad_(True)
               for h in (args.heads, args.groups, args.groups))
    steps, saved = [], 0
    for i in range(args.repeats + 1):
        psp = SparsePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                    max_seqlen_q=t, max_seqlen_kv=t, sb_cp_size=cp)
        storages = {}

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        if group is not None:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            o = attn(q, k, v, None, packed_seq_params=psp)
        o.sum().backward()
        if i:
            steps.append(time.perf_counter() - t0)
        saved = sum(storages.values())
        q.grad = k.grad = v.grad = None
    a2a = 0.0
    if group is not None:   # the step's all-to-alls, alone: q/k/v and the output, fwd and bwd
        ngl = max(args.groups // cp, 1)
        tl = t // cp
        for heads in (args.heads // cp + 2 * ngl, args.heads // cp):
            x = torch.randn(cp, tl, heads, args.head_dim)
            times = []
            for _ in range(6):
                dist.barrier()
                t0 = time.perf_counter()
                comm.all_to_all(x, group)
                times.append(time.perf_counter() - t0)
            a2a += 2 * statistics.median(times[1:])
    out[rank] = {"rank": rank, "step_s": statistics.median(steps), "a2a_s": a2a,
                 "saved_bytes": saved,
                 "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if group is not None:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = parser(__doc__, "context_parallel")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    # the rest of the setting every documented run used (the JSON records them in "args")
    args.heads, args.groups, args.head_dim, args.density, args.block_size = 8, 2, 64, 0.5, 64
    args.context_parallel_size, args.threads, args.repeats = 2, 1, 3
    import torch.multiprocessing as mp

    rows = []
    for cp in (1, args.context_parallel_size):
        with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
            out = manager.dict()
            mp.spawn(_run, args=(cp, f"{tmp}/rendezvous", args, out), nprocs=cp, join=True)
            ranks = [dict(out[r]) for r in range(cp)]
        slow = max(ranks, key=lambda r: r["step_s"])
        rows.append({"cp": cp, "step_s": slow["step_s"], "a2a_s": max(r["a2a_s"] for r in ranks),
                     "saved_mib_per_rank": max(r["saved_bytes"] for r in ranks) / 2 ** 20,
                     "max_rss_mb_per_rank": max(r["max_rss_mb"] for r in ranks),
                     "ranks": ranks})
    print(f"one document of {args.tokens} tokens, {args.heads} heads / {args.groups} KV groups x "
          f"{args.head_dim}, density {args.density}, block {args.block_size}, torch backend, "
          f"{args.threads} thread(s) per process")
    print(f"{'CP':>3} {'fwd+bwd s':>10} {'a2a s':>10} {'saved MiB/rank':>15} "
          f"{'max RSS MB/rank':>16} {'speed-up':>9}")
    for r in rows:
        print(f"{r['cp']:>3} {r['step_s']:>10.3f} {r['a2a_s']:>10.4f} "
              f"{r['saved_mib_per_rank']:>15.1f} {r['max_rss_mb_per_rank']:>16.0f} "
              f"{rows[0]['step_s'] / r['step_s']:>8.2f}x")
    if args.json:
        write_result(args.json, {"args": vars(args), "rows": rows})
    return 0
