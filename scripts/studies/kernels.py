"""The kernel table's pieces (``attention_gpu``; ``fa4_pieces`` and gpu_check's steps time with
them too): one attention call on the GPU, pass by pass, and the summary of the rows.

Work is counted in tiles (a kept (query block, key block) pair of one head), FLOPs per tile by
``work_model``, so ``e = TFLOP/s(ours) / TFLOP/s(cuDNN)``. ``Clock`` and ``RowLog``: a call's
deadline and its rows written as measured.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch

from .common import host_and_gpu_ms, median_ms

BLOCK = 128
MIX_TOKENS = 32768


class Clock:
    """A call's deadline: no row starts unless ``margin`` seconds (at least 15, and 1.5x the
    longest row so far, compiles included) are left. ``deadline_s=None``: no deadline."""

    def __init__(self, deadline_s=None, now=time.monotonic):
        self.now, self.t0 = now, now()
        self.end = None if deadline_s is None else self.t0 + deadline_s
        self.longest = 0.0

    def can_start(self) -> bool:
        return self.end is None or self.end - self.now() >= max(15.0, 1.5 * self.longest)

    def timed(self, fn):
        t = self.now()
        try:
            return fn()
        finally:
            self.longest = max(self.longest, self.now() - t)


class RowLog:
    """Rows in memory and, with ``path``, appended to a JSONL file as each is measured (flushed
    and synced: a call cut at its limit keeps every finished row)."""

    def __init__(self, path=None):
        self.rows, self.path = [], path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            open(path, "w").close()

    def add(self, row):
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                os.fsync(fh.fileno())


def add_row_args(ap) -> None:
    """``--jsonl`` (``RowLog``'s file) and ``--deadline-s`` (``Clock``'s deadline)."""
    ap.add_argument("--jsonl", metavar="PATH", help="each row appended as it is measured")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no row later than this many seconds minus a margin")


def usable_backends(requested) -> tuple:
    """The requested backends that can run on this machine's CUDA device, in order, and
    {backend: why not} of the others (no CUDA device: every one)."""
    from sparsebalance_megatron.attention.api import backend_missing
    why = {b: backend_missing(b, "cuda") if torch.cuda.is_available()
           else "it needs a CUDA device" for b in requested}
    return [b for b in requested if why[b] is None], {b: w for b, w in why.items() if w}


def parse_shape(text: str):
    """``'np/ng/hn'`` -> (query heads, KV heads, head dim)."""
    try:
        nh, ng, hn = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected 'query_heads/kv_heads/head_dim', e.g. 14/2/64")
    if nh <= 0 or ng <= 0 or hn <= 0 or nh % ng:
        raise ValueError(f"shape {text!r}: expected positive numbers with query heads a multiple "
                         f"of KV heads")
    return nh, ng, hn


class Case:
    """Inputs of one micro-batch (bf16 on the GPU; a CPU check under ``TRITON_INTERPRET=1``
    passes float16): q/k/v ``[t, heads, hn]`` leaves that need grad, an output gradient ``g``,
    the documents' bounds ``cu``."""

    def __init__(self, name, doc_lens, shape, seed=0, device="cuda", dtype=torch.bfloat16):
        self.name, self.doc_lens, self.shape = name, [int(x) for x in doc_lens], shape
        self.nh, self.ng, self.hn = parse_shape(shape)
        gen = torch.Generator().manual_seed(seed)
        t = sum(self.doc_lens)
        self.q, self.k, self.v = (torch.randn(t, h, self.hn, generator=gen)
                                  .to(device, dtype).requires_grad_(True)
                                  for h in (self.nh, self.ng, self.ng))
        self.g = torch.randn(t, self.nh, self.hn, generator=gen).to(device, dtype)
        self.bounds = [0, *itertools.accumulate(self.doc_lens)]
        self.cu = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        self.scale = self.hn ** -0.5

    @property
    def tokens(self) -> int:
        return self.bounds[-1]

    def causal_tiles(self) -> int:
        """Dense causal tiles, all query heads: ``n (n + 1) / 2`` per document of n blocks."""
        from sparsebalance_megatron.attention.work_model import causal_kept_tiles
        return self.nh * sum(causal_kept_tiles(-(-d // BLOCK), 1.0) for d in self.doc_lens)


def pass_times(fn, inputs, g, reps) -> dict:
    """``fwd_ms`` (autograd recording), ``bwd_ms`` and ``bwd_method`` of ``out = fn(*inputs)``;
    on a GPU also each pass's host and GPU-alone times (``common.host_and_gpu_ms``:
    ``fwd_host_ms``, ``fwd_gpu_ms``, ``fwd_held``, and the same for a replayable backward), so
    that a cost per call is told apart as the host's or the kernels'."""
    call = lambda: fn(*inputs)  # noqa: E731
    out = {"fwd_ms": median_ms(call, reps)}
    split = {"fwd": host_and_gpu_ms(call, reps)}
    try:
        y = fn(*inputs)
        back = lambda: torch.autograd.grad(y, inputs, g, retain_graph=True)  # noqa: E731
        back()
        out.update(bwd_ms=median_ms(back, reps), bwd_method="retained graph")
        split["bwd"] = host_and_gpu_ms(back, reps)
    except RuntimeError:            # a graph that cannot be replayed: the difference
        both = median_ms(lambda: torch.autograd.grad(fn(*inputs), inputs, g), reps)
        out.update(bwd_ms=both - out["fwd_ms"], bwd_method="(fwd+bwd) - fwd")
    for p, times in split.items():
        out.update({f"{p}_{k}": v for k, v in times.items() if k != "reps"})
    return out


def rates(times: dict, tiles: int, hn: int) -> dict:
    """TFLOP/s of each timed pass of ``tiles`` (query head x tile; ``work_model``'s GEMMs per
    tile)."""
    from sparsebalance_megatron.attention.work_model import attention_flops
    f = attention_flops(int(tiles), 1, BLOCK, hn)
    return {f"{p}_tflops": f[p] / times[f"{p}_ms"] / 1e9 for p in ("fwd", "bwd")
            if times.get(f"{p}_ms")}


def _cudnn_layout(case: Case):
    """q, k, v, g of a single-document case as cuDNN's ``[1, heads, L, hn]`` leaves, laid out
    once outside the timing; None for a packed micro-batch (its cuDNN row is ``sdpa``'s)."""
    if len(case.doc_lens) != 1:
        return None, None

    def lay(x, rep=1):
        return x.detach().repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0).contiguous()

    rep = case.nh // case.ng
    q, k, v = lay(case.q), lay(case.k, rep), lay(case.v, rep)
    return [t.requires_grad_(True) for t in (q, k, v)], lay(case.g)


def dense_passes(case: Case, reps: int) -> dict:
    """{kernel: pass times and TFLOP/s (or ``failed``)} for ``cudnn``, ``sdpa``, ``varlen``."""
    from sparsebalance_megatron.attention.dense import cudnn_call, dense_varlen_attention
    tiles = case.causal_tiles()
    out = {}
    cin, cg = _cudnn_layout(case)
    runs = ({"cudnn": (lambda q, k, v: cudnn_call(q, k, v, case.scale, cudnn_only=True),
                      cin, cg)} if cin else {})
    for kernel in ("sdpa", "varlen"):
        runs[kernel] = (lambda q, k, v, kernel=kernel: dense_varlen_attention(
            q, k, v, case.cu, None, kernel=kernel), [case.q, case.k, case.v], case.g)
    for kernel, (fn, inputs, g) in runs.items():
        try:
            t = pass_times(fn, inputs, g, reps)
            out[kernel] = {**t, **rates(t, tiles, case.hn)}
        except Exception as e:  # noqa: BLE001 - a dense kernel that refuses this shape or GPU
            out[kernel] = {"failed": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"  dense {kernel} unavailable: {out[kernel]['failed']}", file=sys.stderr)
    del cin, cg
    return out


class Lists:
    """One selection of ``case`` at ``density`` and its lists, shared by every kernel."""

    def __init__(self, case: Case, density: float):
        from sparsebalance_megatron.attention import block_sparse_attention
        from sparsebalance_megatron.attention.block_lists import build_block_lists
        with torch.no_grad():
            _, self.selection = block_sparse_attention(
                case.q, case.k, case.v, case.cu, density, block_size=BLOCK, backend="triton")
        self.lists = build_block_lists(self.selection)
        self.layout = self.selection.layout
        rep = case.nh // case.ng
        # the diagonal is not in q_num: one per query block and group
        kept = int(self.lists.q_num.sum()) + case.ng * self.layout.num_blocks
        self.tiles = kept * rep
        self.kept_fraction = self.tiles / case.causal_tiles()


def kernel_fn(backend: str, lists: Lists, case: Case, config=None):
    """``fn(q, k, v) -> out`` running ``backend``'s kernel alone on ``lists`` (``config``: the
    triton ``LaunchConfig``, None: the pinned one; fa4's ``{"bwd_per_head": bool}``, None: its
    default)."""
    lay, li, scale = lists.layout, lists.lists, case.scale
    if backend == "triton":
        from sparsebalance_megatron.attention.sparse_triton import sparse_attention
        return lambda q, k, v: sparse_attention(q, k, v, li, lay, scale, config=config)
    if backend == "fa4":
        from sparsebalance_megatron.attention.fa4_cute import fa4_block_sparse_attention

        per_head = (config or {}).get("bwd_per_head")

        def fa4(q, k, v):
            out = fa4_block_sparse_attention(
                lay.pad(q), lay.pad(k), lay.pad(v), li.q_num, li.q_idx, li.kv_num, li.kv_idx,
                block_size=BLOCK, softmax_scale=scale, bwd_per_head=per_head)
            return lay.unpad(out)
        return fa4
    raise ValueError(f"backend {backend!r}: expected 'triton' or 'fa4' (kernels callable alone)")


def call_fn(backend: str, case: Case, density: float, dense_below: int = 0):
    """``fn(q, k, v) -> out``: the whole per-layer call (a fresh cache per case, shared between
    repetitions as a micro-batch's layers share it)."""
    from sparsebalance_megatron.attention import block_sparse_attention
    cache = {}
    return lambda q, k, v: block_sparse_attention(
        q, k, v, case.cu, density, block_size=BLOCK, backend=backend, cache=cache,
        dense_below_tokens=dense_below)[0]


def _grads(fn, inputs, g, dtype=None):
    x = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in inputs]
    out = fn(*x)
    grads = torch.autograd.grad(out, x, g.to(out.dtype))
    return [out.detach()] + list(grads)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def check(fn, case: Case, lists: Lists, repeats: int = 1) -> dict:
    """``fn``'s bf16 output and gradients against the float64 reference on ``lists``'s
    selection (module docstring: the bar), and ``repeats`` calls bit for bit, finite."""
    from sparsebalance_megatron.attention.kernels import reference_attention
    inputs = (case.q, case.k, case.v)
    ref = lambda q, k, v: reference_attention(q, k, v, lists.selection, case.scale)  # noqa: E731
    exact = _grads(ref, inputs, case.g, torch.float64)
    low = _grads(ref, inputs, case.g)
    runs = [_grads(fn, inputs, case.g) for _ in range(max(1, repeats))]
    got = runs[0]
    out = {"finite": all(bool(torch.isfinite(t).all()) for r in runs for t in r),
           "repeats": len(runs),
           "identical_out": all(torch.equal(got[0], r[0]) for r in runs[1:])}
    ok = out["finite"] and out["identical_out"]
    for i, (name, a, b, c) in enumerate(zip(("out", "dq", "dk", "dv"), got, exact, low)):
        err, bar = _rel(a, b), max(2 * _rel(c, b), 1e-2)
        spread = max((_rel(r[i], a) for r in runs[1:]), default=0.0)
        out[name] = {"rel_err": err, "bar": bar, "repeat_rel_diff": spread}
        ok = ok and err <= bar and spread <= bar
    out["ok"] = ok
    return out


def e_against(ours: dict, cudnn: dict, kept_fraction: float) -> dict:
    """``e`` per pass: the kept tile's speed relative to cuDNN's (module docstring)."""
    out = {}
    for p in ("fwd", "bwd"):
        if ours.get(f"{p}_ms") and cudnn.get(f"{p}_ms"):
            out[f"e_{p}"] = kept_fraction * cudnn[f"{p}_ms"] / ours[f"{p}_ms"]
    return out


def make_mixes(path: str, per_mix: int = 4) -> None:
    """Sequence lengths of ``per_mix`` sequentially packed 32K micro-batches of the built-in
    corpus, as whole files and as sections, exactly as training packs them: documents + EOD (a
    document longer than a micro-batch split), then padding sequences up to 32K
    (``data.packing.padding_lengths``)."""
    import numpy as np

    from sparsebalance_megatron.data import GlobalBatchSampler, load_corpus
    from sparsebalance_megatron.data.packing import padding_lengths
    out = {"tokens": MIX_TOKENS, "command": " ".join(sys.argv), "mixes": {}}
    for unit in ("file", "section"):
        lengths = np.asarray(load_corpus(tokenizer="qwen", doc_unit=unit).lengths)
        # one bin more than kept: the sampler's last bin may be part-filled
        sampler = GlobalBatchSampler(lengths, capacity=MIX_TOKENS, num_microbatches=per_mix + 1,
                                     seed=0)
        bins, free = [], 0
        for _doc, start, end in sampler.next_global_batch():
            if end - start > free:
                bins.append([])
                free = MIX_TOKENS
            bins[-1].append(int(end - start))
            free -= end - start
        out["mixes"][unit] = [b + padding_lengths(MIX_TOKENS - sum(b)) for b in bins[:per_mix]]
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {path}: " + ", ".join(f"{k}: {[len(b) for b in v]} documents"
                                        for k, v in out["mixes"].items()))


