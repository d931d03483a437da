"""Launch settings of the ``triton`` backend's kernels, pinned per (head dim, block, GQA ratio).

``launch_config(head_dim, block_size, rep)`` is what ``sparse_triton`` launches with: the
``PINNED`` entry for that key when a device measurement has filled one, else ``default_config``
(register-sized first choices). The device's kernel table (``scripts/bench.py attention_gpu``)
times the pinned settings beside the split-backward ``candidates``; the faster is pasted into
``PINNED`` with the command, commit, versions and device in the comment above the entry.

A ``LaunchConfig`` changes only speed, never the result: every field is checked for the tile
shapes the kernels accept (powers of two, the dK/dV key tile dividing the block).
Pure python (triton only for ``next_power_of_2``'s arithmetic, done here by hand); it must not
depend on the Megatron adapter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and launch settings of the forward and the backward (one pass, or split)."""

    fwd_block_m: int
    """Stacked query rows (GQA heads x tokens of one query block) per forward program."""
    fwd_warps: int
    """``num_warps`` of the forward."""
    fwd_stages: int
    """``num_stages`` (software pipelining depth) of the forward's list loop."""
    bwd_block_m: int
    """Stacked query rows per iteration of the dK/dV/dQ loop."""
    bwd_block_n: int
    """Keys per dK/dV program: the whole block where registers allow (dK, dV in float32)."""
    bwd_warps: int
    """``num_warps`` of the backward."""
    bwd_stages: int
    """``num_stages`` of the backward's flattened (list entry x row tile) loop."""
    kv_chunk: int
    """Entries of a key block's transposed list one backward program takes (longer columns,
    the document sinks, are split and their dK/dV added atomically)."""
    dq_block_m: int = 0
    """0: the one-pass backward (dQ inside the dK/dV loop, float32 atomic adds). N > 0: the
    split, a separate dQ kernel over the forward's lists with N stacked query rows per program
    (``bwd_warps``, ``bwd_stages``), and dK/dV without the dQ GEMM."""

    def check(self, block_size: int) -> "LaunchConfig":
        """This config, or a ``ValueError`` naming the field the kernels cannot take."""
        for name, value in asdict(self).items():
            low = 0 if name == "dq_block_m" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"LaunchConfig.{name}={value!r}: expected an integer >= {low}")
        for name in ("fwd_block_m", "bwd_block_m", "bwd_block_n", "fwd_warps", "bwd_warps",
                     "dq_block_m"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"LaunchConfig.{name}={value}: expected a power of two")
        for name in ("fwd_block_m", "bwd_block_m") + (("dq_block_m",) if self.dq_block_m else ()):
            if getattr(self, name) < 16:
                raise ValueError(f"LaunchConfig.{name}={getattr(self, name)}: expected >= 16 "
                                 f"(tl.dot's smallest tile)")
        if self.bwd_block_n < 16 or block_size % self.bwd_block_n:
            raise ValueError(f"LaunchConfig.bwd_block_n={self.bwd_block_n}: expected a power "
                             f"of two >= 16 dividing the block size {block_size}")
        return self


