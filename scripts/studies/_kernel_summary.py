"""The kernel table's summary (``scripts/bench_attention_gpu.py --summarize``) and printout: the issue-61
target checks per shape from the rows of one 32K document, ``e`` per pass, the packed
micro-batches against dense, the fastest choice per density, each kernel's fixed cost per call
and the simulator's price of each backend's call (both ``latency.sparse_call.fit_price``, one
fit), which backward form is faster everywhere, and the crossover length.

Pure Python; reads rows, imports neither torch nor megatron.
"""

from __future__ import annotations

MIX_TOKENS = 32768
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
            per = {}
            for r in (r for r in kern if r["backend"] == b):
                p = per.setdefault(r["density"], {"fwd": 0.0, "bwd": 0.0})
                p["fwd"] = max(p["fwd"], r.get("e_fwd", 0.0))
                p["bwd"] = max(p["bwd"], r.get("e_bwd", 0.0))
            fwd, bwd = min(p["fwd"] for p in per.values()), min(p["bwd"] for p in per.values())
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
    ``bench_sim_study.py --kernel-table`` prices the rows with the same fit."""
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
    fit_price``, the simulator's fit, each pass apart) over that micro-batch's densities (run
    5: 1.2-1.6 ms in FA4's backward). A kernel and micro-batch need three densities."""
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