# ---- the summary ---------------------------------------------------------------------------------

# Targets of issue 61 (one 32K document, fwd+bwd, the whole call against cuDNN's kernel)
TARGET_32K = {0.25: 0.30, 0.5: 0.58}
TARGET_E = 0.9
TARGET_SELECT_MS = 0.3
TARGET_PACKED = 1.02


def crossover_of(single_rows, backend: str, shape: str, density: float):
    """Shortest single-document length at which ``backend`` beat dense at ``density`` and every
    longer measured length did too; None when it never did (route everything dense)."""
    rows = sorted((r for r in single_rows if r["backend"] == backend and r["shape"] == shape
                   and r["density"] == density and "ours_ms" in r), key=lambda r: r["tokens"])
    best = None
    for r in reversed(rows):
        if r["ours_ms"] < r["dense_ms"]:
            best = r["tokens"]
        else:
            break
    return best


def summarize(rows):
    """The issue-61 target checks per shape from the rows of one 32K document (the fastest
    backend's whole call against cuDNN's kernel; ``e`` per backend as the worst density of its
    best variant per pass), the packed micro-batches' worst call against dense (routed rows
    where there are any), the fastest choice per (shape, density), and the targets over all
    shapes measured (a missing measurement: no key)."""
    out, targets = {}, {}
    ok = [r for r in rows if "failed" not in r]
    for shape in sorted({r["shape"] for r in ok if r["kind"] in ("call", "kernel")}):
        s = out.setdefault(shape, {})
        calls = [r for r in ok if r["kind"] == "call" and r["shape"] == shape]
        single = [r for r in calls if r["case"] == "single" and r["tokens"] == MIX_TOKENS
                  and r["routing"] == "none" and "ratio_vs_cudnn" in r]
        for d, limit in TARGET_32K.items():
            at = [r for r in single if r["density"] == d]
            if at:
                best = min(at, key=lambda r: r["ratio_vs_cudnn"])
                s[f"32k_d{d}"] = {"ratio_vs_cudnn": best["ratio_vs_cudnn"],
                                  "backend": best["backend"], "target": limit,
                                  "met": best["ratio_vs_cudnn"] <= limit}
        kern = [r for r in ok if r["kind"] == "kernel" and r["shape"] == shape
                and r["case"] == "single" and r["tokens"] == MIX_TOKENS]
        e = {}
        for b in sorted({r["backend"] for r in kern}):
            mine = [r for r in kern if r["backend"] == b]      # per pass: the worst density
            fwd, bwd = (min(max(r.get(f"e_{p}", 0.0) for r in mine if r["density"] == d)
                            for d in {r["density"] for r in mine}) for p in ("fwd", "bwd"))
            e[b] = {"fwd": fwd, "bwd": bwd, "met": min(fwd, bwd) >= TARGET_E}
        s["e"] = e
        for key in ("select_ms", "select_gpu_ms", "select_host_ms"):
            sel = {}
            for r in (r for r in single if key in r):
                sel.setdefault(r["backend"], []).append(r[key])
            if sel or key == "select_ms":
                s[key] = {b: sorted(v)[len(v) // 2] for b, v in sel.items()}
        packed = [r for r in calls if r["case"] != "single" and "ratio_vs_dense" in r]
        routed = [r for r in packed if r["routing"] == "crossover"]
        worst = {}
        for r in routed or packed:
            worst[r["backend"]] = max(worst.get(r["backend"], 0.0), r["ratio_vs_dense"])
        s["packed_worst_vs_dense"] = worst
        fastest = {}
        for d in sorted({r["density"] for r in single}):
            at = [r for r in single if r["density"] == d]
            best = min(at, key=lambda r: r["ours_ms"])
            fastest[str(d)] = best["backend"] if best["ours_ms"] < best["dense_ms"] else "dense"
        s["fastest"] = fastest
        s["fixed_ms"] = fixed_costs(ok, shape)
        s["prices"] = call_prices(ok, shape)
        s["backward"] = backward_choice(kern)
    for key, name in ((f"32k_d{d}", f"32k_d{d}<={t}x_cudnn") for d, t in TARGET_32K.items()):
        got = [s[key]["met"] for s in out.values() if key in s]
        if got:
            targets[name] = all(got)
    es = [any(v["met"] for v in s["e"].values()) for s in out.values() if s.get("e")]
    if es:
        targets[f"e>={TARGET_E}_fwd_and_bwd"] = all(es)
    sels = [min(s["select_ms"].values()) for s in out.values() if s.get("select_ms")]
    if sels:
        targets[f"select<={TARGET_SELECT_MS}ms"] = max(sels) <= TARGET_SELECT_MS
    packs = [min(s["packed_worst_vs_dense"].values()) for s in out.values()
             if s.get("packed_worst_vs_dense")]
    if packs:
        targets[f"packed<={TARGET_PACKED}x_dense"] = max(packs) <= TARGET_PACKED
    return {"shapes": out, "targets": targets, "prices": call_prices(ok)}


def backward_choice(kernel_rows) -> dict:
    """{backend: {"bwd_ms": {variant: {density: ms}}, "fastest_everywhere": variant or None}}
    for each backend timed in more than one form on the same document: which backward is the
    faster at every density (triton: a split backward to pin, ``triton_launch.PINNED``; fa4:
    ``fa4_cute.BWD_PER_HEAD``'s two forms). None where none wins at every density."""
    out = {}
    for b in sorted({r["backend"] for r in kernel_rows}):
        ms = {}
        for r in (r for r in kernel_rows if r["backend"] == b and r.get("bwd_ms")):
            ms.setdefault(r["variant"], {})[r["density"]] = r["bwd_ms"]
        if len(ms) < 2:
            continue
        densities = set.intersection(*(set(v) for v in ms.values()))
        win = [v for v in ms if densities and all(
            ms[v][d] <= min(m[d] for m in ms.values()) for d in densities)]
        out[b] = {"bwd_ms": ms, "fastest_everywhere": win[0] if win else None}
    return out


def call_prices(rows, shape=None) -> dict:
    """{backend: the simulator's price of its whole call, fwd+bwd (``latency.sparse_call.
    fit_price``: per call + per token + per kept tile, each pass apart), fitted on every
    micro-batch the table timed at ``shape`` (default the reference shape), one document and
    packed: call_ms (and its backward's share), per_32k_tokens_ms, tile_us, the lengths}.
    ``sim_study --kernel-table`` prices the rows with the same fit."""
    from sparsebalance_megatron.latency.sparse_call import REFERENCE_SHAPE, fit_prices, price_rows

    shape = shape or REFERENCE_SHAPE
    return {b: {"call_ms": p.call_s * 1e3, "per_32k_tokens_ms": p.call_s_per_token * 32768e3,
                "tile_us": p.tile_s * 1e6, "call_bwd_share": p.call_bwd_share,
                "tile_bwd_share": p.tile_bwd_share, "lengths": list(p.lengths)}
            for b, p in fit_prices(price_rows(rows, shape), "kernel table",
                                   shape=shape).items()}


def fixed_costs(rows, shape: str) -> dict:
    """{"backend variant case tokens": {"fwd": ms, "bwd": ms}}: each kernel's cost per call on
    one micro-batch, whatever its tiles: the call term of its price (``latency.sparse_call.
    fit_price``, the simulator's fit, each pass apart) over that micro-batch's densities. A
    kernel and micro-batch need three densities."""
    from sparsebalance_megatron.latency.sparse_call import fit_price, price_rows

    priced = price_rows(rows, shape, kind="kernel")
    out = {}
    for key in sorted({(r["backend"], r["variant"], r["case"], r["tokens"]) for r in priced}):
        mine = [r for r in priced if (r["backend"], r["variant"], r["case"], r["tokens"]) == key]
        try:
            p = fit_price(mine, key[0], "kernel table", variant=key[1], shape=shape)
        except ValueError:
            continue
        out[" ".join(map(str, key))] = {k: round(v, 4) for k, v in p.pass_ms(key[3], 0).items()}
    return out


def print_table(rows, device):
    """Kernel rows, then call rows, as markdown tables."""
    f = lambda x, n=2: "-" if x is None else f"{x:.{n}f}"     # noqa: E731
    print(f"device: {device}; torch {torch.__version__}; bf16, block 128; ms per pass")
    print("| case | shape | kernel | variant | density | kept | fwd | bwd | fwd TF/s | "
          "bwd TF/s | e fwd | e bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "dense" and "cudnn" in r:
            for k in ("cudnn", "sdpa", "varlen"):
                v = r.get(k, {})
                print(f"| {r['case']} {r['tokens']} | {r['shape']} | dense {k} | - | 1 | 1 | "
                      f"{f(v.get('fwd_ms'))} | {f(v.get('bwd_ms'))} | {f(v.get('fwd_tflops'), 0)} "
                      f"| {f(v.get('bwd_tflops'), 0)} | - | - |")
        elif r["kind"] == "kernel":
            print(f"| {r['case']} {r['tokens']} | {r['shape']} | {r['backend']} | "
                  f"{r['variant']} | {r['density']} | {f(r['kept_fraction'], 3)} | "
                  f"{f(r.get('fwd_ms'))} | {f(r.get('bwd_ms'))} | {f(r.get('fwd_tflops'), 0)} | "
                  f"{f(r.get('bwd_tflops'), 0)} | {f(r.get('e_fwd'))} | {f(r.get('e_bwd'))} |"
                  + (f" {r['failed']}" if "failed" in r else ""))
    print("\n| case | shape | backend | density | routing | fwd | bwd | call | cuDNN | "
          "call / cuDNN | call / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "call":
            print(f"| {r['case']} {r['tokens']} | {r['shape']} | {r['backend']} | "
                  f"{r['density']} | {r['routing']} | {f(r.get('call_fwd_ms'))} | "
                  f"{f(r.get('call_bwd_ms'))} | {f(r.get('ours_ms'))} | "
                  f"{f(r.get('dense_cudnn_ms'))} | {f(r.get('ratio_vs_cudnn'), 3)} | "
                  f"{f(r.get('ratio_vs_dense'), 3)} |" + (f" {r['failed']}" if "failed" in r
                                                         else ""))