def default_config(head_dim: int, block_size: int, rep: int) -> LaunchConfig:
    """First choices that compile clean for the H100 (``compile_gate``, sm_90a: no spill,
    <= 227 KB of shared memory, every list-loop GEMM on wgmma at the target shapes), used until
    the device's autotune pins an entry.

    Forward: a stage holds a K and a V tile (``2 B hn`` bytes at 16 bits: 64 KB at block and
    head dim 128), so 3 stages at hn <= 64, 2 at 128, 1 at 256 stay under 227 KB; 8 warps at
    128 query rows or head dim 128 (at 4 warps a 128-row tile's float32 scores and accumulator
    spill: the hn-64 forward at block 128 and the hn-128 one at block 64 did). Backward: at head
    dim 128, 64 query rows x 64 keys at 8 warps: the dQ GEMM (``BLOCK_M`` rows) needs M >= 64
    for wgmma, and 64 x 128 keys spills (dK and dV of 128 keys are 128 float32 registers a
    thread); a 128-key block is two programs (``work_model.backward_designs``: Q/dO read and
    dQ added twice per tile, still 5 GEMMs). At head dim <= 64 the whole 128-key block with
    64 rows fits."""
    rows = _pow2(rep * block_size)
    fwd_m = min(rows, 128 if head_dim <= 128 else 64)
    return LaunchConfig(
        fwd_block_m=fwd_m,
        fwd_warps=8 if head_dim >= 128 or fwd_m >= 128 else 4,
        fwd_stages=3 if head_dim <= 64 else (2 if head_dim <= 128 else 1),
        bwd_block_m=min(rows, 64 if head_dim <= 128 else 32),
        bwd_block_n=min(block_size, 128 if head_dim <= 64 else 64),
        bwd_warps=8 if head_dim >= 64 else 4, bwd_stages=2 if head_dim <= 128 else 1,
        kv_chunk=16)


def refused(cfg: LaunchConfig, head_dim: int) -> Optional[str]:
    """Why ``cfg`` is not an autotune candidate at ``head_dim`` (None: it is): the tiles the
    compile gate found spilling or over 227 KB on sm_90a (``docs/results/compile_gate_sm90*``;
    the gate test checks that every remaining candidate at the target shapes passes)."""
    if cfg.fwd_warps < 8 and cfg.fwd_block_m >= 128:
        return "forward 128 rows at 4 warps: the score tile spills (hn 64 and 128)"
    if cfg.bwd_block_m >= 128:
        return "backward 128 rows: spills at 8 warps, 258 KB at 128 keys (hn 64 and 128)"
    if head_dim >= 128 and cfg.bwd_warps < 8:
        return "backward at 4 warps, hn 128: spills at every tile"
    if head_dim >= 128 and cfg.bwd_block_m * cfg.bwd_block_n > 64 * 64 and \
            cfg.bwd_block_m >= 64:
        return ("backward 64 rows x 128 keys, hn 128: spills 40-56 B (the split's dK/dV too, "
                "56 B on triton 3.6.0)")
    if head_dim >= 64 and cfg.bwd_warps < 8 and cfg.bwd_block_m * cfg.bwd_block_n > 64 * 64:
        return "backward 64 rows x 128 keys at 4 warps, hn 64: spills"
    return None


PINNED: Dict[Tuple[int, int, int], LaunchConfig] = {
    # (head_dim, block_size, rep): LaunchConfig(...), pasted from the kernel table's kernel rows,
    # with the command, commit, versions and device above the entry.
    # python scripts/gpu_check.py --steps env bench --bench-backends triton (the kernel table,
    # scripts/bench.py attention_gpu, pass by pass), 2026-11-26, NVIDIA H200, triton 3.6.0,
    # torch 2.11.0+cu130, commit 93ea910: the split backward (dQ in its own 128-row kernel)
    # against the one pass pinned before (32x128 w8 s2, dQ by atomics), one 32K document:
    # backward 5.44 / 10.09 / 19.66 / 3.34 ms against 6.80 / 12.62 / 24.26 / 4.03 at densities
    # 0.25 / 0.5 / 1 / 0.125, a packed 32K micro-batch 2.01 against 2.69 ms at 0.25; the same
    # forward; docs/results/kernel_table_h200_triton.json at a63cdd4.
    (128, 128, 4): LaunchConfig(fwd_block_m=128, fwd_warps=8, fwd_stages=2, bwd_block_m=32,
                                bwd_block_n=128, bwd_warps=8, bwd_stages=2, kv_chunk=16,
                                dq_block_m=128),
}


HMMA_KEPT: Dict[Tuple[str, str, str], str] = {
    # ("np/ng/hn@block", kernel, "tiles wW sS") -> the device measurement for which a PINNED
    # config whose main loop runs GEMMs on mma.sync (HMMA) stays (compile_gate): the gate
    # cannot time, the device can. Empty: the pinned split backward runs every GEMM on wgmma.
}


