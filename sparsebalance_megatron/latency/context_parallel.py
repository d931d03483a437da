"""A unit's time on one rank of a context-parallel group (``--cp-comm-type a2a``), derived from the
CP=1 latency model's coefficients: no free parameter but the interconnect's.

Under the a2a scheme (docs/CONTEXT_PARALLEL.md) each of the ``c`` ranks of a CP group holds
``T / c`` tokens of every micro-batch for the linear layers and the MLP, and after one all-to-all
attends over whole documents with ``np / c`` query heads. So, per stage of ``L`` layers, from the
CP=1 coefficients ``[const, tokens, attention_work, selection_work, sequences]``:

- ``tokens``: divided by ``c`` (linear layers, MLP, embedding, LM head: each rank's tokens), plus
  the all-to-all traffic, forward and backward alike: two all-to-alls per layer (q, k, v out;
  the output back; in the backward their gradients), each rank sending ``(c - 1) / c`` of its
  ``T / c`` tokens' ``np + 2 ng_eff`` (out) and ``np`` (back) heads of ``hn`` values, with
  ``ng_eff = max(ng, c)`` (fewer KV groups than ranks: KV heads are replicated before the
  all-to-all so each rank gets the one its query heads read);
- ``attention_work``: divided by ``c`` (kept block pairs x query heads; the heads are split);
- ``selection_work``: divided by ``min(c, ng)``. The scoring is per query head and splits by
  ``c``, but ranking and selecting are per KV group: with ``ng < c`` every rank ranks the whole
  group it shares with ``c / ng - 1`` others, so only ``ng`` of the work splits. A profiled table
  does not tell scoring from ranking, so the model takes the upper bound ``/ min(c, ng)`` (exact
  for ``ng >= c``). With ``ng < c`` the forward adds the all-reduce of the block shares
  ``[ng, NB, NB]`` float32 over the group (ring: ``2 (c - 1) / c`` of it per rank), whose bytes
  are ``4 ng`` per block pair of ``selection_work`` (``NB ** 2``);
- ``const``: kernel launches do not divide; each collective adds a latency (4 all-to-alls per
  layer, forward and backward, and one all-reduce per layer with ``ng < c``);
- ``sequences``: does not divide (every rank loops over all documents: the THD rotary embedding,
  the kernels' per-document set-up for its heads);
- ``dense_work`` (routed documents, when the model has it): divided by ``c``, like attention work
  (each rank attends over whole documents for ``np / c`` heads);
- ``sparse_calls``, ``dense_calls`` (per-call fixed costs): do not divide (every rank makes the
  calls, with fewer heads; the launches and set-up stay).

The stage-to-stage activation (``p2p_s``) is each rank's tokens: divided by ``c``. ``c = 1`` is
the CP=1 model exactly. The interconnect's bandwidth and per-collective latency are assumptions
(``analytic.DeviceProfile``'s defaults unless given); online calibration absorbs the rest.

Pure numpy; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

A2A_PER_LAYER = 2          # all-to-alls per layer and pass (out, back)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}={v!r}: expected an integer >= 1")
    return int(v)


@dataclass(frozen=True)
class ContextParallelCost:
    """What one rank of a CP group of ``size`` ranks pays besides its share of the work."""

    size: int
    """CP ranks of the group (``--context-parallel-size``)."""
    num_attention_heads: int
    """Query heads of one tensor-parallel rank (np)."""
    num_query_groups: int
    """KV heads of one tensor-parallel rank (ng)."""
    head_dim: int
    """Values per head (hn)."""
    a2a_bytes_per_s: float
    """Effective all-to-all (and all-reduce) bandwidth per rank, bytes/s (an assumption)."""
    collective_latency_s: float
    """Fixed time of one collective, seconds (an assumption)."""
    activation_bytes: int = 2
    """Bytes per value sent by the all-to-alls (bf16)."""
    share_bytes: int = 4
    """Bytes per estimated block share (float32) in the selection's all-reduce."""

    def __post_init__(self):
        c = _positive_int("context_parallel_size", self.size)
        nh = _positive_int("num_attention_heads", self.num_attention_heads)
        ng = _positive_int("num_query_groups", self.num_query_groups)
        _positive_int("head_dim", self.head_dim)
        if nh % c:
            raise ValueError(f"context_parallel_size={c}: the {nh} query heads per tensor-"
                             f"parallel rank do not split over it (expected a divisor of {nh})")
        if ng % c and c % ng:
            raise ValueError(f"context_parallel_size={c}: the {ng} KV groups per tensor-parallel "
                             f"rank are neither a multiple nor a divisor of it")
        for name in ("a2a_bytes_per_s", "collective_latency_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) \
                    or v < 0 or (name == "a2a_bytes_per_s" and v == 0):
                raise ValueError(f"{name}={v!r}: expected a finite number "
                                 f"{'> 0' if name == 'a2a_bytes_per_s' else '>= 0'}")

    @property
    def kv_heads_sent(self) -> int:
        """KV heads each rank sends per token (replicated up to ``size`` when ng < size)."""
        return max(self.num_query_groups, self.size)

    @property
    def selection_split(self) -> int:
        """What the selection's work is divided by (see the module docstring)."""
        return min(self.size, self.num_query_groups)

    def a2a_bytes_per_token(self) -> float:
        """Bytes one rank sends per token of the micro-batch, per layer and pass (both
        all-to-alls): ``1/c x (2 np + 2 ng_eff) x hn x bytes x (c - 1)/c``."""
        c = self.size
        values = (2 * self.num_attention_heads + 2 * self.kv_heads_sent) * self.head_dim
        return values * self.activation_bytes * (c - 1) / (c * c)

    def share_bytes_per_pair(self) -> float:
        """Bytes one rank sends per block pair of ``selection_work``, per layer (forward):
        the ring all-reduce of ``[ng, NB, NB]`` shares when ng < size, else 0."""
        c, ng = self.size, self.num_query_groups
        if ng >= c:
            return 0.0
        return ng * self.share_bytes * 2 * (c - 1) / c

    def collectives_per_layer(self, p: str) -> int:
        """Collectives per layer in pass ``p``: the all-to-alls, and in the forward the shares'
        all-reduce when ng < size."""
        share = p == "fwd" and self.num_query_groups < self.size
        return A2A_PER_LAYER + int(share)

    def stage_coefficients(self, coef: dict, layers: int, folded_tokens: int = None) -> dict:
        """One stage's CP=1 coefficients ``{fwd, bwd: [5]}`` -> one CP rank's (``layers``
        decoder layers on the stage; 0 for an empty stage of a layout string, which pays the embedding /
        LM head's token work and no per-layer collective). ``folded_tokens``: a table profiled at one token total
        T0 has no ``tokens`` coefficient (0; that work sits in the intercept): the intercept is
        then read as ``T0`` tokens' work and divided like it (launch latencies in it do not divide,
        so this errs fast; a negative intercept, which a fit can give, is left as it is)."""
        if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or layers < 0:
            raise ValueError(f"layers={layers!r}: expected an integer >= 0 (0: an empty stage, "
                             f"the embedding or LM head alone)")
        if self.size == 1:
            return coef
        c, bw = self.size, float(self.a2a_bytes_per_s)
        out = {}
        for p in ("fwd", "bwd"):
            x = np.array(coef[p], dtype=np.float64)
            if folded_tokens and x[1] == 0.0 and x[0] > 0.0:
                x[1], x[0] = x[0] / folded_tokens, 0.0
            x[0] += layers * self.collectives_per_layer(p) * self.collective_latency_s
            x[1] = x[1] / c + layers * self.a2a_bytes_per_token() / bw
            x[2] = x[2] / c
            x[3] = x[3] / self.selection_split
            x[5:6] = x[5:6] / c                                   # dense work, if any
            # x[6:]: the per-call costs (sparse, dense call) do not divide: launches
            if p == "fwd":
                x[3] += layers * self.share_bytes_per_pair() / bw
            out[p] = x
        return out
