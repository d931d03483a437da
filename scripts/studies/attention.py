"""Benchmark budgeted block-sparse attention on CPU: fwd+bwd time vs density, and mass recall on
real text (docs/benchmarks/attention-cpu.md)."""

from __future__ import annotations

import math
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
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
                   recall=None, select_ms=None), **kw}


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
                             ratio_vs_dense_sdpa=ms / dense_ms, recall=None, select_ms=sel_ms,
                             fwd_bwd_cpu_ms=cpu, cpu_ratio_vs_full_density=cpu / full_cpu,
                             cpu_ratio_vs_dense_sdpa=cpu / dense_cpu))
            print(f"  timed seq_len={t} density={d}: {ms:.0f} ms", file=sys.stderr)
    return rows


# --- a tiny real-text model for recall -----------------------------------------------------------

def _rope(x, base=10000.0):  # x [b, s, h, hn]
    s, hn = x.shape[1], x.shape[-1]
    inv = base ** (-torch.arange(0, hn, 2, dtype=torch.float32) / hn)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None]        # [s, hn/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _Block(nn.Module):
    def __init__(self, dim, nh, ng):
        super().__init__()
        self.nh, self.ng, self.hn = nh, ng, dim // nh
        self.qkv = nn.Linear(dim, (nh + 2 * ng) * self.hn, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.captured = None

    def forward(self, x):                                                 # [b, s, dim]
        b, s, _ = x.shape
        qkv = self.qkv(self.n1(x)).view(b, s, self.nh + 2 * self.ng, self.hn)
        q, k, v = qkv.split([self.nh, self.ng, self.ng], dim=2)
        q, k = _rope(q), _rope(k)
        if self.captured is not None:
            self.captured.append((q[0].detach(), k[0].detach()))            # [s, heads, hn]
        kk, vv = (t.repeat_interleave(self.nh // self.ng, 2) for t in (k, v))
        att = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                             vv.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim=128, layers=2, nh=4, ng=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        nn.init.normal_(self.emb.weight, std=0.02)   # tied head: unit-variance rows explode logits
        self.blocks = nn.ModuleList(_Block(dim, nh, ng) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x) @ self.emb.weight.T


def train_tiny_lm(steps, seq_len, batch, eval_len, vocab=2048, seed=0):
    """Train TinyLM on stdlib sources; returns (model, held-out tokens [eval_len], losses).

    Tokens are the Qwen2 BPE ids; the ``vocab - 1`` most frequent keep their own id, the rest
    share one (keeps the LM head small enough for a CPU)."""
    from sparsebalance_megatron.data.corpus import load_corpus
    corpus = load_corpus(tokenizer="qwen", sources=("stdlib",), compact_vocab=True,
                         max_docs=200)
    torch.manual_seed(seed)
    docs = [torch.from_numpy(corpus.tokens(i).astype("int64")) for i in range(len(corpus))]
    held_out = max(i for i in range(len(docs)) if docs[i].numel() >= eval_len)
    counts = torch.bincount(torch.cat(docs), minlength=corpus.vocab_size)
    remap = torch.full((corpus.vocab_size,), vocab - 1, dtype=torch.long)
    remap[counts.argsort(descending=True)[:vocab - 1]] = torch.arange(vocab - 1)
    flat = remap[torch.cat([d for i, d in enumerate(docs) if i != held_out])]
    model = TinyLM(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(steps):
        starts = torch.randint(0, flat.numel() - seq_len - 1, (batch,))
        x = torch.stack([flat[s:s + seq_len + 1] for s in starts])
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, remap[docs[held_out][:eval_len]], losses


def _exact_block_mass(q, k, block_size):
    """Exact causal softmax mass per (head, query token, key block): ``[nh, t, NB]``."""
    t, nh, hn = q.shape
    kk = k.repeat_interleave(nh // k.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk.float()) / math.sqrt(hn)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    nb = math.ceil(t / block_size)
    p = F.pad(p, (0, nb * block_size - t))
    return p.view(nh, t, nb, block_size).sum(-1)


def recall_rows(model, tokens, block_size, densities):
    ids = tokens[None]
    for blk in model.blocks:
        blk.captured = []
    with torch.no_grad():
        model(ids)
    caps = [c for blk in model.blocks for c in blk.captured]
    for blk in model.blocks:
        blk.captured = None
    t = ids.shape[1]
    lay = build_layout([0, t], t, block_size, "cpu")
    tok_blk = torch.arange(t) // block_size
    acc = {}
    for q, k in caps:
        nh, ng, hn = q.shape[1], k.shape[1], q.shape[2]
        mass = _exact_block_mass(q, k, block_size)                         # [nh, t, NB]
        group_mass = mass.view(ng, nh // ng, t, -1).mean(1)               # [ng, t, NB]
        qb = to_blocks_q(lay.pad(q), ng, block_size)
        kb = to_blocks_kv(lay.pad(k), block_size)
        for est in ("maxkey", "pooled"):
            shares = estimate_block_shares(qb, kb, lay, est, hn ** -0.5)
            for d in densities:
                sel = select_from_shares(shares, lay, torch.tensor([d], dtype=torch.float64))
                keep = sel.block_mask()                                    # [ng, NB, NB]
                per_tok = keep[:, tok_blk]                                 # [ng, t, NB]
                rec = float((group_mass * per_tok).sum(-1).mean())
                acc.setdefault((est, d), []).append(rec)
                if est == "maxkey":  # oracle: same kept count, blocks by true group mass
                    blk_mass = torch.zeros(ng, lay.num_blocks, lay.num_blocks).index_add_(
                        1, tok_blk, group_mass)                            # [ng, NB, NB]
                    top = blk_mass.argsort(-1, descending=True)
                    ranks = torch.empty_like(top).scatter_(
                        -1, top, torch.arange(lay.num_blocks).expand_as(top))
                    okeep = ranks < sel.kv_num[..., None]
                    rec_o = float((group_mass * okeep[:, tok_blk]).sum(-1).mean())
                    acc.setdefault(("oracle", d), []).append(rec_o)
    return [_row("recall", t, d, f"recall:{est}", recall=statistics.mean(vals))
            for (est, d), vals in sorted(acc.items(), key=lambda kv: (kv[0][0], -kv[0][1]))]


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
    steps = 20 if args.quick else 200
    seq_len, eval_len = (512, 1024) if args.quick else (1024, 2048)
    t0 = time.perf_counter()
    model, tokens, losses = train_tiny_lm(steps, seq_len, batch=4, eval_len=eval_len)
    train_note = (f"tiny LM (2 layers, dim 128, 4 q / 2 kv heads, RoPE) trained {steps} "
                  f"steps x 4 x {seq_len} tokens of CPython stdlib sources: loss "
                  f"{losses[0]:.2f} -> {statistics.mean(losses[-5:]):.2f}")
    print(f"  {train_note} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    rows += recall_rows(model, tokens, args.block_size, DENSITIES)

    print(f"device: {name}; torch {torch.__version__}; block_size {args.block_size}; "
          f"threads {torch.get_num_threads()}")
    print(f"recall model: {train_note}")
    print(f"| {'kind':7} | {'seq_len':>7} | {'density':>7} | {'backend':>15} | {'fwd_bwd_ms':>10} "
          f"| {'vs_d1.0':>7} | {'vs_sdpa':>7} | {'cpu_ms':>8} | {'cpu_vs_d1.0':>11} "
          f"| {'select_ms':>9} | {'recall':>6} |")
    for r in rows:
        print(f"| {r['kind']:7} | {r['seq_len']:7d} | {r['density']:7.3f} | {r['backend']:>15} "
              f"| {_fmt(r['fwd_bwd_ms'], '10.1f')} | {_fmt(r['ratio_vs_full_density'], '7.3f')} "
              f"| {_fmt(r['ratio_vs_dense_sdpa'], '7.3f')} "
              f"| {_fmt(r.get('fwd_bwd_cpu_ms'), '8.1f')} "
              f"| {_fmt(r.get('cpu_ratio_vs_full_density'), '11.3f')} "
              f"| {_fmt(r['select_ms'], '9.1f')} | {_fmt(r['recall'], '6.3f')} |")
    if args.json:
        meta = dict(torch=torch.__version__, block_size=args.block_size, reps=reps,
                    heads=[nh, ng, hn], dtype=str(dtype), quick=args.quick,
                    threads=torch.get_num_threads(), recall_model=train_note)
        write_result(args.json, {"device": name, "meta": meta, "results": rows})
    return 0
