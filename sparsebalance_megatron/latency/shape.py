"""The one description of a GPT's shape and execution that latency tables, the profiler, the
analytic model and the runs share.

``ModelShape`` holds Megatron's model flags (``as_table_model``: a table's ``model`` section), the
pipeline size, and how a stage runs (``as_table_execution``: TP size, transformer implementation,
activation recomputation). It is built from a run's parsed args (``from_megatron_args``) or a
table's ``model`` section (``from_table_model``), turned
back into profiler flags (``cli_flags``), and checked for what the profiler can measure.

Pure Python; must not import torch or megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .table import EXECUTION


@dataclass
class ModelShape:
    """The GPT a latency table describes (Megatron flag names in comments); the defaults are
    Qwen2.5-0.5B at 32K tokens per micro-batch."""

    num_layers: int = 24             # --num-layers (whole model)
    hidden_size: int = 896           # --hidden-size
    ffn_hidden_size: int = 4864      # --ffn-hidden-size
    num_attention_heads: int = 14    # --num-attention-heads
    num_query_groups: int = 2        # --num-query-groups
    kv_channels: Optional[int] = None  # --kv-channels (default hidden / heads)
    vocab_size: int = 151936         # padded vocabulary
    seq_length: int = 32768          # tokens per packed micro-batch
    pp: int = 1                      # --pipeline-model-parallel-size
    swiglu: bool = True              # --swiglu (gated SiLU MLP); else Megatron's GeLU MLP
    # how the stage runs (the table's "execution" section, not its "model" section)
    tensor_model_parallel_size: int = 1   # --tensor-model-parallel-size (only 1 is profiled)
    transformer_impl: str = "local"       # --transformer-impl: local | transformer_engine
    recompute_granularity: str = "none"   # --recompute-granularity (Megatron's None = "none")

    @classmethod
    def from_megatron_args(cls, args) -> "ModelShape":
        """The shape of a training run (Megatron's parsed and validated args; a hand-built
        namespace without the execution fields gets TP 1, no recomputation and the local
        implementation, the plugin's CPU defaults)."""
        return cls(num_layers=args.num_layers, hidden_size=args.hidden_size,
                   ffn_hidden_size=args.ffn_hidden_size,
                   num_attention_heads=args.num_attention_heads,
                   num_query_groups=args.num_query_groups or args.num_attention_heads,
                   kv_channels=args.kv_channels, vocab_size=args.padded_vocab_size,
                   seq_length=args.seq_length * args.micro_batch_size,
                   pp=args.pipeline_model_parallel_size, swiglu=bool(args.swiglu),
                   tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
                   transformer_impl=getattr(args, "transformer_impl", "local"),
                   recompute_granularity=getattr(args, "recompute_granularity", None) or "none")

    @classmethod
    def from_table_model(cls, model: dict) -> "ModelShape":
        """The shape a table's ``model`` section describes (the inverse of ``as_table_model``;
        execution fields and pp at their defaults). ``ValueError`` naming the section when a
        size the shape cannot default is missing or not a number."""
        required = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
        try:
            kw = {k: int(model[k]) for k in required}
            for k in ("num_layers", "seq_length", "num_query_groups", "kv_channels"):
                if model.get(k):
                    kw[k] = int(model[k])
            kw.setdefault("num_query_groups", kw["num_attention_heads"])
            if "swiglu" in model:
                kw["swiglu"] = bool(model["swiglu"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"latency table model {model!r}: expected {', '.join(required)} "
                             f"as numbers ({e!r})") from e
        return cls(**kw)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def as_table_model(self) -> dict:
        """The ``model`` section of a latency table measured on this shape."""
        d = dict(self.__dict__)
        for k in ("pp", *EXECUTION):
            d.pop(k)
        d["kv_channels"] = self.head_dim
        return d

    def as_table_execution(self) -> dict:
        """The ``execution`` section: TP size, transformer implementation, recomputation."""
        return {k: getattr(self, k) for k in EXECUTION}

    def check_profilable(self) -> None:
        """``ValueError`` naming the setting when this stage cannot be profiled here."""
        if self.tensor_model_parallel_size != 1:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tensor_model_parallel_size}: the profiler "
                f"builds a 1-process stage and can neither measure nor model tensor-parallel "
                f"time (sharded GEMMs plus all-reduces); profile with "
                f"--tensor-model-parallel-size 1 and run with --sb-latency-table-force, knowing "
                f"that the table then predicts TP=1 times")
        for k, allowed in EXECUTION.items():
            if allowed is not None and getattr(self, k) not in allowed:
                raise ValueError(f"--{k.replace('_', '-')} {getattr(self, k)!r}: expected one of "
                                 f"{allowed}")

    def cli_flags(self) -> list[str]:
        """``sparsebalance-profile`` flags that profile this shape."""
        flags = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                 "--ffn-hidden-size", self.ffn_hidden_size,
                 "--num-attention-heads", self.num_attention_heads,
                 "--num-query-groups", self.num_query_groups, "--vocab-size", self.vocab_size,
                 "--seq-length", self.seq_length, "--pipeline-model-parallel-size", self.pp,
                 "--swiglu" if self.swiglu else "--no-swiglu",
                 "--tensor-model-parallel-size", self.tensor_model_parallel_size,
                 "--transformer-impl", self.transformer_impl,
                 "--recompute-granularity", self.recompute_granularity]
        if self.kv_channels is not None:
            flags += ["--kv-channels", self.kv_channels]
        return [str(f) for f in flags]
