"""Bytes of the FlexAttention mask structures per layer: now vs the per-head, NB-wide lists before
(docs/benchmarks/attention-cpu.md)."""

from __future__ import annotations

import sys

import torch

from sparsebalance_megatron.attention import build_layout
from sparsebalance_megatron.attention.flex import _slot_tables, mask_tensors
from sparsebalance_megatron.attention.selection import select_from_shares

from .common import parser, write_result

HEADS = {"qwen2.5-0.5b (14q/2kv)": (14, 2), "32q/8kv": (32, 8)}


def _bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each storage once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def measure(t: int, bs: int, nh: int, ng: int, density: float) -> dict:
    lay = build_layout([0, t], t, bs, "cpu", fixed_length=True)
    shares = torch.rand(ng, lay.num_blocks, lay.num_blocks, generator=torch.Generator()
                        .manual_seed(0))
    sel = select_from_shares(shares, lay, torch.tensor([density], dtype=torch.float64),
                             sink_blocks=1)
    m = mask_tensors(sel)
    per_layer = _bytes(m.values())
    per_mb = _bytes(_slot_tables(lay))
    nb = lay.num_blocks          # before: per-head, NB-wide lists (module docstring)
    before = 4 * nh * nb * nb * 4 + 4 * nh * nb * 4 + ng * nb * nb + nb * bs * (8 + 1)
    return dict(seq_len=t, block_size=bs, heads=nh, kv_groups=ng, density=density,
                num_blocks=lay.num_blocks, padded_blocks=lay.padded_blocks,
                full_kv_width=int(m["full_kv_indices"].shape[-1]),
                full_q_width=int(m["full_q_indices"].shape[-1]),
                now_per_layer_bytes=per_layer, now_per_microbatch_bytes=per_mb,
                before_per_layer_bytes=before, ratio=per_layer / before)


def main(argv=None) -> int:
    ap = parser(__doc__, "mask_memory")
    args = ap.parse_args(argv)
    rows = []
    for name, (nh, ng) in HEADS.items():
        for t in (32768, 131072):
            for bs in (64, 128):
                for d in (0.25, 1.0):
                    r = measure(t, bs, nh, ng, d)
                    r["model"] = name
                    rows.append(r)
                    print(f"  {name} t={t} B={bs} d={d}: {r['now_per_layer_bytes'] / 2**20:.1f} "
                          f"MiB", file=sys.stderr)
    mib = lambda b: f"{b / 2 ** 20:,.1f}"      # noqa: E731
    print("| heads (q/kv) | tokens | block | density | NB | padded | full kv width | "
          "full q width | now MiB/layer | before MiB/layer | now / before | "
          "per micro-batch MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['heads']}/{r['kv_groups']} | {r['seq_len'] // 1024}K | {r['block_size']} "
              f"| {r['density']} | {r['num_blocks']} | {r['padded_blocks']} "
              f"| {r['full_kv_width']} | {r['full_q_width']} | {mib(r['now_per_layer_bytes'])} "
              f"| {mib(r['before_per_layer_bytes'])} | {r['ratio']:.3f} "
              f"| {mib(r['now_per_microbatch_bytes'])} |")
    if args.json:
        write_result(args.json, {"device": "cpu (byte counts; independent of the device)",
                                 "results": rows})
    return 0
