"""The sparse call's price itself (``SparseCallPrice``: per call, per token of the micro-batch and
per kept tile, fwd+bwd, at a reference head shape, each pass's share) and the constants every
pricing shares; ``sparse_call.py`` says where prices come from and which one prices the
simulator's sparse call, ``price_fit.py`` fits one from a device kernel table.

Pure Python + numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

TILE_BWD_SHARE = 2.5 / 3.5
"""Backward share of a kept tile's fwd+bwd time (2 forward GEMMs, 5 backward)."""
CALL_BWD_SHARE = 2 / 3
"""Backward share of a call's fixed cost (about twice the forward's launches)."""
REFERENCE_SHAPE = "8/2/128"
"""The head shape every H100 kernel figure of the project was measured at (query / KV heads,
head dim), block 128."""
HBM_BYTES_PER_S = 3.35e12
"""H100 SXM HBM3 bandwidth (datasheet); ``analytic.DeviceProfile``'s default."""
SINK_BLOCKS = 1
"""The sink setting of the priced rows (the studies' and the runtime's default)."""


@dataclass(frozen=True)
class SparseCallPrice:
    """One sparse kernel's cost per layer call, fwd+bwd, at its reference head shape."""

    backend: str
    """The kernel (a ``--sb-attention-backend`` value)."""
    source: str
    """Where the figures come from (a file and device, or 'ESTIMATE: ...')."""
    measured: bool
    """True: timed on a device; False: an estimate (said so in every row it prices)."""
    call_s: float
    """Seconds per call, constant part."""
    call_s_per_token: float
    """Seconds per call per token of the micro-batch the call is laid out in."""
    tile_s: float
    """Seconds per kept tile (query block x key block, every query head)."""
    ref_q_heads: int = 8
    ref_head_dim: int = 128
    ref_block: int = 128
    selection_in_call: bool = True
    """The call's figures include the block selection (measured end to end)."""
    tile_bwd_share: float = TILE_BWD_SHARE
    """The backward's share of a tile's fwd+bwd seconds."""
    stands_in_for: str = ""
    """Where this kernel's figures price another kernel's calls (the length-free kernels
    ``auto`` runs at variable lengths, before a device times them at two lengths): its names."""
    call_bwd_share: float = CALL_BWD_SHARE
    """The backward's share of a call's fixed seconds (measured where the passes were timed
    apart, else the launches' 2 : 1)."""
    lengths: tuple = ()
    """Micro-batch lengths (tokens) the price was fitted at; one length prices that one only."""

    def __post_init__(self):
        for name in ("call_s", "call_s_per_token", "tile_s", "call_bwd_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) \
                    or v < 0:
                raise ValueError(f"{name}={v!r}: expected finite seconds >= 0")

    def call_fwd_bwd_s(self, tokens: int, kept_tiles: float) -> float:
        """fwd+bwd seconds of one call at the reference shape: ``tokens`` in the micro-batch,
        ``kept_tiles`` kept (block ``ref_block``)."""
        return self.call_s + self.call_s_per_token * tokens + self.tile_s * kept_tiles

    def layer_terms(self, q_heads: int, head_dim: int, block_size: int,
                    microbatch_tokens: int) -> dict:
        """{fwd, bwd: {"call": s, "pair": s}} of one layer of a model with these heads, at
        ``block_size`` and micro-batches of ``microbatch_tokens`` (module docstring)."""
        width = q_heads * head_dim / (self.ref_q_heads * self.ref_head_dim)
        pair = self.tile_s * width * (block_size / self.ref_block) ** 2
        call = self.call_s + self.call_s_per_token * microbatch_tokens * width
        t, c = self.tile_bwd_share, self.call_bwd_share
        return {p: {"call": share_c * call, "pair": share_t * pair}
                for p, share_c, share_t in (("fwd", 1 - c, 1 - t), ("bwd", c, t))}

    def describe(self) -> str:
        """'flex (measured: ...)' / 'triton (ESTIMATE: ...)': what prices a row."""
        kind = "measured" if self.measured else "ESTIMATE"
        stand = (f"STANDING IN for {self.stands_in_for}, the length-free kernels auto runs at "
                 f"variable lengths, not yet timed at two lengths: " if self.stands_in_for else "")
        at = (f" at {self.lengths[0]} tokens only" if len(self.lengths) == 1 else "")
        return (f"{self.backend} ({stand}{kind}: {self.call_s * 1e3:.2f} ms + "
                f"{self.call_s_per_token * 32768 * 1e3:.2f} ms per 32K tokens per call{at}, "
                f"{self.tile_s * 1e6:.3f} us per kept tile at {self.ref_q_heads} q heads x "
                f"{self.ref_head_dim}, block {self.ref_block}; {self.source})")

    def as_dict(self) -> dict:
        return dict(asdict(self), described=self.describe())

    @classmethod
    def from_dict(cls, rec: dict) -> "SparseCallPrice":
        """The price an ``as_dict`` record holds (a latency table's ``sparse_call``)."""
        names = {f for f in cls.__dataclass_fields__}
        out = {k: v for k, v in rec.items() if k in names}
        out["lengths"] = tuple(out.get("lengths", ()))
        return cls(**out)

    def pass_ms(self, tokens: int, kept_tiles: float) -> dict:
        """{fwd, bwd: ms} of one call at the reference shape (the fixed part and the tiles
        split by the price's shares)."""
        call = self.call_s + self.call_s_per_token * tokens
        tile = self.tile_s * kept_tiles
        c, t = self.call_bwd_share, self.tile_bwd_share
        return {"fwd": 1e3 * ((1 - c) * call + (1 - t) * tile),
                "bwd": 1e3 * (c * call + t * tile)}
