"""The profiled shape is derived once from a run's args: table expectation, profiler flags."""

from types import SimpleNamespace

import pytest

from sparsebalance_megatron.latency.shape import ModelShape
from sparsebalance_megatron.megatron.profile_cli import build_parser, shape_from_cli


def megatron_args(**kw):
    base = dict(num_layers=4, hidden_size=128, ffn_hidden_size=384, num_attention_heads=4,
                num_query_groups=2, kv_channels=32, padded_vocab_size=42240, seq_length=1024,
                micro_batch_size=2, pipeline_model_parallel_size=2, swiglu=True)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw", [{}, {"swiglu": False}, {"kv_channels": None},
                                {"num_query_groups": None}])
def test_cli_flags_profile_the_run_shape(kw):
    shape = ModelShape.from_megatron_args(megatron_args(**kw))
    assert shape.seq_length == 2048 and shape.vocab_size == 42240 and shape.pp == 2
    parsed = build_parser().parse_args(shape.cli_flags() + ["--out", "x.json"])
    assert shape_from_cli(parsed) == shape


def test_table_model_section_names_every_dimension():
    model = ModelShape.from_megatron_args(megatron_args(kv_channels=None, swiglu=False)
                                          ).as_table_model()
    assert model == {"num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 384,
                     "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 32,
                     "vocab_size": 42240, "seq_length": 2048, "swiglu": False}
