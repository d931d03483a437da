"""Megatron's pipeline layouts: how many decoder layers each (virtual) pipeline stage holds.

A ``PipelineLayout`` is what Megatron builds from its flags: ``--pipeline-model-parallel-size``
(pp), the interleaved schedule's model chunks per rank (vp, from
``--num-virtual-stages-per-pipeline-rank`` / ``--num-layers-per-virtual-pipeline-stage`` / a
layout string), and the split of ``--num-layers`` over the stages:

- even (the default): ``num_layers / (pp * vp)`` per virtual stage;
- ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: the
  first (last) rank holds F (L) layers, the other ranks share the rest evenly; with vp > 1 every
  rank's layers are split evenly over its chunks;
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding (loss) counts as one layer of the even split, so its stage builds one layer fewer;
- ``--pipeline-model-parallel-layout`` (e.g. ``"Ettt|tt|tt|ttL"``, ``"E|(tt|)*4,L"``): the layer
  list of every virtual stage.

Virtual stage ``v = chunk * pp + rank`` runs ``layers[v]`` decoder layers; the embedding is on
virtual stage 0 and the LM head + loss on the last (Megatron requires both). The arithmetic
follows megatron-core 0.19's ``get_num_layers_to_build`` and ``PipelineParallelLayerLayout``;
every setting Megatron refuses is refused here too, with a ``LayoutError`` naming the flag.

Pure Python; must not import torch or megatron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence


class LayoutError(ValueError):
    """A pipeline layout Megatron would refuse (or this plugin cannot model); names the flag."""


ATTENTION, MLP = "*", "-"
"""HybridModel layer symbols the plugin serves (Megatron's ``Symbols.ATTENTION`` / ``MLP``)."""
HYBRID_SYMBOLS = {"M": "Mamba", "G": "gated delta net", "*": "attention",
                  "D": "DeepSeek sparse attention", "+": "multi-latent attention", "-": "MLP",
                  "E": "MoE"}
"""Every decoder-layer symbol of megatron-core 0.19's ``hybrid_layer_allocation.Symbols``."""


@dataclass(frozen=True)
class PipelineLayout:
    """Decoder layers per virtual stage (``v = chunk * pp + rank``)."""

    pp: int
    vp: int
    layers: tuple
    pattern: Optional[str] = None
    """HybridModel: the symbol of every decoder layer in order (``--hybrid-layer-pattern``
    without ``|``); None for a GPT (every layer is attention + MLP)."""

    def __post_init__(self):
        for name, v in (("pp", self.pp), ("vp", self.vp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"pipeline layout {name}={v!r}: expected an integer >= 1")
        layers = tuple(self.layers)
        if len(layers) != self.pp * self.vp:
            raise LayoutError(f"pipeline layout: {len(layers)} stage layer counts for pp={self.pp}"
                              f" x vp={self.vp}: expected {self.pp * self.vp}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in layers):
            raise LayoutError(f"pipeline layout layers={list(layers)}: expected integers >= 0")
        if self.vp > 1 and self.pp < 2:
            raise LayoutError(f"pipeline layout: vp={self.vp} needs pp >= 2 (the interleaved "
                              f"schedule is a pipeline schedule)")
        object.__setattr__(self, "layers", layers)
        if self.pattern is not None:
            bad = sorted(set(str(self.pattern)) - set(HYBRID_SYMBOLS))
            if not isinstance(self.pattern, str) or bad or len(self.pattern) != sum(layers):
                raise LayoutError(f"pipeline layout pattern={self.pattern!r}: expected "
                                  f"{sum(layers)} layer symbols of {''.join(HYBRID_SYMBOLS)}")

    # --- views ------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """Virtual stages (pp x vp)."""
        return self.pp * self.vp

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    @property
    def interleaved(self) -> bool:
        return self.vp > 1

    def kinds(self) -> list[str]:
        """Stage kind of every virtual stage: the first carries the embedding, the last the LM
        head + loss; a single stage is ``only``."""
        nv = self.num_stages
        if nv == 1:
            return ["only"]
        return ["first"] + ["middle"] * (nv - 2) + ["last"]

    def rank_of(self, v: int) -> int:
        return v % self.pp

    def chunk_of(self, v: int) -> int:
        return v // self.pp

    def stage_of(self, rank: int, chunk: int = 0) -> int:
        """Virtual stage of (pipeline rank, model chunk)."""
        if not (0 <= rank < self.pp and 0 <= chunk < self.vp):
            raise LayoutError(f"(rank {rank}, chunk {chunk}): expected rank in [0, {self.pp}) "
                              f"and chunk in [0, {self.vp})")
        return chunk * self.pp + rank

    def layer_stages(self) -> list[int]:
        """Virtual stage of every decoder layer: entry ``n - 1`` for Megatron's global 1-based
        layer number ``n`` (the model's layers in order, virtual stage after virtual stage)."""
        return [v for v, n in enumerate(self.layers) for _ in range(n)]

    def stage_patterns(self) -> list[str]:
        """Layer symbols of every virtual stage (a GPT's layers are ``t``, attention + MLP)."""
        pattern = self.pattern if self.pattern is not None else "t" * self.num_layers
        ends = [0]
        for n in self.layers:
            ends.append(ends[-1] + n)
        return [pattern[a:b] for a, b in zip(ends[:-1], ends[1:])]

    @property
    def attention_layers(self) -> tuple:
        """Attention layers of every virtual stage: what the sparse attention budgets (a GPT's
        every layer; a HybridModel's ``*`` layers)."""
        if self.pattern is None:
            return self.layers
        return tuple(p.count(ATTENTION) for p in self.stage_patterns())

    def hybrid_pattern(self) -> str:
        """``--hybrid-layer-pattern`` of this layout: the symbols, ``|`` between stages."""
        if self.pattern is None:
            raise LayoutError("a GPT layout has no --hybrid-layer-pattern")
        return "|".join(self.stage_patterns())

    def rank_layers(self) -> list[int]:
        """Decoder layers held by every pipeline rank (its chunks together)."""
        return [sum(self.layers[c * self.pp + r] for c in range(self.vp)) for r in range(self.pp)]

    def is_even(self) -> bool:
        return len(set(self.layers)) == 1

    def describe(self) -> str:
        """``8/7/7/2``; with vp > 1 every rank's chunks in brackets, ``[4+4]/[4+4]``; a
        HybridModel's adds its pattern, ``2/2 (*-|*-)``."""
        if self.vp == 1:
            out = "/".join(str(n) for n in self.layers)
        else:
            out = "/".join("[" + "+".join(str(self.layers[c * self.pp + r])
                                          for c in range(self.vp)) + "]" for r in range(self.pp))
        return out if self.pattern is None else f"{out} ({self.hybrid_pattern()})"

    def layout_string(self) -> str:
        """Megatron's ``--pipeline-model-parallel-layout`` string of this layout."""
        parts = []
        for v, n in enumerate(self.layers):
            s = ("E" if v == 0 else "") + ("t*%d" % n if n > 1 else "t" * n)
            parts.append(s + ("L" if v == self.num_stages - 1 else ""))
        return "|".join(parts)

    def megatron_flags(self) -> list[str]:
        """Megatron flags that build this layout (with ``--pipeline-model-parallel-size`` and
        ``--num-layers``): none for an even split, first/last counts where they express it,
        else a layout string; a HybridModel's: its ``--hybrid-layer-pattern``."""
        if self.pattern is not None:
            return ["--hybrid-layer-pattern", self.hybrid_pattern()]
        flags = [] if self.num_stages == 1 or self.is_even() else self._count_flags()
        if flags is None:
            return ["--pipeline-model-parallel-layout", self.layout_string()]
        if self.vp > 1:
            flags += ["--num-virtual-stages-per-pipeline-rank", str(self.vp)]
        return flags

    def _count_flags(self) -> Optional[list[str]]:
        """The first/last-count flags that rebuild this layout, or None if none do."""
        first, last = self.rank_layers()[0], self.rank_layers()[-1]
        for f, l in ((None, last), (first, None), (first, last)):
            try:
                if PipelineLayout.from_counts(self.num_layers, self.pp, self.vp,
                                              first=f, last=l) != self:
                    continue
            except LayoutError:
                continue
            return ((["--decoder-first-pipeline-num-layers", str(f)] if f is not None else [])
                    + (["--decoder-last-pipeline-num-layers", str(l)] if l is not None else []))
        return None

    def as_dict(self) -> dict:
        out = {"pp": self.pp, "vp": self.vp, "layers": list(self.layers)}
        return out if self.pattern is None else dict(out, pattern=self.pattern)

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineLayout":
        try:
            return cls(int(d["pp"]), int(d.get("vp", 1)), tuple(int(x) for x in d["layers"]),
                       d.get("pattern"))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"pipeline layout {d!r}: expected {{'pp', 'vp', 'layers'}}") from e

    # --- construction (Megatron's rules) ----------------------------------------------------
    @classmethod
    def even(cls, num_layers: int, pp: int = 1, vp: int = 1) -> "PipelineLayout":
        return cls.from_counts(num_layers, pp, vp)

    @classmethod
    def from_counts(cls, num_layers: int, pp: int, vp: int = 1, *, first: Optional[int] = None,
                    last: Optional[int] = None, account_for_embedding: bool = False,
                    account_for_loss: bool = False) -> "PipelineLayout":
        """Megatron's split without a layout string (``get_num_layers_to_build``)."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise LayoutError(f"--num-layers={num_layers!r}: expected an integer >= 1")
        if pp < 1 or vp < 1:
            raise LayoutError(f"pp={pp!r}, vp={vp!r}: expected integers >= 1")
        uneven = first is not None or last is not None
        if uneven and (account_for_embedding or account_for_loss):
            raise LayoutError("--decoder-first/last-pipeline-num-layers with --account-for-"
                              "embedding/loss-in-pipeline-split: Megatron refuses the mix")
        if uneven and pp < 2:
            raise LayoutError("--decoder-first/last-pipeline-num-layers need "
                              "--pipeline-model-parallel-size >= 2")
        for flag, n in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise LayoutError(f"{flag}={n!r}: expected an integer >= 1 (Megatron's rule)")
        if uneven:
            rest, left = num_layers, pp
            for n in (first, last):
                if n is not None:
                    rest, left = rest - n, left - 1
            if rest < 0 or bool(rest) != bool(left):
                raise LayoutError(f"--decoder-first/last-pipeline-num-layers {first}/{last}: "
                                  f"the {max(rest, 0)} remaining layer(s) of --num-layers="
                                  f"{num_layers} cannot fill the {left} other pipeline stage(s) "
                                  f"(Megatron needs layers on every middle stage, none left "
                                  f"over)")
            if left > 0 and rest % left:
                raise LayoutError(f"--decoder-first/last-pipeline-num-layers {first}/{last}: the "
                                  f"{rest} other layers must divide evenly over the {left} other "
                                  f"pipeline stage(s)")
            per_rank = [rest // left if left else 0] * pp
            if first is not None:
                per_rank[0] = first
            if last is not None:
                per_rank[-1] = last
        else:
            total = num_layers + int(account_for_embedding) + int(account_for_loss)
            if total % pp:
                raise LayoutError(f"--num-layers={num_layers}"
                                  + (" + embedding" if account_for_embedding else "")
                                  + (" + loss" if account_for_loss else "")
                                  + f" = {total} is not divisible by "
                                  f"--pipeline-model-parallel-size={pp}")
            per_rank = [total // pp] * pp
        layers = []
        for c in range(vp):
            for r in range(pp):
                if vp > 1 and per_rank[r] % vp:
                    raise LayoutError(f"pipeline rank {r} holds {per_rank[r]} layers: not "
                                      f"divisible by the {vp} virtual stages per rank")
                layers.append(per_rank[r] // vp)
        if account_for_embedding:
            layers[0] -= 1
        if account_for_loss:
            layers[-1] -= 1
        if min(layers) < 0:
            raise LayoutError(f"--account-for-embedding/loss-in-pipeline-split: a stage of "
                              f"{num_layers} layers over pp={pp} x vp={vp} has none to give")
        return cls(pp, vp, tuple(layers))

    @classmethod
    def from_string(cls, layout: str, pp: int, num_layers: Optional[int] = None
                    ) -> "PipelineLayout":
        """``--pipeline-model-parallel-layout`` (Megatron's syntax: stages split by ``|``,
        ``E`` embedding, ``t`` decoder layer, ``L`` loss, ``x*n`` and ``(...)*n`` repeat,
        commas cosmetic). Multi-token prediction (``m``) is refused."""
        flag = "--pipeline-model-parallel-layout"
        if not isinstance(layout, str) or not layout:
            raise LayoutError(f"{flag}={layout!r}: expected a layout string such as 'Ett|tt|ttL'")
        s = layout.replace(",", "")
        for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
            s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
        stages = s.split("|")
        bad = sorted(set(s) - set("EtL|"))
        if bad:
            what = ("multi-token prediction layers ('m') are not supported with the sparse "
                    "attention" if bad == ["m"] else f"unknown character(s) {bad}")
            raise LayoutError(f"{flag}={layout!r}: {what}; expected E, t, L, |, *n and (...)")
        if len(stages) % pp:
            raise LayoutError(f"{flag}={layout!r}: {len(stages)} stages are not divisible by "
                              f"--pipeline-model-parallel-size={pp}")
        if s.count("E") != 1 or "E" not in stages[0] or not stages[0].startswith("E"):
            raise LayoutError(f"{flag}={layout!r}: the embedding 'E' must appear once, first in "
                              f"the first stage")
        if s.count("L") != 1 or not stages[-1].endswith("L"):
            raise LayoutError(f"{flag}={layout!r}: the loss 'L' must appear once, last in the "
                              f"last stage")
        out = cls(pp, len(stages) // pp, tuple(st.count("t") for st in stages))
        if num_layers is not None and out.num_layers != num_layers:
            raise LayoutError(f"{flag}={layout!r} has {out.num_layers} decoder layers: expected "
                              f"--num-layers={num_layers}")
        return out

    @classmethod
    def from_hybrid_pattern(cls, pattern: str, pp: int = 1, *, first: Optional[int] = None,
                            last: Optional[int] = None) -> "PipelineLayout":
        """HybridModel's layout (megatron-core 0.19's ``select_pipeline_segment``): with ``|``,
        segment ``v = chunk * pp + rank`` is virtual stage v (their number a multiple of pp);
        without, Megatron's even or first/last split of the layers. Multi-token prediction
        (``/``) is refused."""
        flag = "--hybrid-layer-pattern"
        if not isinstance(pattern, str) or not pattern.replace("|", ""):
            raise LayoutError(f"{flag}={pattern!r}: expected layer symbols such as '*-*-'")
        if "/" in pattern:
            raise LayoutError(f"{flag} {pattern!r}: multi-token prediction ('/') is not "
                              f"supported with the sparse attention")
        bad = sorted(set(pattern) - set(HYBRID_SYMBOLS) - {"|"})
        if bad:
            raise LayoutError(f"{flag} {pattern!r}: unknown layer symbol(s) {bad}; expected "
                              f"{''.join(HYBRID_SYMBOLS)} and '|'")
        segments = pattern.split("|")
        flat = pattern.replace("|", "")
        if len(segments) == 1:
            lay = cls.from_counts(len(flat), pp, first=first, last=last)
            return cls(lay.pp, lay.vp, lay.layers, flat)
        if first is not None or last is not None:
            raise LayoutError(f"{flag} {pattern!r} with '|' and --decoder-first/last-pipeline-"
                              f"num-layers: Megatron refuses the mix")
        if len(segments) % pp:
            raise LayoutError(f"{flag} {pattern!r}: {len(segments)} '|' segments are not "
                              f"divisible by --pipeline-model-parallel-size={pp}")
        return cls(pp, len(segments) // pp, tuple(len(s) for s in segments), flat)

    @classmethod
    def from_megatron_args(cls, args) -> "PipelineLayout":
        """The layout of a run (Megatron's parsed and validated args): a HybridModel's when
        ``--hybrid-layer-pattern`` is set."""
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        pattern = getattr(args, "hybrid_layer_pattern", None)
        if pattern is not None:
            return cls.from_hybrid_pattern(
                str(pattern), pp, first=getattr(args, "decoder_first_pipeline_num_layers", None),
                last=getattr(args, "decoder_last_pipeline_num_layers", None))
        vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
        string = getattr(args, "pipeline_model_parallel_layout", None)
        if string is not None:
            return cls.from_string(str(string), pp, args.num_layers)
        return cls.from_counts(
            int(args.num_layers), pp, vp,
            first=getattr(args, "decoder_first_pipeline_num_layers", None),
            last=getattr(args, "decoder_last_pipeline_num_layers", None),
            account_for_embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split",
                                               False)),
            account_for_loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)))


def candidate_layouts(num_layers: int, pp: int, vps: Sequence[int] = (1,),
                      max_candidates: int = 4096) -> list[PipelineLayout]:
    """Every layout Megatron's first/last counts (and the embedding/loss accounting flags)
    can build for ``num_layers`` over ``pp`` ranks and each vp in ``vps``, even split first;
    duplicates removed. With pp <= 2 every split is reachable this way."""
    seen, out = set(), []

    def add(lay):
        if lay.layers not in seen and len(out) < max_candidates:
            seen.add(lay.layers)
            out.append(lay)

    for vp in vps:
        if vp > 1 and pp < 2:
            continue
        for emb, loss in ((False, False), (True, False), (False, True), (True, True)):
            try:
                add(PipelineLayout.from_counts(num_layers, pp, vp, account_for_embedding=emb,
                                               account_for_loss=loss))
            except LayoutError:
                pass
        if pp < 2:
            continue
        for first in [None] + list(range(1, num_layers + 1)):
            for last in [None] + list(range(1, num_layers + 1)):
                if first is None and last is None:
                    continue
                try:
                    add(PipelineLayout.from_counts(num_layers, pp, vp, first=first, last=last))
                except LayoutError:
                    pass
    return out