SPILL_KEPT: Dict[Tuple[str, str, str], str] = {
    # ("np/ng/hn@block", kernel, "tiles wW sS") -> why an autotune candidate or a fixed-config
    # kernel that spills on sm_90a stays (compile_gate). Never a default or pinned entry.
    # Empty: every compile of the gate is spill-free on triton 3.6 and 3.7.1.
}


def launch_config(head_dim: int, block_size: int, rep: int) -> LaunchConfig:
    """The pinned entry for (head dim, block, GQA ratio), else ``default_config``."""
    cfg = PINNED.get((head_dim, block_size, rep))
    return cfg if cfg is not None else default_config(head_dim, block_size, rep)


def candidates(head_dim: int, block_size: int, rep: int) -> List[LaunchConfig]:
    """What the autotune sweeps at one key: the default first, then the split backward's
    tiles, then tiles x warps x stages of the one pass (each valid for the block and not
    ``refused``; at most a few dozen, so one device step covers them), backward and forward
    candidates interleaved. Candidates whose dQ GEMM runs on mma.sync (32 rows, one pass) stay:
    they compile clean, and the device says whether they lose."""
    base = default_config(head_dim, block_size, rep)
    rows = _pow2(rep * block_size)
    fwd, bwd = [], []
    stages = (2, 3, 4) if head_dim <= 64 else ((1, 2, 3) if head_dim <= 128 else (1, 2))
    for fwd_m in sorted({min(rows, m) for m in (64, 128)}):
        for fwd_w, fwd_s in [(4, 2)] + [(8, s) for s in stages]:
            fwd.append(LaunchConfig(fwd_m, fwd_w, fwd_s, base.bwd_block_m, base.bwd_block_n,
                                    base.bwd_warps, base.bwd_stages, base.kv_chunk))
    for bwd_m in sorted({min(rows, m) for m in (32, 64)}):
        for bwd_n in sorted({min(block_size, n) for n in (64, 128)}):
            for bwd_w, bwd_s in ((4, 2), (8, 1), (8, 2), (8, 3)):
                for chunk in (8, 16, 32):
                    if chunk != base.kv_chunk and (bwd_w, bwd_s) != (8, 2):
                        continue
                    bwd.append(LaunchConfig(base.fwd_block_m, base.fwd_warps, base.fwd_stages,
                                            bwd_m, bwd_n, bwd_w, bwd_s, chunk))
    # backward and forward candidates alternate (two backward per forward: it is ~2.5x the
    # work), so a sweep cut by its deadline has tried both
    # nearest the default's tiles first: the whole key block before its halves
    bwd.sort(key=lambda c: (c.bwd_block_n != base.bwd_block_n, c.bwd_block_m != base.bwd_block_m,
                            c.kv_chunk != base.kv_chunk))
    # the split backward (dK/dV over the whole key block without dQ, then dQ tiles of 64 or
    # 128 rows): every GEMM on wgmma, no spill at the targets (compile gate, triton 3.6.0 and
    # 3.7.1; 64 rows x 128 keys at hn 128 refused above); swept right after the default, so a
    # sweep cut by its deadline has timed it
    whole = min(block_size, 128)
    split = [LaunchConfig(base.fwd_block_m, base.fwd_warps, base.fwd_stages, bwd_m, whole, 8, 2,
                          base.kv_chunk, dq_m)
             for bwd_m in sorted({min(rows, m) for m in (32, 64)})
             for dq_m in sorted({min(rows, m) for m in (64, 128)})]
    out = [base] + [c for c in split if refused(c, head_dim) is None]
    for n in range(max(len(bwd), 2 * len(fwd))):
        out += bwd[n:n + 1] + (fwd[n // 2:n // 2 + 1] if n % 2 == 0 else [])
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c.check(block_size))
    return [c for c in uniq if c == base or refused(c, head_dim) is None]


__all__ = ["LaunchConfig", "PINNED", "SPILL_KEPT", "candidates", "default_config", "launch_config",
           "refused"]
