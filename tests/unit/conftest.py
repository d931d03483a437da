"""Fixtures shared by the latency-table tests."""

import json

import pytest

from sparsebalance_megatron.latency import ModelShape, analytic_table


@pytest.fixture
def table():
    """A PP=2 analytic latency table (4 layers, 4,096 tokens), fresh for every test."""
    return analytic_table(ModelShape(num_layers=4, seq_length=4096), pp=2)


def write_table(tmp_path, obj, name="t.json") -> str:
    """Write ``obj`` (a dict as JSON, or a string as is) to ``tmp_path / name``; return the path."""
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)
